"""Built-in harnesses: ``answer`` (one LLM call), ``multi_turn`` (a fixed number of LLM
calls, each after an observation) and ``tool_agent`` (a short tool loop).

After each LLM call every built-in harness spends ``run.env_seconds`` in its environment
(the local Arena's ``env_latency_ms`` fault setting): the time a tool run or a sandbox step
takes in a real agent, so that a run can be dominated by environment time.

The ``tool_agent`` model may call ``run_python`` and ``bash``, which run in the shared
:mod:`examples.swe.local_arena.sandbox` with the task's working directory as HOME, and
``submit``, whose argument ends the episode as the answer. With ``options.toolset:
claude-code`` it gets Claude Code's shell tool instead: ``Bash`` (``command``, an optional
integer ``timeout`` in milliseconds, ``description``) plus ``submit``, so that over the
``anthropic`` protocol it plays Claude Code's part for a policy that must emit typed tool
arguments (Flash V3's claude-code Streams).
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from examples.swe.local_arena import sandbox
from examples.swe.local_arena.harnesses.llm import ToolCall, ToolDef, llm_client
from examples.swe.local_arena.harnesses.results import HarnessResultError, gameagent_fields
from examples.swe.local_arena.harnesses.session import clip
from examples.swe.local_arena.types import HarnessError, HarnessOutput, HarnessRun, HarnessSpec

__all__ = [
    "CLAUDE_CODE_TOOLS",
    "TOOLS",
    "TOOLSETS",
    "ToolCallError",
    "run_answer",
    "run_multi_turn",
    "run_tool_agent",
]

ANSWER_SYSTEM = "Answer the question. Reply with only the final answer, as briefly as possible."
AGENT_SYSTEM = (
    "Solve the task. You may call run_python (runs a Python program) and bash (runs a shell "
    "command); both run in a scratch directory without network access. When you know the "
    "answer, call submit with only the final answer."
)
CLAUDE_CODE_SYSTEM = (
    "Solve the task. You may call Bash, which runs a shell command in a scratch directory "
    "without network access (timeout in milliseconds). When you know the answer, call "
    "submit with only the final answer."
)
OBSERVATION = "Observation: the environment ran your step. Continue, then give the final answer."
TOOL_OUTPUT_BYTES = 4096  # what the model sees of a tool's output (head and tail halves)


# --- answer ---


async def run_answer(spec: HarnessSpec, run: HarnessRun) -> HarnessOutput:
    """One LLM call; the reply text is the answer."""
    system = spec.options.get("system") or ANSWER_SYSTEM
    async with llm_client(spec, run) as llm:
        history = llm.wire.start(system, run.prompt)
        reply = await llm.call(system, history, [])
        await _environment(run)
    transcript = [{"turn": 1, "role": "assistant", "text": clip(reply.text)}]
    return HarnessOutput(reply.text, turns=1, transcript=transcript)


# --- multi_turn ---


async def run_multi_turn(spec: HarnessSpec, run: HarnessRun) -> HarnessOutput:
    """``turns`` LLM calls (option, default 3); after each, the environment's time and an
    observation as the next user message. The last non-empty reply is the answer."""
    system = spec.options.get("system") or ANSWER_SYSTEM
    turns = spec.options.get("turns", 3)
    if isinstance(turns, bool) or not isinstance(turns, int) or not 1 <= turns <= 100:
        raise HarnessError(
            f"harness {spec.ref}: options.turns must be an integer in [1, 100], got {turns!r}"
        )
    transcript: list[dict[str, Any]] = []
    answer = ""
    async with llm_client(spec, run) as llm:
        history = llm.wire.start(system, run.prompt)
        for turn in range(1, turns + 1):
            reply = await llm.call(system, history, [])
            history.extend(reply.history)
            transcript.append({"turn": turn, "role": "assistant", "text": clip(reply.text)})
            answer = reply.text if (reply.text or "").strip() else answer
            await _environment(run)
            if turn < turns:
                history.append({"role": "user", "content": OBSERVATION})
    return HarnessOutput(answer, turns=turns, transcript=transcript)


async def _environment(run: HarnessRun) -> None:
    """The environment's share of a turn (``run.env_seconds``)."""
    if run.env_seconds > 0:
        await asyncio.sleep(run.env_seconds)


