"""The real Claude Code and Codex CLIs against the rollout proxy, fully offline.

Each test starts the proxy on loopback in front of a scripted engine, opens a session, and
runs the pinned npm release of one CLI (``make agent-clis``) with a minimal environment
pointing it at the proxy. The engine is scripted rather than the tiny random model: that
model cannot write sensible text or tool calls, and Claude Code's ~40k-token prompts would
make CPU generation slow. What is under test is the wire protocol (``/v1/messages`` for
Claude Code, streaming ``/v1/responses`` for Codex) and that the session records exactly
the tokens the engine saw and produced.

The tool round trip has the engine answer with a Qwen-style ``<tool_call>`` until the
prompt holds a tool result; the CLI must run the shell command and send its output back.
The Ling 3 round trip does the same in Flash V3's format: the tiny Ling 3 tokenizer, the
``ling3`` parsers, and a think block plus a ``<arg_key>``/``<arg_value>`` call.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from transformers import AutoTokenizer

from areal.api.io_struct import ModelRequest, ModelResponse
from areal.proxy.parsers import get_reasoning_parser, get_tool_call_parser
from areal.proxy.server import ProxyServer
from tests.fakes.live_server import serve

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
CLI_BIN_DIR = REPO_ROOT / ".cache" / "agent-clis" / "node_modules" / ".bin"
ADMIN_KEY = "admin-key-agent-clis-5b1"
REPLY_TEXT = "hello from the scripted engine"
CLI_TIMEOUT_S = 120
# Claude Code sends ~40k prompt tokens; the proxy's default engine budget is 32k.
ENGINE_MAX_TOKENS = 400_000
LOGPROB = -0.25

# The shell tool call each CLI is asked to make, in the qwen25 format the proxy parses.
CLAUDE_TOOL_CALL = {
    "name": "Bash",
    "arguments": {"command": "echo hi > out.txt", "description": "write"},
}
CODEX_TOOL_CALL = {"name": "exec_command", "arguments": {"cmd": "echo hi > out.txt"}}
# The same Bash call as Ling 3 writes it (timeout typed by Claude Code's schema), and the
# reply once the tool ran.
LING3_TOOL_CALL = (
    "<think>\nI will write the file.\n</think>\n<tool_call>Bash\n"
    "<arg_key>command</arg_key>\n<arg_value>echo hi > out.txt</arg_value>\n"
    "<arg_key>description</arg_key>\n<arg_value>write</arg_value>\n"
    "<arg_key>timeout</arg_key>\n<arg_value>10000</arg_value>\n</tool_call>"
)
LING3_REPLY = f"<think>\nThe file is written.\n</think>\n{REPLY_TEXT}"


class ScriptedEngine:
    """Answers every request with fixed text; optionally a tool call until a tool result.

    Records the prompt tokens of every request, so the test can compare them with what the
    proxy stored for the session.
    """

    def __init__(self, tokenizer: Any, tool_call: dict | None = None):
        self.tokenizer = tokenizer
        self.tool_call = tool_call
        self.tool_response_id = tokenizer.convert_tokens_to_ids("<tool_response>")
        self.received: list[list[int]] = []
        self.sent: list[list[int]] = []
        self.version = 0

    def reply_tokens(self, text: str) -> list[int]:
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [*ids, self.tokenizer.eos_token_id]

    def _reply_text(self, input_ids: list[int]) -> str:
        if self.tool_call is None or self.tool_response_id in input_ids:
            return REPLY_TEXT
        return f"<tool_call>\n{json.dumps(self.tool_call)}\n</tool_call>"

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.received.append(list(req.input_ids))
        tokens = self.reply_tokens(self._reply_text(req.input_ids))
        self.sent.append(tokens)
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=tokens,
            output_logprobs=[LOGPROB] * len(tokens),
            output_versions=[self.version] * len(tokens),
            stop_reason="stop",
            latency=0.0,
            ttft=0.0,
            tokenizer=self.tokenizer,
        )

    def set_version(self, version: int) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version

    def pause(self) -> None:
        pass

    def resume(self) -> None:
        pass


class Ling3ScriptedEngine(ScriptedEngine):
    """Writes :data:`LING3_TOOL_CALL` until the prompt holds a tool result, then
    :data:`LING3_REPLY`."""

    def _reply_text(self, input_ids: list[int]) -> str:
        return LING3_REPLY if self.tool_response_id in input_ids else LING3_TOOL_CALL


# --- helpers ---


def cli_path(name: str, env_var: str) -> Path:
    path = Path(os.environ.get(env_var) or CLI_BIN_DIR / name)
    if not os.access(path, os.X_OK):
        pytest.skip(f"{name} CLI not installed at {path}; run `make agent-clis` (or set {env_var})")
    return path


def minimal_env(home: Path, **extra: str) -> dict[str, str]:
    """An ``env -i``-style environment: PATH (with node), a throwaway HOME, and ``extra``."""
    node = shutil.which("node")
    path = ["/usr/local/bin", "/usr/bin", "/bin"]
    if node is not None:
        path.insert(0, str(Path(node).parent))
    return {"PATH": os.pathsep.join(dict.fromkeys(path)), "HOME": str(home), **extra}


def run_cli(argv: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    result = subprocess.run(
        argv,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=CLI_TIMEOUT_S,
    )
    assert result.returncode == 0, (
        f"{argv[0]} exited {result.returncode}\n"
        f"stdout:\n{result.stdout[-4000:]}\nstderr:\n{result.stderr[-4000:]}"
    )
    return result


def admin_headers() -> dict[str, str]:
    return {"Authorization": f"Bearer {ADMIN_KEY}"}


def start_session(url: str, task_id: str) -> tuple[str, str]:
    httpx.post(f"{url}/grant_capacity", headers=admin_headers()).raise_for_status()
    response = httpx.post(
        f"{url}/rl/start_session", headers=admin_headers(), json={"task_id": task_id}
    )
    response.raise_for_status()
    body = response.json()
    return body["session_id"], body["api_key"]


def decode_tensor(entry: dict[str, Any]) -> np.ndarray:
    data = np.frombuffer(base64.b64decode(entry["data"]), dtype=np.dtype(entry["dtype"]))
    return data.reshape(entry["shape"])


def make_proxy(
    tokenizer: Any, engine: ScriptedEngine, tool_parser: str = "qwen25", reasoning: str = "qwen3"
) -> ProxyServer:
    return ProxyServer(
        engine,
        tokenizer,
        ADMIN_KEY,
        tool_call_parser=get_tool_call_parser(tool_parser),
        reasoning_parser=get_reasoning_parser(reasoning),
        engine_max_tokens=ENGINE_MAX_TOKENS,
    )


def check_recorded(server: ProxyServer, session_id: str, engine: ScriptedEngine, n: int) -> None:
    """The session holds ``n`` complete interactions, token-identical to the engine's calls."""
    interactions = [i for i in server.store.get(session_id).cache.values() if i.is_complete]
    assert len(interactions) == n
    assert len(engine.received) == n
    for interaction, received, sent in zip(interactions, engine.received, engine.sent, strict=True):
        assert interaction.prompt_tokens == received
        assert interaction.response.output_tokens == sent


