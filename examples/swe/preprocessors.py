"""Message preprocessors for SWE agents behind the rollout proxy.

Named by dotted path in ``rollout.agent.message_preprocessors``; the proxy instantiates each
class with no arguments and calls it as ``messages = p(messages)`` on every chat and
Anthropic Messages request, after content block lists have been flattened to text (see
:mod:`areal.proxy.messages`). Each returns new message dicts and leaves its input alone.

What they are for: Claude Code sends per-request noise that the policy should neither
read nor be trained on, and that would make two consecutive turns of one trajectory look
different to the interaction cache (so a child turn would not find its parent):

* :class:`StripAnthropicBillingHeader`: the ``x-anthropic-billing-header: ...`` line that
  opens the system prompt (it carries the client version and changes between releases);
* :class:`StripAllSystemReminders`: ``<system-reminder>...</system-reminder>`` spans that
  the CLI injects into user and system text (dates, file-change notices, todo nags);
* :class:`StripAnthropicCacheFields`: ``cache_control`` markers on messages and blocks;
* :class:`NormalizeToolCallArguments`: tool-call ``arguments`` as one canonical JSON string,
  whether they arrived as an object or as differently spaced JSON text.
"""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = [
    "NormalizeToolCallArguments",
    "StripAllSystemReminders",
    "StripAnthropicBillingHeader",
    "StripAnthropicCacheFields",
]

BILLING_HEADER = "x-anthropic-billing-header:"
_BILLING_LINE = re.compile(r"^[ \t]*x-anthropic-billing-header:[^\n]*(?:\n|$)", re.MULTILINE)
_SYSTEM_REMINDER = re.compile(r"<system-reminder>.*?</system-reminder>\n?", re.DOTALL)


def _map_text(content: Any, fn) -> Any:
    """``fn`` applied to a string content, or to each text block of a block list."""
    if isinstance(content, str):
        return fn(content)
    if isinstance(content, list):
        out = []
        for block in content:
            if isinstance(block, str):
                out.append(fn(block))
            elif isinstance(block, dict) and isinstance(block.get("text"), str):
                out.append({**block, "text": fn(block["text"])})
            else:
                out.append(block)
        return out
    return content


class StripAnthropicBillingHeader:
    """Drop the ``x-anthropic-billing-header: ...`` line(s) from system messages."""

    def __call__(self, messages: list[dict]) -> list[dict]:
        def strip(text: str) -> str:
            if BILLING_HEADER not in text:
                return text
            return _BILLING_LINE.sub("", text).lstrip("\n")

        return [
            {**m, "content": _map_text(m.get("content"), strip)} if m.get("role") == "system" else m
            for m in messages
        ]


class StripAllSystemReminders:
    """Remove every ``<system-reminder>`` span from message text, whatever the role."""

    def __call__(self, messages: list[dict]) -> list[dict]:
        def strip(text: str) -> str:
            if "<system-reminder>" not in text:
                return text
            return _SYSTEM_REMINDER.sub("", text).strip("\n")

        return [
            {**m, "content": _map_text(m["content"], strip)} if "content" in m else m
            for m in messages
        ]


def _without_cache_control(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_cache_control(v) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_without_cache_control(v) for v in value]
    return value


class StripAnthropicCacheFields:
    """Remove ``cache_control`` keys from messages and any nested content block."""

    def __call__(self, messages: list[dict]) -> list[dict]:
        return [_without_cache_control(m) for m in messages]


def canonical_arguments(arguments: Any) -> Any:
    """Tool-call arguments as compact JSON text; text that is not JSON is kept as is."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return arguments
    elif isinstance(arguments, dict | list):
        parsed = arguments
    else:
        return arguments
    return json.dumps(parsed, ensure_ascii=False, separators=(", ", ": "))


class NormalizeToolCallArguments:
    """Every assistant ``tool_calls[].function.arguments`` as canonical JSON text."""

    def __call__(self, messages: list[dict]) -> list[dict]:
        out = []
        for m in messages:
            calls = m.get("tool_calls")
            if not isinstance(calls, list) or not calls:
                out.append(m)
                continue
            normalized = []
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and "arguments" in function:
                    function = {**function, "arguments": canonical_arguments(function["arguments"])}
                    call = {**call, "function": function}
                normalized.append(call)
            out.append({**m, "tool_calls": normalized})
        return out
