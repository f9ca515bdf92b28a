"""CLI harnesses: the real Claude Code and Codex (``make agent-clis``) as agents.

Each runs in ``run.workdir`` with a throwaway HOME and an environment built from scratch:
PATH (with node's directory), the endpoint and key, switches that keep the CLI off public
hosts, then the launch ``envs``. The session headers reach Claude Code as the
``ANTHROPIC_CUSTOM_HEADERS`` variable itself and Codex as provider headers read from its
environment, so no secret shows on a command line.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from examples.swe.local_arena.harnesses.session import clip, excerpt, redact, session_headers
from examples.swe.local_arena.sandbox import ProcessResult, run_captured, search_path
from examples.swe.local_arena.types import HarnessError, HarnessOutput, HarnessRun, HarnessSpec

__all__ = ["CLI_BIN_DIR", "CLI_KINDS", "cli_available", "run_claude_code", "run_codex"]

CLI_KINDS = ("claude-code", "codex")

REPO_ROOT = Path(__file__).resolve().parents[4]
CLI_BIN_DIR = REPO_ROOT / ".cache" / "agent-clis" / "node_modules" / ".bin"
_CLI_BINARIES = {
    "claude-code": ("claude", "AREAL_CLAUDE_BIN"),
    "codex": ("codex", "AREAL_CODEX_BIN"),
}
CLI_OUTPUT_BYTES = 8 << 20  # kept of a CLI's stdout/stderr (the tail)


def cli_available(kind: str) -> Path | None:
    """The executable of the CLI behind harness ``kind``: ``$AREAL_CLAUDE_BIN`` /
    ``$AREAL_CODEX_BIN`` when set, else the repository's ``make agent-clis`` install, else
    PATH. None when not installed."""
    if kind not in _CLI_BINARIES:
        raise ValueError(f"{kind!r} is not a CLI harness kind; expected one of {CLI_KINDS}")
    name, env_var = _CLI_BINARIES[kind]
    override = os.environ.get(env_var)
    found = shutil.which(name)
    candidates = [Path(override)] if override else [CLI_BIN_DIR / name, Path(found or "")]
    for path in candidates:
        if path.name and path.is_file() and os.access(path, os.X_OK):
            return path
    return None


def _cli(kind: str) -> Path:
    path = cli_available(kind)
    if path is None:
        name, env_var = _CLI_BINARIES[kind]
        raise HarnessError(
            f"the {name} CLI is not installed; run `make agent-clis` (or set {env_var})"
        )
    return path


def _cli_path_env() -> str:
    node = shutil.which("node")  # both CLIs are node scripts
    return search_path(str(Path(node).parent)) if node else search_path()


def _extra_args(spec: HarnessSpec) -> list[str]:
    """The harness's ``extra_args`` option: more CLI flags (e.g. a smaller tool set)."""
    extra = spec.options.get("extra_args", [])
    if not isinstance(extra, list) or not all(isinstance(a, str) for a in extra):
        raise HarnessError(f"harness {spec.ref}: options.extra_args must be a list of strings")
    return list(extra)


def _cli_failure(name: str, result: ProcessResult, run: HarnessRun) -> HarnessError:
    if result.timed_out:
        what = "timed out"
    else:
        what = f"exited with code {result.returncode}"
    output = excerpt(f"{result.stderr.strip()}\n{result.stdout.strip()}")
    return HarnessError(redact(f"{name} {what}: {output}", run))


async def run_claude_code(spec: HarnessSpec, run: HarnessRun) -> HarnessOutput:
    """``claude -p`` with JSON output; its ``result`` is the answer."""
    claude = _cli("claude-code")
    argv = [str(claude), "-p", run.prompt, "--model", run.model, "--output-format", "json"]
    if "max_turns" in spec.options:
        argv += ["--max-turns", str(int(spec.options["max_turns"]))]
    argv += _extra_args(spec)
    with tempfile.TemporaryDirectory(prefix="arena-claude-home-") as home:
        env = {
            "PATH": _cli_path_env(),
            "HOME": home,
            "ANTHROPIC_BASE_URL": run.base_url,
            "ANTHROPIC_API_KEY": run.api_key,
            # Without these Claude Code looks up public hosts (telemetry, updates).
            "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
            "DISABLE_TELEMETRY": "1",
            "DISABLE_ERROR_REPORTING": "1",
            "DISABLE_AUTOUPDATER": "1",
        }
        if spec.options.get("skip_permissions"):
            argv.append("--dangerously-skip-permissions")
            env["IS_SANDBOX"] = "1"  # the flag is refused as root without it
        else:
            argv += ["--allowedTools", str(spec.options.get("allowed_tools", "Bash"))]
        # Launch envs last: they may point ANTHROPIC_* elsewhere and add the session headers.
        env.update(run.envs)
        result = await run_captured(argv, env, run.workdir, run.timeout, tail=CLI_OUTPUT_BYTES)
    report = None if result.timed_out else _last_json_object(result.stdout)
    if report is not None and report.get("is_error"):
        # Worded like a hosted Arena's raw error: the client trains it as the model's
        # failure only when the reason is a model error (prompt too long, max turns).
        status = report.get("api_error_status")
        raise HarnessError(
            redact(
                f"harness: harness agent phase exited with code {result.returncode}\n"
                f"harness: agent phase error: claude reported error: "
                f"{excerpt(str(report.get('result')))}"
                f"{f' (API status {status})' if status else ''}",
                run,
            )
        )
    if result.timed_out or result.returncode != 0:
        raise _cli_failure("claude", result, run)
    if report is None:
        raise _cli_failure("claude (output is not JSON)", result, run)
    answer = report.get("result")
    extra = {k: report[k] for k in ("stop_reason", "duration_ms", "usage") if k in report}
    return HarnessOutput(
        answer if isinstance(answer, str) else None,
        turns=int(report.get("num_turns") or 0),
        transcript=[{"role": "assistant", "text": clip(str(answer or ""))}],
        extra=extra,
    )


