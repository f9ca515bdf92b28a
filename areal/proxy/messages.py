"""Normalizing chat messages before they are rendered and recorded.

Messages may arrive as pydantic objects, with ``None`` fields, or with content as a list
of blocks (OpenAI parts, or Anthropic-style blocks forwarded by an Arena gateway).
Text-only block lists become one newline-joined string (system messages always, other
messages only when they hold no image), then the configured preprocessors run in order.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["MessagePreprocessor", "flatten_content", "plain", "prepare_messages"]

MessagePreprocessor = Callable[[list[dict]], list[dict]]
IMAGE_TYPES = frozenset({"image", "image_url", "input_image"})
TEXT_TYPES = frozenset({"text", "input_text", "output_text"})


def plain(value: Any) -> Any:
    """A JSON-like copy: pydantic models to dicts, ``None`` dict fields dropped."""
    if hasattr(value, "model_dump"):
        value = value.model_dump(exclude_none=True)
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)) or (
        isinstance(value, Iterable) and not isinstance(value, (str, bytes))
    ):
        return [plain(v) for v in value]
    return copy.copy(value)


def _has_image(value: Any) -> bool:
    if isinstance(value, dict):
        return value.get("type") in IMAGE_TYPES or any(_has_image(v) for v in value.values())
    if isinstance(value, list):
        return any(_has_image(v) for v in value)
    return False


def flatten_content(content: list[Any]) -> str:
    """Text blocks and bare strings of a block list, joined with newlines."""
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") in TEXT_TYPES:
            parts.append(str(block.get("text", "")))
    return "\n".join(parts)


def prepare_messages(
    messages: Iterable[Any], preprocessors: Iterable[MessagePreprocessor] = ()
) -> list[dict]:
    """Plain dict messages with text-only block lists flattened, then preprocessed."""
    prepared = []
    for message in messages:
        message = plain(message)
        if not isinstance(message, dict):
            raise ValueError(f"each message must be an object, got {type(message).__name__}")
        content = message.get("content")
        if isinstance(content, list) and (
            message.get("role") == "system" or not _has_image(content)
        ):
            message["content"] = flatten_content(content)
        prepared.append(message)
    for preprocess in preprocessors:
        prepared = preprocess(prepared)
    return prepared
