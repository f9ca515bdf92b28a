"""The errors the generation engine reports, and settling a caller's future with an outcome."""

from __future__ import annotations

import concurrent.futures
from typing import Any

__all__ = ["RequestError", "SequenceError", "settle"]


class RequestError(ValueError):
    """A request the server refuses (reported as HTTP 400, naming the field)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class SequenceError(RuntimeError):
    """Generation failed for this request alone (the others batched with it go on)."""


def settle(
    future: concurrent.futures.Future, result: Any = None, error: BaseException | None = None
) -> None:
    """Resolve ``future`` unless it is already done (e.g. cancelled by a deadline)."""
    if future.done():
        return
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass  # cancelled between the check and the set
