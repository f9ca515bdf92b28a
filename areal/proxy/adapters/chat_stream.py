"""Chat-completion chunks for a finished completion (streaming is simulated).

Order: a role chunk, one content chunk (when there is content), two chunks per tool
call (name and id with empty arguments, then the arguments), and a final chunk with the
finish reason and usage.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["chat_stream_chunks"]


def chat_stream_chunks(completion: dict[str, Any]) -> Iterator[dict[str, Any]]:
    choice = completion["choices"][0]
    message = choice["message"]
    base = {
        "id": completion["id"],
        "object": "chat.completion.chunk",
        "created": completion["created"],
        "model": completion["model"],
    }

    def chunk(delta: dict, finish_reason: str | None = None, **extra: Any) -> dict:
        return {
            **base,
            "choices": [
                {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": None}
            ],
            **extra,
        }

    yield chunk({"role": "assistant", "content": ""})
    if message.get("content"):
        yield chunk({"content": message["content"]})
    for index, call in enumerate(message.get("tool_calls") or []):
        fn = call["function"]
        yield chunk(
            {
                "tool_calls": [
                    {
                        "index": index,
                        "id": call["id"],
                        "type": "function",
                        "function": {"name": fn["name"], "arguments": ""},
                    }
                ]
            }
        )
        yield chunk({"tool_calls": [{"index": index, "function": {"arguments": fn["arguments"]}}]})
    yield chunk({}, choice["finish_reason"], usage=completion.get("usage"))