def end_and_export(url: str, session_id: str, session_key: str) -> list[dict[str, Any]]:
    httpx.post(
        f"{url}/rl/end_session", headers={"Authorization": f"Bearer {session_key}"}
    ).raise_for_status()
    response = httpx.post(
        f"{url}/export_trajectories",
        headers=admin_headers(),
        json={"session_id": session_id},
        timeout=30,
    )
    response.raise_for_status()
    return response.json()["interactions"]


def check_exported(exported: dict[str, Any], prompt: list[int], output: list[int]) -> None:
    """One exported interaction is prompt + output, trainable (mask 1) only on the output."""
    tensors = {key: decode_tensor(entry) for key, entry in exported["tensors"].items()}
    n_prompt, n_out = len(prompt), len(output)
    assert tensors["input_ids"][0].tolist() == prompt + output
    assert tensors["loss_mask"][0].tolist() == [0] * n_prompt + [1] * n_out
    np.testing.assert_allclose(tensors["logprobs"][0, n_prompt:], [LOGPROB] * n_out)
    assert tensors["versions"][0, n_prompt:].tolist() == [0] * n_out


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_dir)


# --- Claude Code: /v1/messages ---


def claude_env(home: Path, url: str, session_key: str) -> dict[str, str]:
    return minimal_env(
        home,
        ANTHROPIC_BASE_URL=url,
        ANTHROPIC_API_KEY=session_key,
        # Without these Claude Code looks up Anthropic's hosts (telemetry, updates).
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_TELEMETRY="1",
        DISABLE_ERROR_REPORTING="1",
        DISABLE_AUTOUPDATER="1",
    )