def _last_json_object(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                value = json.loads(line)
                if isinstance(value, dict):
                    return value
    return None


def _toml_string(value: str) -> str:
    # A JSON string is a valid TOML basic string once non-ASCII stays literal.
    return json.dumps(value, ensure_ascii=False)


async def run_codex(spec: HarnessSpec, run: HarnessRun) -> HarnessOutput:
    """Codex talks Responses only. Endpoint rule: ``OPENAI_BASE_URL``/``OPENAI_API_KEY`` in
    the launch envs (direct mode sets them) win over ``run.base_url``/``run.api_key``; the
    provider URL gets ``/v1`` unless it already ends with it."""
    codex = _cli("codex")
    base_url = (run.envs.get("OPENAI_BASE_URL") or run.base_url).rstrip("/")
    if not base_url.endswith("/v1"):
        base_url += "/v1"
    api_key = run.envs.get("OPENAI_API_KEY") or run.api_key
    headers = session_headers(run.envs)
    # Header values travel in the environment (env_http_headers), like the key, so the
    # session token never shows on a command line.
    header_envs = {f"ARENA_HARNESS_HEADER_{i}": v for i, v in enumerate(headers.values())}
    header_table = ",".join(
        f"{_toml_string(name)}={_toml_string(env_name)}"
        for name, env_name in zip(headers, header_envs, strict=True)
    )
    provider = (
        f'{{name="arena",base_url={_toml_string(base_url)},env_key="ARENA_HARNESS_API_KEY",'
        f'wire_api="responses",env_http_headers={{{header_table}}}}}'
    )
    argv = [
        str(codex), "exec", "--skip-git-repo-check", "--json", "-m", run.model,
        "-c", "model_provider=arena", "-c", f"model_providers.arena={provider}",
        # Both default-on features look up public hosts (A/B tests, plugin sync).
        "-c", "analytics.enabled=false", "--disable", "plugins",
    ]  # fmt: skip
    if spec.options.get("skip_permissions"):
        argv.append("--dangerously-bypass-approvals-and-sandbox")
    elif spec.options.get("sandbox"):
        argv += ["-s", str(spec.options["sandbox"])]
    argv += ["--", run.prompt]
    with tempfile.TemporaryDirectory(prefix="arena-codex-home-") as home:
        codex_home = Path(home) / ".codex"
        codex_home.mkdir()
        env = {"PATH": _cli_path_env(), "HOME": home, "CODEX_HOME": str(codex_home)}
        env.update(run.envs)
        env.update(header_envs, ARENA_HARNESS_API_KEY=api_key)
        result = await run_captured(argv, env, run.workdir, run.timeout, tail=CLI_OUTPUT_BYTES)
    if result.timed_out:
        raise _cli_failure("codex", result, run)
    texts, turns, errors = _codex_events(result.stdout)
    if errors and (result.returncode != 0 or not texts):
        detail = excerpt(errors[-1])
        raise HarnessError(redact(f"codex exited with code {result.returncode}: {detail}", run))
    if result.returncode != 0:
        raise _cli_failure("codex", result, run)
    transcript = [{"role": "assistant", "text": clip(t)} for t in texts]
    return HarnessOutput(texts[-1] if texts else None, turns=turns, transcript=transcript)


def _codex_events(stdout: str) -> tuple[list[str], int, list[str]]:
    """Agent message texts, completed turns and error messages of ``codex exec --json``."""
    texts, errors, turns = [], [], 0
    for line in stdout.splitlines():
        if not line.startswith("{"):
            continue
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        kind = event.get("type")
        item = event.get("item") or {}
        if kind == "item.completed" and item.get("type") == "agent_message":
            texts.append(item.get("text") or "")
        elif kind == "turn.completed":
            turns += 1
        elif kind in ("turn.failed", "error"):
            error = event.get("error")
            message = error.get("message") if isinstance(error, dict) else error
            errors.append(str(message or event.get("message") or kind))
    return texts, turns, errors
