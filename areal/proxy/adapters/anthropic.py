"""Anthropic Messages <-> chat completions, written for exact round trips.

Requests: system blocks and ``role: system`` messages become system messages; text blocks
are joined; ``tool_use`` blocks become ``tool_calls`` with canonically dumped arguments;
``tool_result`` blocks become ``tool`` messages; thinking blocks are put back inline as
``<think>…</think>`` in front of the text. Fields with no chat meaning (``thinking``,
``output_config``, ``context_management``, ``metadata``, ``cache_control``) are accepted
and ignored. Responses: an inline think block becomes a ``thinking`` block with a
signature, the rest a ``text`` block, tool calls ``tool_use`` blocks. Because both
directions use the same rules, the assistant turn a client echoes back translates into
exactly the message the proxy recorded, which keeps multi-turn parent links intact.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from typing import Any

from areal.proxy.messages import flatten_content
from areal.proxy.parsers import dump_arguments

__all__ = [
    "THINK_END",
    "THINK_START",
    "chat_to_message",
    "message_stream_events",
    "messages_to_chat",
    "split_think",
]

THINK_START, THINK_END = "<think>", "</think>"
STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}


class AnthropicRequestError(ValueError):
    """A Messages request that cannot be translated (HTTP 400)."""


def split_think(text: str) -> tuple[str | None, str]:
    """``(reasoning, rest)`` if ``text`` starts with a closed think block, else ``(None, text)``."""
    if text.startswith(THINK_START):
        end = text.find(THINK_END, len(THINK_START))
        if end >= 0:
            return text[len(THINK_START) : end], text[end + len(THINK_END) :]
    return None, text


def join_think(reasoning: str | None, rest: str) -> str:
    return rest if reasoning is None else f"{THINK_START}{reasoning}{THINK_END}{rest}"


def signature(thinking: str) -> str:
    """An opaque, stable signature for a thinking block (clients echo it back)."""
    return "sig-" + hashlib.sha256(thinking.encode()).hexdigest()[:32]


def _block_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return flatten_content(content)
    raise AnthropicRequestError(f"unsupported content {type(content).__name__}")


def _user_messages(content: Any) -> list[dict]:
    """A user turn: tool results become tool messages (first), other text a user message."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    if not isinstance(content, list):
        raise AnthropicRequestError("user content must be a string or a list of blocks")
    out: list[dict] = []
    rest: list[Any] = []
    for block in content:
        if isinstance(block, dict) and block.get("type") == "tool_result":
            tool_id = block.get("tool_use_id")
            if not isinstance(tool_id, str):
                raise AnthropicRequestError("tool_result needs a tool_use_id")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": tool_id,
                    "content": _block_text(block.get("content")),
                }
            )
        else:
            rest.append(block)
    if rest:
        out.append({"role": "user", "content": flatten_content(rest)})
    return out


def _assistant_message(content: Any) -> dict:
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    if not isinstance(content, list):
        raise AnthropicRequestError("assistant content must be a string or a list of blocks")
    reasoning: str | None = None
    texts: list[str] = []
    calls: list[dict] = []
    for block in content:
        if not isinstance(block, dict):
            raise AnthropicRequestError("assistant content blocks must be objects")
        kind = block.get("type")
        if kind == "thinking":
            reasoning = (reasoning or "") + str(block.get("thinking", ""))
        elif kind == "text":
            texts.append(str(block.get("text", "")))
        elif kind == "tool_use":
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {
                        "name": block["name"],
                        "arguments": dump_arguments(block.get("input", {})),
                    },
                }
            )
    message: dict[str, Any] = {"role": "assistant"}
    text = join_think(reasoning, "".join(texts))
    if text or not calls:
        message["content"] = text
    if calls:
        message["tool_calls"] = calls
    return message


def _tools(tools: Any) -> list[dict] | None:
    if not tools:
        return None
    if not isinstance(tools, list):
        raise AnthropicRequestError("tools must be a list of tool definitions")
    converted = []
    for index, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise AnthropicRequestError(f"tools[{index}] must be an object")
        if "input_schema" not in tool:
            continue  # server tools (web search, ...) have no client-side schema
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise AnthropicRequestError(f"tools[{index}].name must be a non-empty string")
        fn = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description"):
            fn["description"] = tool["description"]
        converted.append({"type": "function", "function": fn})
    return converted or None


def _tool_choice(choice: Any) -> Any:
    if not isinstance(choice, dict):
        return None
    kind = choice.get("type")
    if kind == "tool":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return {"auto": "auto", "any": "required", "none": "none"}.get(kind)