def test_claude_code_single_turn(tokenizer: Any, tmp_path: Path) -> None:
    claude = cli_path("claude", "AREAL_CLAUDE_BIN")
    engine = ScriptedEngine(tokenizer)
    server = make_proxy(tokenizer, engine)
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    with serve(server.app) as url:
        session_id, session_key = start_session(url, "claude-single")
        result = run_cli(
            [str(claude), "-p", "say hi", "--model", "some-model", "--output-format", "json"],
            claude_env(home, url, session_key),
            work,
        )
        report = json.loads(result.stdout)
        assert REPLY_TEXT in report["result"], report
        check_recorded(server, session_id, engine, 1)
        exported = end_and_export(url, session_id, session_key)
    assert len(exported) == 1
    check_exported(exported[0], engine.received[0], engine.sent[0])


def claude_writes_hi(claude: Path, url: str, session_key: str, tmp_path: Path) -> None:
    """Claude Code, told to write hi to out.txt with Bash, does it in two turns (one tool
    call, then the final reply)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    command = [str(claude), "-p", "write hi to out.txt", "--model", "some-model"]
    command += ["--output-format", "json", "--allowedTools", "Bash"]
    result = run_cli(command, claude_env(home, url, session_key), work)
    report = json.loads(result.stdout)
    assert REPLY_TEXT in report["result"], report
    assert report["num_turns"] == 2, report
    assert (work / "out.txt").read_text() == "hi\n"


def test_claude_code_tool_round_trip(tokenizer: Any, tmp_path: Path) -> None:
    claude = cli_path("claude", "AREAL_CLAUDE_BIN")
    engine = ScriptedEngine(tokenizer, tool_call=CLAUDE_TOOL_CALL)
    server = make_proxy(tokenizer, engine)
    with serve(server.app) as url:
        session_id, session_key = start_session(url, "claude-tool")
        claude_writes_hi(claude, url, session_key, tmp_path)
        check_recorded(server, session_id, engine, 2)
        first, second = server.store.get(session_id).cache.values()
        assert first.output_message_list[0]["tool_calls"][0]["function"]["name"] == "Bash"
        assert second.parent is first  # the second call continues the first conversation
        assert [m["role"] for m in second.messages].count("tool") == 1
        exported = end_and_export(url, session_id, session_key)
    assert len(exported) == 2


def test_claude_code_ling3_tool_round_trip(ling3_tokenizer: Any, tmp_path: Path) -> None:
    claude = cli_path("claude", "AREAL_CLAUDE_BIN")
    engine = Ling3ScriptedEngine(ling3_tokenizer)
    server = make_proxy(ling3_tokenizer, engine, "ling3", "ling3")
    with serve(server.app) as url:
        session_id, session_key = start_session(url, "claude-ling3")
        claude_writes_hi(claude, url, session_key, tmp_path)  # the CLI ran the parsed call
        check_recorded(server, session_id, engine, 2)
        first, second = server.store.get(session_id).cache.values()
        (call,) = first.output_message_list[0]["tool_calls"]
        arguments = json.loads(call["function"]["arguments"])
        assert call["function"]["name"] == "Bash"
        assert arguments == {
            "command": "echo hi > out.txt",
            "description": "write",
            "timeout": 10000,
        }
        assert not isinstance(arguments["timeout"], str)
        # Claude Code echoed the thinking block and the tool_use, then sent the tool_result
        assert second.parent is first
        (result_message,) = [m for m in second.messages if m["role"] == "tool"]
        assert result_message["tool_call_id"] == call["id"]
        exported = end_and_export(url, session_id, session_key)
    assert len(exported) == 2
    for interaction, received, sent, text in zip(
        exported, engine.received, engine.sent, [LING3_TOOL_CALL, LING3_REPLY], strict=True
    ):
        assert sent == engine.reply_tokens(text)  # the Ling 3 text, token for token
        check_exported(interaction, received, sent)


# --- Codex: streaming /v1/responses ---


def codex_argv(codex: Path, url: str, prompt: str, *extra: str) -> list[str]:
    provider = (
        f'{{name="areal",base_url="{url}/v1",env_key="AREAL_SESSION_KEY",wire_api="responses"}}'
    )
    return [
        str(codex),
        "exec",
        "--skip-git-repo-check",
        "--json",
        "-m",
        "some-model",
        "-c",
        "model_provider=areal",
        "-c",
        f"model_providers.areal={provider}",
        # Both default-on features look up public hosts (A/B tests, plugin sync).
        "-c",
        "analytics.enabled=false",
        "--disable",
        "plugins",
        *extra,
        prompt,
    ]


def codex_env(home: Path, session_key: str) -> dict[str, str]:
    return minimal_env(home, CODEX_HOME=str(home / ".codex"), AREAL_SESSION_KEY=session_key)


def codex_agent_texts(stdout: str) -> list[str]:
    """The agent messages in ``codex exec --json`` output (one JSON event a line)."""
    texts = []
    for line in stdout.splitlines():
        if not line.startswith("{"):
            continue
        item = json.loads(line).get("item") or {}
        if item.get("type") == "agent_message":
            texts.append(item.get("text", ""))
    return texts


def test_codex_single_turn(tokenizer: Any, tmp_path: Path) -> None:
    codex = cli_path("codex", "AREAL_CODEX_BIN")
    engine = ScriptedEngine(tokenizer)
    server = make_proxy(tokenizer, engine)
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True), work.mkdir()
    with serve(server.app) as url:
        session_id, session_key = start_session(url, "codex-single")
        result = run_cli(codex_argv(codex, url, "say hi"), codex_env(home, session_key), work)
        assert any(REPLY_TEXT in text for text in codex_agent_texts(result.stdout)), result.stdout
        check_recorded(server, session_id, engine, 1)
        exported = end_and_export(url, session_id, session_key)
    assert len(exported) == 1
    check_exported(exported[0], engine.received[0], engine.sent[0])


def test_codex_tool_round_trip(tokenizer: Any, tmp_path: Path) -> None:
    codex = cli_path("codex", "AREAL_CODEX_BIN")
    engine = ScriptedEngine(tokenizer, tool_call=CODEX_TOOL_CALL)
    server = make_proxy(tokenizer, engine)
    home, work = tmp_path / "home", tmp_path / "work"
    (home / ".codex").mkdir(parents=True), work.mkdir()
    with serve(server.app) as url:
        session_id, session_key = start_session(url, "codex-tool")
        # The command is the scripted one above; no sandbox keeps CI free of bwrap needs.
        argv = codex_argv(
            codex, url, "write hi to out.txt", "--dangerously-bypass-approvals-and-sandbox"
        )
        result = run_cli(argv, codex_env(home, session_key), work)
        assert any(REPLY_TEXT in text for text in codex_agent_texts(result.stdout)), result.stdout
        assert (work / "out.txt").read_text() == "hi\n"
        check_recorded(server, session_id, engine, 2)
        first, second = server.store.get(session_id).cache.values()
        assert first.output_message_list[0]["tool_calls"][0]["function"]["name"] == "exec_command"
        assert second.parent is first
        assert [m["role"] for m in second.messages].count("tool") == 1
        exported = end_and_export(url, session_id, session_key)
    assert len(exported) == 2
