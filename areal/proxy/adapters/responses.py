"""OpenAI Responses <-> chat completions, written for exact round trips.

Requests: ``instructions`` and ``developer``/``system`` messages become system messages,
``input_text``/``output_text`` parts of a message become one text message each,
consecutive ``function_call`` (and ``custom_tool_call``) items become one assistant
message with ``tool_calls``, ``function_call_output`` items become ``tool`` messages, and
a ``reasoning`` item this proxy produced puts its think block back in front of the
assistant turn that follows. Function, custom (free-text ``input``) and namespaced tools
are offered to the model; hosted tools (web search, tool search) are not. Unknown
top-level fields (``include``, ``client_metadata``, ``prompt_cache_key``, ...) are ignored.
Responses: a think block becomes a ``reasoning`` item (its exact text in
``encrypted_content``), text an ``output_text`` message, tool calls ``function_call`` or
``custom_tool_call`` items. A stream always ends with ``response.completed``.
"""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import Iterator
from typing import Any

from areal.proxy.adapters.anthropic import join_think, split_think
from areal.proxy.messages import flatten_content
from areal.proxy.parsers import dump_arguments

__all__ = ["chat_to_response", "response_stream_events", "responses_to_chat"]

CUSTOM_INPUT_SCHEMA = {
    "type": "object",
    "properties": {"input": {"type": "string", "description": "The raw tool input."}},
    "required": ["input"],
}
_ROLE = {"developer": "system", "system": "system", "user": "user", "assistant": "assistant"}


class ResponsesRequestError(ValueError):
    """A Responses request that cannot be translated (HTTP 400)."""


def _decode_reasoning(item: dict) -> str | None:
    encrypted = item.get("encrypted_content")
    if isinstance(encrypted, str) and encrypted.startswith("areal:"):
        try:
            return base64.b64decode(encrypted[len("areal:") :]).decode("utf-8")
        except (ValueError, UnicodeDecodeError):
            return None
    return None


def _text_of(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    if isinstance(content, list):
        texts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") in ("input_text", "output_text", "text"):
                texts.append(str(part.get("text", "")))
        return texts
    return []


def responses_to_chat(body: dict[str, Any]) -> tuple[dict[str, Any], set[str]]:
    """A chat request for a Responses request, and the names of its custom tools."""
    messages: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise ResponsesRequestError("instructions must be a string")
    if instructions:
        messages.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"type": "message", "role": "user", "content": items}]
    if not isinstance(items, list):
        raise ResponsesRequestError("input must be a string or a list of items")
    custom: set[str] = set()
    tools = _tools(body.get("tools"), custom)
    pending_reasoning: str | None = None
    for item in items:
        if not isinstance(item, dict):
            raise ResponsesRequestError("each input item must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLE.get(item.get("role", "user"))
            if role is None:
                raise ResponsesRequestError(f"unknown message role {item.get('role')!r}")
            for text in _text_of(item.get("content")) or [""]:
                if role == "assistant":
                    messages.append(
                        {"role": "assistant", "content": join_think(pending_reasoning, text)}
                    )
                    pending_reasoning = None
                else:
                    messages.append({"role": role, "content": text})
        elif kind in ("function_call", "custom_tool_call"):
            if kind == "function_call":
                arguments = item.get("arguments") or "{}"
            else:
                arguments = dump_arguments({"input": item.get("input", "")})
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": arguments},
            }
            last = messages[-1] if messages else None
            if (
                last is not None
                and last.get("role") == "assistant"
                and "tool_calls" in last
                and "_open" in last
            ):
                last["tool_calls"].append(call)
            else:
                message: dict[str, Any] = {"role": "assistant", "_open": True}
                if pending_reasoning is not None:
                    message["content"] = join_think(pending_reasoning, "")
                    pending_reasoning = None
                message["tool_calls"] = [call]
                messages.append(message)
        elif kind in ("function_call_output", "custom_tool_call_output"):
            output = item.get("output", "")
            content = (
                output
                if isinstance(output, str)
                else flatten_content(output if isinstance(output, list) else [])
            )
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": content})
        elif kind == "reasoning":
            pending_reasoning = _decode_reasoning(item)
        # other item types (web search calls, ...) carry nothing the model should see
    for message in messages:
        message.pop("_open", None)
    if not messages:
        raise ResponsesRequestError("the request has no input")
    chat: dict[str, Any] = {"messages": messages, "model": body.get("model") or "default"}
    if body.get("max_output_tokens") is not None:
        chat["max_completion_tokens"] = body["max_output_tokens"]
    for key in ("temperature", "top_p"):
        if body.get(key) is not None:
            chat[key] = body[key]
    if tools:
        chat["tools"] = tools
        choice = body.get("tool_choice")
        if isinstance(choice, str):
            chat["tool_choice"] = choice
    return chat, custom


def _tools(tools: Any, custom: set[str]) -> list[dict] | None:
    if not isinstance(tools, list):
        return None
    converted: list[dict] = []
    for tool in tools:
        if not isinstance(tool, dict):
            continue
        kind = tool.get("type")
        if kind == "function":
            fn = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
            if tool.get("description"):
                fn["description"] = tool["description"]
            converted.append({"type": "function", "function": fn})
        elif kind == "custom":
            custom.add(tool["name"])
            fn = {"name": tool["name"], "parameters": CUSTOM_INPUT_SCHEMA}
            if tool.get("description"):
                fn["description"] = tool["description"]
            converted.append({"type": "function", "function": fn})
        elif kind == "namespace":
            converted.extend(_tools(tool.get("tools"), custom) or [])
    return converted or None