# --- tool_agent ---

SUBMIT = ToolDef(
    "submit",
    "Submit the final answer; this ends the task.",
    {
        "type": "object",
        "properties": {"answer": {"type": "string", "description": "the final answer"}},
        "required": ["answer"],
    },
)
TOOLS = [
    ToolDef(
        "run_python",
        "Run a Python 3 program and return its stdout and stderr. Print what you need.",
        {
            "type": "object",
            "properties": {"code": {"type": "string", "description": "the program"}},
            "required": ["code"],
        },
    ),
    ToolDef(
        "bash",
        "Run a bash command and return its stdout and stderr.",
        {
            "type": "object",
            "properties": {"command": {"type": "string", "description": "the command"}},
            "required": ["command"],
        },
    ),
    SUBMIT,
]
# Claude Code's shell tool, with its typed optional timeout (milliseconds).
CLAUDE_CODE_TOOLS = [
    ToolDef(
        "Bash",
        "Run a bash command and return its stdout and stderr.",
        {
            "type": "object",
            "properties": {
                "command": {"type": "string", "description": "the command to run"},
                "timeout": {"type": "integer", "description": "optional timeout in milliseconds"},
                "description": {"type": "string", "description": "what the command does"},
            },
            "required": ["command"],
        },
    ),
    SUBMIT,
]
# toolset option -> (tools, default system prompt)
TOOLSETS = {
    "default": (TOOLS, AGENT_SYSTEM),
    "claude-code": (CLAUDE_CODE_TOOLS, CLAUDE_CODE_SYSTEM),
}
_TOOL_ARGUMENT = {"run_python": "code", "bash": "command", "Bash": "command", "submit": "answer"}


async def run_tool_agent(spec: HarnessSpec, run: HarnessRun) -> HarnessOutput:
    """Up to ``max_turns`` LLM calls with tools; ``submit`` or a turn without tool calls
    ends the episode, else the last non-empty assistant text stands as the answer.

    With the option ``outcome_codes`` the agent reports as a GameAgent harness does: a run
    that uses every turn without ending fails with ``AGENT_MAX_TURNS_EXCEEDED``.
    """
    toolset = spec.options.get("toolset", "default")
    if toolset not in TOOLSETS:
        raise HarnessError(
            f"harness {spec.ref}: options.toolset must be one of {', '.join(TOOLSETS)}, "
            f"got {toolset!r}"
        )
    tools, default_system = TOOLSETS[toolset]
    system = spec.options.get("system") or default_system
    max_turns = int(spec.options.get("max_turns", 6))
    tool_timeout = float(spec.options.get("tool_timeout", 10.0))
    transcript: list[dict[str, Any]] = []
    answer = ""
    async with llm_client(spec, run) as llm:
        history = llm.wire.start(system, run.prompt)
        for turn in range(1, max_turns + 1):
            reply = await llm.call(system, history, tools)
            await _environment(run)
            history.extend(reply.history)
            transcript.append(
                {
                    "turn": turn,
                    "role": "assistant",
                    "text": clip(reply.text),
                    "tools": [c.name for c in reply.calls],
                }
            )
            answer = reply.text if (reply.text or "").strip() else answer
            if not reply.calls:
                return HarnessOutput(reply.text, turns=turn, transcript=transcript)
            results = []
            for call in reply.calls:
                try:
                    arguments = _tool_arguments(call, tools)
                    argument = _tool_argument(call, arguments)
                    timeout = _tool_timeout(call, arguments, tool_timeout)
                except ToolCallError as e:
                    output = f"error: {e}"
                else:
                    if call.name == "submit":
                        return HarnessOutput(argument, turns=turn, transcript=transcript)
                    output = await _run_tool(call.name, argument, run.workdir, timeout)
                results.append((call, output))
                transcript.append(
                    {"turn": turn, "role": "tool", "name": call.name, "output": clip(output)}
                )
            history.extend(llm.wire.tool_results(results))
    if spec.options.get("outcome_codes"):
        detail = f"no answer submitted in {max_turns} turns"
        fields = gameagent_fields("AGENT_MAX_TURNS_EXCEEDED", detail)
        raise HarnessResultError(fields["error"], {**fields, "turns": max_turns})
    return HarnessOutput(answer, turns=max_turns, transcript=transcript)


