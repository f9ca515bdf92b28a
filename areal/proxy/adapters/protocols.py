"""The three client protocols over chat completions, in one place.

A caller speaks ``chat_completions``, ``responses`` (OpenAI Responses) or ``anthropic``
(Messages). :func:`to_chat` turns its request into a chat-completions request;
:func:`from_chat` turns the chat completion back into the caller's reply;
:func:`stream_events` lists the server-sent events of that reply and :func:`sse_chunks`
encodes them. The rollout proxy and the local Arena's LLM gateway both serve callers
through these functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from areal.proxy.adapters.anthropic import (
    AnthropicRequestError,
    chat_to_message,
    message_stream_events,
    messages_to_chat,
)
from areal.proxy.adapters.chat_stream import chat_stream_chunks
from areal.proxy.adapters.responses import (
    ResponsesRequestError,
    chat_to_response,
    response_stream_events,
    responses_to_chat,
)
from areal.proxy.errors import InvalidRequestError
from areal.proxy.validation import check_chat_shape, check_sampling

__all__ = [
    "PROTOCOLS",
    "ProtocolRequestError",
    "Translated",
    "error_body",
    "from_chat",
    "sse_chunks",
    "stream_events",
    "to_chat",
]

PROTOCOLS = ("chat_completions", "responses", "anthropic")
SSE_HEADERS = {"Cache-Control": "no-cache", "Connection": "keep-alive", "X-Accel-Buffering": "no"}


class ProtocolRequestError(InvalidRequestError):
    """A request that cannot be translated to chat completions (HTTP 400)."""


@dataclass
class Translated:
    """A caller's request and its chat-completions equivalent."""

    protocol: str
    original: dict[str, Any]
    chat: dict[str, Any]
    custom_tools: set[str] = field(default_factory=set)

    @property
    def stream(self) -> bool:
        return bool(self.original.get("stream"))


def to_chat(protocol: str, body: dict[str, Any]) -> Translated:
    """The chat-completions form of a request, after checking it (400 naming the field).

    Sampling fields are checked under the protocol's own names, the translated request's
    shape under chat-completions names; any other translation failure is the request's
    fault too (a wrong type or a missing key), never a server error.
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"unknown protocol {protocol!r}; expected one of {PROTOCOLS}")
    try:
        check_sampling(protocol, body)
        if protocol == "chat_completions":
            translated = Translated(protocol, body, body)
        elif protocol == "responses":
            chat, custom = responses_to_chat(body)
            translated = Translated(protocol, body, chat, custom)
        else:
            translated = Translated(protocol, body, messages_to_chat(body))
        check_chat_shape(translated.chat)
    except InvalidRequestError as e:
        raise ProtocolRequestError(str(e), e.param) from None
    except (ResponsesRequestError, AnthropicRequestError) as e:
        raise ProtocolRequestError(str(e)) from None
    except (KeyError, TypeError, AttributeError, ValueError, IndexError) as e:
        what = "Responses" if protocol == "responses" else "Messages"
        detail = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        raise ProtocolRequestError(f"malformed {what} request: {detail}") from None
    return translated


def from_chat(request: Translated, completion: dict[str, Any]) -> dict[str, Any]:
    """The caller's reply for a chat completion."""
    if request.protocol == "responses":
        return chat_to_response(completion, request.original, request.custom_tools)
    if request.protocol == "anthropic":
        return chat_to_message(completion, request.original.get("model"))
    return completion


def stream_events(request: Translated, reply: dict[str, Any]) -> Iterator[tuple[str | None, Any]]:
    """``(event name or None, data)`` pairs of the streamed form of ``reply``."""
    if request.protocol == "responses":
        return ((event["type"], event) for event in response_stream_events(reply))
    if request.protocol == "anthropic":
        return message_stream_events(reply)
    return ((None, chunk) for chunk in chat_stream_chunks(reply))


def sse_chunks(events: Iterable[tuple[str | None, Any]]) -> Iterator[bytes]:
    """Server-sent event frames; unnamed (chat) streams end with ``data: [DONE]``."""
    named = False
    for name, data in events:
        named = named or name is not None
        prefix = f"event: {name}\n".encode() if name else b""
        yield prefix + b"data: " + orjson.dumps(data) + b"\n\n"
    if not named:
        yield b"data: [DONE]\n\n"


def error_body(
    protocol: str, message: str, kind: str, param: str | None = None, **extra: Any
) -> dict[str, Any]:
    """An error in the caller's protocol (Anthropic's shape differs from OpenAI's).

    ``param`` names the request field at fault (OpenAI's ``error.param``; Anthropic's
    errors carry it in the same place).
    """
    inner: dict[str, Any] = {"message": message, "type": kind}
    if param is not None:
        inner["param"] = param
    if protocol == "anthropic":
        return {"type": "error", "error": inner, **extra}
    return {"error": inner, **extra}
