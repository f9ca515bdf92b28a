"""Client-error types of the proxy: a bad request (400) names the field it is about."""

from __future__ import annotations

__all__ = ["ChatRequestError", "ContextLengthExceededError", "InvalidRequestError"]


class InvalidRequestError(ValueError):
    """A request the client must fix (HTTP 400); ``param`` is the field, when there is one.

    A client error never marks a session as having seen a system failure.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ChatRequestError(InvalidRequestError):
    """A chat request this proxy refuses (HTTP 400), naming the field."""


class ContextLengthExceededError(ChatRequestError):
    """The prompt leaves no room for generation (HTTP 400, ``context_length_exceeded``)."""
