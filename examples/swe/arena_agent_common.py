"""Small helpers shared by the Arena agent modules: text cleanup, bounded awaits, secret masking."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

from areal.utils.secrets import REDACTED, redact_urls, reveal

__all__ = ["bounded", "clean_text", "describe_error", "scrub_secrets"]

T = TypeVar("T")


def clean_text(value: Any) -> str:
    """``value`` as a stripped string; ``None`` gives ``""``."""
    return "" if value is None else str(value).strip()


def _mask(text: str, secret_values: tuple[str | None, ...]) -> str:
    for value in secret_values:
        plain = reveal(value)
        if plain:
            text = text.replace(plain, REDACTED)
    return redact_urls(text)  # user-info and query strings of any URL in the text


def describe_error(error: BaseException, *secret_values: str | None) -> str:
    """``Class: message`` with the given secrets masked, for logs."""
    return _mask(f"{type(error).__name__}: {error}", secret_values)


async def bounded(awaitable: Awaitable[T], seconds: float) -> T:
    """``await awaitable`` within ``seconds`` (``TimeoutError`` after).

    Not ``asyncio.wait_for``: on Python 3.11 it can swallow a cancellation that arrives as
    the inner call completes, which would let a cancelled background loop keep running.
    """
    async with asyncio.timeout(seconds):
        return await awaitable


def scrub_secrets(error: BaseException, *secret_values: str | None) -> None:
    """Mask secrets in the messages of ``error`` and its causes (in place, same objects).

    Arena may echo a request body (an upstream key, a session token) in an error response.
    """
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.args = tuple(
            _mask(arg, secret_values) if isinstance(arg, str) else arg for arg in current.args
        )
        current = current.__cause__ or current.__context__