def chat_to_response(
    completion: dict[str, Any], body: dict[str, Any], custom_tools: set[str]
) -> dict[str, Any]:
    """A Responses object from a chat completion."""
    message = completion["choices"][0]["message"]
    reasoning, rest = split_think(message.get("content") or "")
    output: list[dict] = []
    reasoning_tokens = 0
    if reasoning is not None:
        encoded = base64.b64encode(reasoning.encode("utf-8")).decode("ascii")
        output.append(
            {
                "type": "reasoning",
                "id": f"rs_{uuid.uuid4().hex[:24]}",
                "summary": [{"type": "summary_text", "text": reasoning}],
                "encrypted_content": f"areal:{encoded}",
            }
        )
        reasoning_tokens = max(1, len(reasoning) // 4)
    calls = message.get("tool_calls") or []
    for call in calls:
        fn = call["function"]
        if fn["name"] in custom_tools:
            try:
                value = json.loads(fn["arguments"]).get("input", "")
            except (json.JSONDecodeError, AttributeError):
                value = fn["arguments"]
            output.append(
                {
                    "type": "custom_tool_call",
                    "id": f"ctc_{uuid.uuid4().hex[:24]}",
                    "call_id": call["id"],
                    "name": fn["name"],
                    "input": str(value),
                    "status": "completed",
                }
            )
        else:
            output.append(
                {
                    "type": "function_call",
                    "id": f"fc_{uuid.uuid4().hex[:24]}",
                    "call_id": call["id"],
                    "name": fn["name"],
                    "arguments": fn["arguments"],
                    "status": "completed",
                }
            )
    if rest or not calls:
        output.append(
            {
                "type": "message",
                "id": f"msg_{uuid.uuid4().hex[:24]}",
                "role": "assistant",
                "status": "completed",
                "content": [
                    {"type": "output_text", "text": rest, "annotations": [], "logprobs": []}
                ],
            }
        )
    usage = completion.get("usage") or {}
    return {
        "id": f"resp_{uuid.uuid4().hex[:29]}",
        "object": "response",
        "created_at": int(time.time()),
        "status": "completed",
        "model": body.get("model") or completion.get("model") or "default",
        "output": output,
        "parallel_tool_calls": bool(body.get("parallel_tool_calls", True)),
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "error": None,
        "incomplete_details": None,
        "instructions": body.get("instructions"),
        "metadata": {},
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": usage.get("completion_tokens", 0),
            "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": usage.get("total_tokens", 0),
        },
    }


def response_stream_events(response: dict[str, Any], chunk: int = 64) -> Iterator[dict]:
    """The Responses stream events for a finished response (ends with ``completed``)."""
    seq = iter(range(1_000_000))
    pending = {**response, "status": "in_progress", "output": [], "usage": None}
    yield {"type": "response.created", "sequence_number": next(seq), "response": pending}
    yield {"type": "response.in_progress", "sequence_number": next(seq), "response": pending}
    for index, item in enumerate(response["output"]):
        kind = item["type"]
        opening = {**item, "status": "in_progress"}
        if kind == "message":
            opening["content"] = []
        elif kind == "function_call":
            opening["arguments"] = ""
        yield {
            "type": "response.output_item.added",
            "sequence_number": next(seq),
            "output_index": index,
            "item": opening,
        }
        if kind == "message":
            text = item["content"][0]["text"]
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            yield {
                "type": "response.content_part.added",
                "sequence_number": next(seq),
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "part": part,
            }
            for start in range(0, len(text), chunk):
                yield {
                    "type": "response.output_text.delta",
                    "sequence_number": next(seq),
                    "item_id": item["id"],
                    "output_index": index,
                    "content_index": 0,
                    "delta": text[start : start + chunk],
                    "logprobs": [],
                }
            yield {
                "type": "response.output_text.done",
                "sequence_number": next(seq),
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "text": text,
                "logprobs": [],
            }
            yield {
                "type": "response.content_part.done",
                "sequence_number": next(seq),
                "item_id": item["id"],
                "output_index": index,
                "content_index": 0,
                "part": item["content"][0],
            }
        elif kind == "function_call":
            arguments = item["arguments"]
            for start in range(0, len(arguments), chunk):
                yield {
                    "type": "response.function_call_arguments.delta",
                    "sequence_number": next(seq),
                    "item_id": item["id"],
                    "output_index": index,
                    "delta": arguments[start : start + chunk],
                }
            yield {
                "type": "response.function_call_arguments.done",
                "sequence_number": next(seq),
                "item_id": item["id"],
                "output_index": index,
                "arguments": arguments,
                "name": item["name"],
            }
        yield {
            "type": "response.output_item.done",
            "sequence_number": next(seq),
            "output_index": index,
            "item": item,
        }
    yield {"type": "response.completed", "sequence_number": next(seq), "response": response}
