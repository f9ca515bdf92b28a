"""Prefix matchers for the proxy's interaction cache (``rollout.agent.prefix_matcher``).

When a new chat call arrives, the cache looks for an earlier completed call whose
``messages + output`` is a prefix of the new ``messages``: that call becomes the parent, and
the child's prompt continues exactly the tokens the policy produced. Agents re-serialize
their history, so a strict equality test misses parents for harmless differences.
:func:`swe_prefix_matcher` compares what matters for SWE agents:

* roles must match;
* tool results (``role: tool``) match on ``tool_call_id`` alone (their text may be
  truncated or re-rendered by the harness);
* any other message matches when its ``content`` and ``thinking`` are equal and its tool
  calls have the same ids in the same order (arguments may be re-serialized differently).
"""

from __future__ import annotations

from typing import Any

__all__ = ["same_message", "swe_prefix_matcher"]


def _tool_call_ids(message: dict) -> list[Any]:
    calls = message.get("tool_calls") or []
    return [call.get("id") if isinstance(call, dict) else None for call in calls]


def _text(value: Any) -> Any:
    return "" if value is None else value


def same_message(a: dict, b: dict) -> bool:
    """Whether two chat messages are the same turn for parent matching."""
    if a.get("role") != b.get("role"):
        return False
    if a.get("role") == "tool":
        return a.get("tool_call_id") == b.get("tool_call_id")
    return (
        _text(a.get("content")) == _text(b.get("content"))
        and _text(a.get("thinking")) == _text(b.get("thinking"))
        and _tool_call_ids(a) == _tool_call_ids(b)
    )


def swe_prefix_matcher(prefix: list[dict], messages: list[dict]) -> bool:
    """Whether ``prefix`` matches the first ``len(prefix)`` of ``messages`` turn by turn."""
    if len(prefix) > len(messages):
        return False
    return all(same_message(a, b) for a, b in zip(prefix, messages, strict=False))
