"""Request validation: sampling parameters checked as SGLang checks them, and chat shapes.

A value the inference server would refuse, or one that would break a whole batch there
(``frequency_penalty=1e300``), is refused here first with HTTP 400 naming the field, so
one client's bad request is its own error and never another session's system failure.
Ranges follow SGLang's ``SamplingParams.verify``: finite numbers; ``temperature >= 0``;
``top_p`` in (0, 1] (0 itself means "unset" and is served as 1.0, as the reference
does); ``top_k`` -1 or >= 1; ``min_p`` in [0, 1]; ``frequency_penalty`` and
``presence_penalty`` in [-2, 2]; ``repetition_penalty`` in [0, 2]; token counts >= 0.
Each protocol checks its own field names (``max_output_tokens`` for Responses, ...).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from areal.proxy.errors import ChatRequestError

__all__ = [
    "CHAT_ROLES",
    "MAX_TOKEN_COUNT",
    "SAMPLING_FIELDS",
    "check_chat_request",
    "check_chat_shape",
    "check_sampling",
]

CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
TOOL_CHOICES = frozenset({"none", "auto", "required"})
TEXT_PART_TYPES = frozenset({"text", "input_text", "output_text"})
# apply_chat_template's own parameters: a client may set template variables, not these
RENDER_ARGUMENTS = frozenset(
    {
        "conversation",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)
# token counts beyond int32 are never meaningful and would overflow engine-side types
MAX_TOKEN_COUNT = 2**31 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)

Check = Callable[[Any, str], None]


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _number(value: Any, param: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ChatRequestError(f"{param} must be a number, got {_type_name(value)}", param)
    if not math.isfinite(value):
        raise ChatRequestError(f"{param} must be a finite number, got {value!r}", param)
    return float(value)


def _integer(value: Any, param: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ChatRequestError(f"{param} must be an integer, got {value!r}", param)
    return value


def _real(low: float, high: float = math.inf) -> Check:
    interval = f"[{low:g}, {high:g}{']' if math.isfinite(high) else ')'}"

    def check(value: Any, param: str) -> None:
        number = _number(value, param)
        if number < low or number > high:
            raise ChatRequestError(f"{param} must be in {interval}, got {value!r}", param)

    return check


def _count(low: int = 0) -> Check:
    def check(value: Any, param: str) -> None:
        count = _integer(value, param)
        if not low <= count <= MAX_TOKEN_COUNT:
            raise ChatRequestError(
                f"{param} must be an integer in [{low}, {MAX_TOKEN_COUNT}], got {value!r}", param
            )

    return check


def _top_k(value: Any, param: str) -> None:
    k = _integer(value, param)
    if k != -1 and not 1 <= k <= MAX_TOKEN_COUNT:
        raise ChatRequestError(f"{param} must be -1 (off) or at least 1, got {value!r}", param)


def _seed(value: Any, param: str) -> None:
    seed = _integer(value, param)
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise ChatRequestError(f"{param} must fit in 64 bits, got {value!r}", param)


# top_p 0 means "unset" to the reference's proxy (served as 1.0); below 0 or above 1 is refused
TEMPERATURE, TOP_P = _real(0.0), _real(0.0, 1.0)
PENALTY = _real(-2.0, 2.0)
SAMPLING_FIELDS: dict[str, dict[str, Check]] = {
    "chat_completions": {
        "temperature": TEMPERATURE,
        "top_p": TOP_P,
        "top_k": _top_k,
        "min_p": _real(0.0, 1.0),
        "frequency_penalty": PENALTY,
        "presence_penalty": PENALTY,
        "repetition_penalty": _real(0.0, 2.0),
        "max_tokens": _count(),
        "max_completion_tokens": _count(),
        "max_total_tokens": _count(),
        "n": _count(1),
        "seed": _seed,
    },
    "responses": {
        "temperature": TEMPERATURE,
        "top_p": TOP_P,
        "max_output_tokens": _count(),
    },
    "anthropic": {
        "temperature": TEMPERATURE,
        "top_p": TOP_P,
        "top_k": _top_k,
        "max_tokens": _count(),
    },
}


def check_sampling(protocol: str, body: dict[str, Any]) -> None:
    """Refuse (400) any sampling field of ``protocol`` the inference server would refuse."""
    for name, check in SAMPLING_FIELDS[protocol].items():
        value = body.get(name)
        if value is not None:
            check(value, name)


# --- chat-completions shape ---


def _fail(param: str, message: str) -> ChatRequestError:
    return ChatRequestError(f"{param} {message}", param)


def _optional(body: dict[str, Any], name: str, kind: type, what: str) -> None:
    value = body.get(name)
    if value is not None and not isinstance(value, kind):
        raise _fail(name, f"must be {what}, got {_type_name(value)}")


def _check_content(content: Any, i: int) -> None:
    if isinstance(content, str):
        return
    if not isinstance(content, list):
        raise _fail(
            f"messages[{i}].content",
            f"must be a string or a list of parts, got {_type_name(content)}",
        )
    for j, part in enumerate(content):
        if isinstance(part, str):
            continue
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise _fail(
                f"messages[{i}].content[{j}]", "must be a string or an object with a string 'type'"
            )
        if part["type"] in TEXT_PART_TYPES and not isinstance(part.get("text"), str):
            raise _fail(f"messages[{i}].content[{j}].text", "must be a string")


def _check_tool_calls(calls: Any, i: int) -> None:
    if not isinstance(calls, list):
        raise _fail(f"messages[{i}].tool_calls", f"must be a list, got {_type_name(calls)}")
    for j, call in enumerate(calls):
        if not isinstance(call, dict):
            raise _fail(
                f"messages[{i}].tool_calls[{j}]", f"must be an object, got {_type_name(call)}"
            )
        for key in ("id", "type"):
            if call.get(key) is not None and not isinstance(call[key], str):
                raise _fail(f"messages[{i}].tool_calls[{j}].{key}", "must be a string")
        fn = call.get("function")
        if not isinstance(fn, dict):
            raise _fail(
                f"messages[{i}].tool_calls[{j}].function",
                f"must be an object, got {_type_name(fn)}",
            )
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _fail(
                f"messages[{i}].tool_calls[{j}].function.name", "must be a non-empty string"
            )
        arguments = fn.get("arguments")
        if arguments is not None and not isinstance(arguments, (str, dict)):
            raise _fail(
                f"messages[{i}].tool_calls[{j}].function.arguments",
                f"must be a JSON string or an object, got {_type_name(arguments)}",
            )


def _check_message(message: Any, i: int) -> None:
    """One message; field names in errors are built only on failure (this runs per turn)."""
    if not isinstance(message, dict):
        raise _fail(f"messages[{i}]", f"must be an object, got {_type_name(message)}")
    role = message.get("role")
    if role not in CHAT_ROLES:
        if not isinstance(role, str):
            raise _fail(f"messages[{i}].role", f"must be a string, got {_type_name(role)}")
        raise _fail(
            f"messages[{i}].role", f"is unknown: {role!r} (expected one of {sorted(CHAT_ROLES)})"
        )
    content = message.get("content")
    if content is None:
        if role != "assistant":
            raise _fail(f"messages[{i}].content", f"is required for a {role} message")
    elif not isinstance(content, str):
        _check_content(content, i)
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise _fail(f"messages[{i}].tool_calls", "is only allowed on assistant messages")
        _check_tool_calls(calls, i)
    for key in ("name", "tool_call_id"):
        value = message.get(key)
        if value is not None and not isinstance(value, str):
            raise _fail(f"messages[{i}].{key}", f"must be a string, got {_type_name(value)}")


def _check_tools(tools: Any) -> None:
    if not isinstance(tools, list):
        raise _fail("tools", f"must be a list, got {_type_name(tools)}")
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise _fail(where, f"must be an object, got {_type_name(tool)}")
        kind = tool.get("type", "function")
        if not isinstance(kind, str):
            raise _fail(f"{where}.type", "must be a string")
        if kind != "function":
            continue  # other kinds are not offered to the model
        fn = tool.get("function", tool)  # chat style, or flat Responses style
        if not isinstance(fn, dict):
            raise _fail(f"{where}.function", f"must be an object, got {_type_name(fn)}")
        prefix = f"{where}.function" if "function" in tool else where
        if not isinstance(fn.get("name"), str) or not fn["name"]:
            raise _fail(f"{prefix}.name", "must be a non-empty string")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise _fail(f"{prefix}.parameters", "must be a JSON-schema object")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise _fail(f"{prefix}.description", "must be a string")


def _check_tool_choice(choice: Any) -> None:
    if isinstance(choice, str):
        if choice not in TOOL_CHOICES:
            raise _fail("tool_choice", f"must be one of {sorted(TOOL_CHOICES)} or an object")
        return
    if not isinstance(choice, dict) or not isinstance(choice.get("type"), str):
        raise _fail("tool_choice", "must be a string or an object with a string 'type'")
    fn = choice.get("function")
    if fn is not None and (not isinstance(fn, dict) or not isinstance(fn.get("name"), str)):
        raise _fail("tool_choice.function.name", "must be a string")


def check_chat_shape(body: dict[str, Any]) -> None:
    """Refuse (400) a chat-completions request whose fields have the wrong shape."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _fail("messages", "must be a non-empty list")
    for i, message in enumerate(messages):
        _check_message(message, i)
    if body.get("tools") is not None:
        _check_tools(body["tools"])
    if body.get("tool_choice") is not None:
        _check_tool_choice(body["tool_choice"])
    stop = body.get("stop")
    if not (stop is None or isinstance(stop, str)) and not (
        isinstance(stop, list) and all(isinstance(s, str) for s in stop)
    ):
        raise _fail("stop", "must be a string or a list of strings")
    for name in ("stream", "store"):
        _optional(body, name, bool, "a boolean")
    for name in ("model", "user"):
        _optional(body, name, str, "a string")
    for name in ("metadata", "stream_options", "extra_body"):
        _optional(body, name, dict, "an object")
    template_kwargs = (body.get("extra_body") or {}).get("chat_template_kwargs")
    if template_kwargs is not None:
        where = "extra_body.chat_template_kwargs"
        if not isinstance(template_kwargs, dict):
            raise _fail(where, "must be an object")
        for key in template_kwargs:
            if key in RENDER_ARGUMENTS:
                raise _fail(f"{where}.{key}", "is a rendering option, not a template variable")


def check_chat_request(body: dict[str, Any]) -> None:
    """Sampling fields and shape of a chat-completions request (400 naming the field)."""
    check_sampling("chat_completions", body)
    check_chat_shape(body)
