"""Harnesses of the local Arena: the agents that work on one task against an LLM endpoint.

:func:`run_harness` picks the implementation by ``HarnessSpec.kind``:

* ``answer``: one LLM call in ``spec.protocol``; the reply text is the answer.
* ``multi_turn``: ``options.turns`` LLM calls, each after an observation message; the last
  reply is the answer (an agent workload without tools, for benchmarks).
* ``tool_agent``: a short loop in which the model may call ``run_python``, ``bash`` and
  ``submit``; ``submit`` ends the episode with its argument as the answer. With
  ``options.toolset: claude-code`` the tools are Claude Code's ``Bash`` and ``submit``
  (the catalog's ``claude-code@builtin-1.0.0``, Claude Code's part without the CLI).
* ``claude-code`` and ``codex``: the real CLIs (``make agent-clis``), run in ``run.workdir``
  with a throwaway HOME and nothing of this process's environment but PATH.

Session headers: the launch ``envs`` may carry ``ANTHROPIC_CUSTOM_HEADERS`` (``Name: value``
lines, e.g. ``X-Session-Id``/``X-Session-Token``). The gateway attributes a call to a
training session by them, so every built-in call sends them, Claude Code gets the variable
itself, and Codex gets them as provider headers read from its environment.

Tools and CLIs run as children of :mod:`examples.swe.local_arena.sandbox`: a minimal
environment (no inherited secrets), a timeout, bounded output; tools also get no network (a
network namespace when ``unshare`` works here, plus a socket guard inside Python programs).

Time: the whole run is bounded by ``run.timeout``; past it :class:`TimeoutError` propagates
(the server's TIMEOUT). Cancellation kills every child process group a harness started.

Modules: :mod:`.llm` (protocol clients), :mod:`.builtin` (``answer``, ``multi_turn``,
``tool_agent``), :mod:`.cli` (``claude-code``, ``codex``), :mod:`.session` (session
headers, redaction).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from examples.swe.local_arena.harnesses.builtin import run_answer, run_multi_turn, run_tool_agent
from examples.swe.local_arena.harnesses.cli import (
    CLI_KINDS,
    cli_available,
    run_claude_code,
    run_codex,
)
from examples.swe.local_arena.harnesses.session import session_headers
from examples.swe.local_arena.types import (
    LLM_PROTOCOLS,
    HarnessError,
    HarnessOutput,
    HarnessRun,
    HarnessSpec,
)

__all__ = ["CLI_KINDS", "HARNESS_KINDS", "cli_available", "run_harness", "session_headers"]

HARNESS_KINDS = ("answer", "multi_turn", "tool_agent", *CLI_KINDS)

_RUNNERS: dict[str, Callable[[HarnessSpec, HarnessRun], Awaitable[HarnessOutput]]] = {
    "answer": run_answer,
    "multi_turn": run_multi_turn,
    "tool_agent": run_tool_agent,
    "claude-code": run_claude_code,
    "codex": run_codex,
}


async def run_harness(spec: HarnessSpec, run: HarnessRun) -> HarnessOutput:
    """Run one task with the harness ``spec``; raises :class:`HarnessError` on failure and
    :class:`TimeoutError` once ``run.timeout`` seconds have passed."""
    runner = _RUNNERS.get(spec.kind)
    if runner is None:
        raise HarnessError(f"unknown harness kind {spec.kind!r}; expected one of {HARNESS_KINDS}")
    if spec.kind not in CLI_KINDS and spec.protocol not in LLM_PROTOCOLS:
        raise HarnessError(
            f"harness {spec.ref}: unknown protocol {spec.protocol!r}; expected one of "
            f"{LLM_PROTOCOLS}"
        )
    return await asyncio.wait_for(runner(spec, run), run.timeout)