class ToolCallError(ValueError):
    """A tool call the agent cannot run; the message goes back to the model."""


def _tool_arguments(call: ToolCall, tools: list[ToolDef]) -> dict[str, Any]:
    """The decoded arguments of ``call`` to one of ``tools``."""
    names = [t.name for t in tools]
    if call.name not in names:
        listed = f"{', '.join(names[:-1])} and {names[-1]}" if len(names) > 1 else names[0]
        raise ToolCallError(f"unknown tool {call.name!r}; the tools are {listed}")
    arguments = call.arguments
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError as e:
            raise ToolCallError(f"the arguments of {call.name} are not valid JSON ({e})") from None
    return arguments if isinstance(arguments, dict) else {}


def _tool_argument(call: ToolCall, arguments: dict[str, Any]) -> str:
    """The one string argument every tool here takes (the program, command or answer)."""
    key = _TOOL_ARGUMENT[call.name]
    value = arguments.get(key)
    if call.name == "submit" and isinstance(value, int | float):
        value = str(value)
    if not isinstance(value, str):
        raise ToolCallError(f"{call.name} needs a string argument {key!r}")
    return value


def _tool_timeout(call: ToolCall, arguments: dict[str, Any], limit: float) -> float:
    """Seconds the call may run: its own ``timeout`` (milliseconds, an integer, ``Bash``
    only) when given, never more than the harness's ``limit``."""
    if call.name != "Bash" or arguments.get("timeout") is None:
        return limit
    value = arguments["timeout"]
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ToolCallError(
            f"Bash's timeout must be a positive integer (milliseconds), got {value!r}"
        )
    return min(value / 1000, limit)


# The program comes as argv[1] so tracebacks keep its own line numbers.
PYTHON_BOOTSTRAP = (
    sandbox.SOCKET_GUARD
    + """\
import linecache, sys
_code = sys.argv.pop(1)
sys.argv[0] = "<run_python>"
linecache.cache["<run_python>"] = (len(_code), None, _code.splitlines(True), "<run_python>")
exec(compile(_code, "<run_python>", "exec"), {"__name__": "__main__"})
"""
)


async def _run_tool(name: str, argument: str, workdir: Path, timeout: float) -> str:
    if name == "run_python":
        argv = [sys.executable, "-I", "-c", PYTHON_BOOTSTRAP, argument]
    else:  # bash, Bash
        argv = ["/bin/bash", "-c", argument]
    # The first call probes unshare with a child process: keep it off the event loop.
    prefix = await asyncio.to_thread(sandbox.unshare_prefix)
    env = sandbox.minimal_env(workdir, str(Path(sys.executable).parent))
    half = TOOL_OUTPUT_BYTES // 2
    result = await sandbox.run_captured(
        [*prefix, *argv], env, workdir, timeout, head=half, tail=half, merge=True
    )
    output = result.stdout
    if result.timed_out:
        output += f"\n[timed out after {timeout:g} s]"
    elif result.returncode != 0:
        output += f"\n[exit code {result.returncode}]"
    return output.strip() or "(no output)"
