"""Session headers and secret redaction, shared by the LLM clients and the CLI harnesses."""

from __future__ import annotations

from examples.swe.local_arena.types import HarnessRun

__all__ = ["clip", "excerpt", "redact", "session_headers"]

ERROR_EXCERPT_CHARS = 2000


def session_headers(envs: dict[str, str]) -> dict[str, str]:
    """The headers listed in ``envs["ANTHROPIC_CUSTOM_HEADERS"]`` (``Name: value`` lines)."""
    headers = {}
    for line in envs.get("ANTHROPIC_CUSTOM_HEADERS", "").splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip():
            headers[name.strip()] = value.strip()
    return headers


def _secrets(run: HarnessRun) -> list[str]:
    candidates = [run.api_key, *session_headers(run.envs).values()]
    candidates += [run.envs.get(k, "") for k in ("OPENAI_API_KEY", "ANTHROPIC_API_KEY")]
    # Stripped (a key with a trailing newline appears bare in error texts), and longest
    # first, so a secret that contains another is replaced whole.
    stripped = {s.strip() for s in candidates}
    return sorted({s for s in stripped if len(s) >= 4}, key=len, reverse=True)


def redact(text: str, run: HarnessRun) -> str:
    """``text`` with the run's API keys and session header values replaced."""
    for secret in _secrets(run):
        text = text.replace(secret, "<redacted>")
    return text


def excerpt(text: str, limit: int = ERROR_EXCERPT_CHARS) -> str:
    """The stripped ``text``, or its last ``limit`` characters (where errors usually are)."""
    text = text.strip()
    return text if len(text) <= limit else f"...{text[-limit:]}"


def clip(text: str, limit: int = 200) -> str:
    """The first ``limit`` characters of ``text``, for transcripts."""
    return text if len(text) <= limit else text[:limit] + "..."