def messages_to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """A chat-completions request equivalent to an Anthropic Messages request."""
    try:
        messages: list[dict] = []
        system = body.get("system")
        if system:
            messages.append({"role": "system", "content": _block_text(system)})
        history = body.get("messages")
        if not isinstance(history, list):
            raise AnthropicRequestError("messages must be a list of messages")
        for index, message in enumerate(history):
            if not isinstance(message, dict):
                raise AnthropicRequestError(f"messages[{index}] must be an object")
            role = message.get("role")
            if role == "user":
                messages.extend(_user_messages(message.get("content")))
            elif role == "assistant":
                messages.append(_assistant_message(message.get("content")))
            elif role == "system":
                messages.append({"role": "system", "content": _block_text(message.get("content"))})
            else:
                raise AnthropicRequestError(f"unknown message role {role!r}")
    except (KeyError, TypeError) as e:
        raise AnthropicRequestError(f"malformed Messages request: {e}") from e
    if not messages:
        raise AnthropicRequestError("messages must not be empty")
    chat: dict[str, Any] = {"messages": messages, "model": body.get("model") or "default"}
    if body.get("max_tokens") is not None:
        chat["max_completion_tokens"] = body["max_tokens"]
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    stop = body.get("stop_sequences")
    if stop is not None and (
        not isinstance(stop, list) or not all(isinstance(item, str) for item in stop)
    ):
        raise AnthropicRequestError("stop_sequences must be a list of strings")
    if stop:
        chat["stop"] = list(stop)
    tools = _tools(body.get("tools"))
    if tools:
        chat["tools"] = tools
        choice = _tool_choice(body.get("tool_choice"))
        if choice is not None:
            chat["tool_choice"] = choice
    return chat


def _content_blocks(message: dict) -> list[dict]:
    reasoning, rest = split_think(message.get("content") or "")
    blocks: list[dict] = []
    if reasoning is not None:
        blocks.append(
            {"type": "thinking", "thinking": reasoning, "signature": signature(reasoning)}
        )
    if rest:
        blocks.append({"type": "text", "text": rest})
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        try:
            arguments = json.loads(fn["arguments"]) if fn["arguments"] else {}
        except json.JSONDecodeError:
            arguments = {"raw_arguments": fn["arguments"]}
        blocks.append(
            {"type": "tool_use", "id": call["id"], "name": fn["name"], "input": arguments}
        )
    if not blocks:
        blocks.append({"type": "text", "text": ""})
    return blocks


def chat_to_message(completion: dict[str, Any], model: str | None = None) -> dict[str, Any]:
    """An Anthropic ``Message`` from a chat completion."""
    choice = completion["choices"][0]
    usage = completion.get("usage") or {}
    return {
        "id": f"msg_{uuid.uuid4().hex[:24]}",
        "type": "message",
        "role": "assistant",
        "model": model or completion.get("model") or "default",
        "content": _content_blocks(choice["message"]),
        "stop_reason": STOP_REASONS.get(choice.get("finish_reason"), "end_turn"),
        "stop_sequence": None,
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "output_tokens": usage.get("completion_tokens", 0),
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
        },
    }


def message_stream_events(message: dict[str, Any], chunk: int = 64) -> Iterator[tuple[str, dict]]:
    """``(event, data)`` pairs of the Anthropic stream for a finished message."""
    head = {
        **message,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {**message["usage"], "output_tokens": 0},
    }
    yield "message_start", {"type": "message_start", "message": head}
    for index, block in enumerate(message["content"]):
        kind = block["type"]
        if kind == "text":
            yield (
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": {"type": "text", "text": ""},
                },
            )
            for start in range(0, len(block["text"]), chunk):
                yield (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {
                            "type": "text_delta",
                            "text": block["text"][start : start + chunk],
                        },
                    },
                )
        elif kind == "thinking":
            yield (
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": {"type": "thinking", "thinking": "", "signature": ""},
                },
            )
            for start in range(0, len(block["thinking"]), chunk):
                yield (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {
                            "type": "thinking_delta",
                            "thinking": block["thinking"][start : start + chunk],
                        },
                    },
                )
            yield (
                "content_block_delta",
                {
                    "type": "content_block_delta",
                    "index": index,
                    "delta": {"type": "signature_delta", "signature": block["signature"]},
                },
            )
        else:  # tool_use
            yield (
                "content_block_start",
                {
                    "type": "content_block_start",
                    "index": index,
                    "content_block": {
                        "type": "tool_use",
                        "id": block["id"],
                        "name": block["name"],
                        "input": {},
                    },
                },
            )
            arguments = dump_arguments(block["input"])
            for start in range(0, len(arguments), chunk):
                yield (
                    "content_block_delta",
                    {
                        "type": "content_block_delta",
                        "index": index,
                        "delta": {
                            "type": "input_json_delta",
                            "partial_json": arguments[start : start + chunk],
                        },
                    },
                )
        yield "content_block_stop", {"type": "content_block_stop", "index": index}
    yield (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": message["stop_reason"], "stop_sequence": None},
            "usage": {"output_tokens": message["usage"]["output_tokens"]},
        },
    )
    yield "message_stop", {"type": "message_stop"}
