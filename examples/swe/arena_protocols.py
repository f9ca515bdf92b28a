"""Which LLM protocol an Arena Stream's Harness speaks: inferred from its key, or set."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

__all__ = [
    "LLM_PROTOCOLS",
    "LLMProtocol",
    "infer_llm_protocol",
    "infer_llm_protocol_from_harness",
    "resolve_llm_protocol",
]

LLMProtocol = Literal["anthropic", "responses", "chat_completions"]
LLM_PROTOCOLS: tuple[str, ...] = ("anthropic", "responses", "chat_completions")


def infer_llm_protocol_from_harness(key: str) -> str:
    """``anthropic`` for Claude-like Harnesses, ``responses`` for Codex-like, else chat."""
    lowered = (key or "").lower()
    if "claude" in lowered:
        return "anthropic"
    if "codex" in lowered:
        return "responses"
    return "chat_completions"


def infer_llm_protocol(stream: Mapping[str, Any]) -> str:
    """The protocol of a Stream's default Harness (chat completions when unknown)."""
    ref = stream.get("default_harness_ref") if isinstance(stream, Mapping) else None
    key = ref.get("key") if isinstance(ref, Mapping) else None
    return infer_llm_protocol_from_harness(key if isinstance(key, str) else "")


def resolve_llm_protocol(stream: Mapping[str, Any], override: str = "") -> str:
    """``override`` when given (validated), else inferred from the Stream."""
    if not override:
        return infer_llm_protocol(stream)
    if override in LLM_PROTOCOLS:
        return override
    raise ValueError(
        f"Unsupported Arena LLM protocol override {override!r}; use one of "
        f"{', '.join(LLM_PROTOCOLS)}"
    )
