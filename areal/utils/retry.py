"""The one retry-and-backoff helper of the HTTP clients (Arena, proxy, RPC, inference server).

Each client states *what* is worth another attempt (a transport error, a 503, a 429...)
and how many attempts it makes; this module owns *how* attempts are spaced and counted,
on top of tenacity. Delays grow geometrically: ``first_delay * multiplier**(n - 1)`` after
failed attempt ``n``, capped at ``max_delay``. The last attempt's outcome is what the
caller sees: its result, or its exception unchanged (never a wrapper), so clients keep
their own error messages.

``sleep`` is injectable so tests run retries without waiting.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import tenacity

__all__ = ["RetryPolicy", "always", "never"]

T = TypeVar("T")


def never(_: Any) -> bool:
    """Retry on no result / no exception."""
    return False


def always(_: Any) -> bool:
    return True


@dataclass(frozen=True)
class RetryPolicy:
    """How many attempts, and the waits between them."""

    attempts: int | None = 3
    """Total attempts, the first included; ``None``: until one succeeds."""
    first_delay: float = 1.0
    """Seconds after the first failed attempt."""
    multiplier: float = 2.0
    max_delay: float = float("inf")

    def __post_init__(self) -> None:
        if self.attempts is not None and self.attempts < 1:
            raise ValueError(
                f"RetryPolicy.attempts must be at least 1 (or None), got {self.attempts}"
            )
        if self.first_delay < 0 or self.multiplier < 1 or self.max_delay < 0:
            raise ValueError(
                "RetryPolicy needs first_delay >= 0, multiplier >= 1 and max_delay >= 0, got "
                f"{self.first_delay}, {self.multiplier}, {self.max_delay}"
            )

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed attempt ``attempt`` (1-based)."""
        return min(self.first_delay * self.multiplier ** (attempt - 1), self.max_delay)

    def _options(
        self,
        retry_on_exception: Callable[[BaseException], bool],
        retry_on_result: Callable[[Any], bool],
        before_attempt: Callable[[int], None] | None,
        on_retry: Callable[[int, float, BaseException | None], None] | None,
    ) -> dict[str, Any]:
        """tenacity's options for attempts 2 onwards (attempt 1 ran in ``_first``)."""

        def wait(state: tenacity.RetryCallState) -> float:
            return self.delay(state.attempt_number + 1)

        def before_sleep(state: tenacity.RetryCallState) -> None:
            if on_retry is not None:
                outcome = state.outcome
                error = outcome.exception() if outcome is not None and outcome.failed else None
                n = state.attempt_number + 1
                on_retry(n, self.delay(n), error)

        def before(state: tenacity.RetryCallState) -> None:
            if before_attempt is not None:
                before_attempt(state.attempt_number + 1)

        stop = (
            tenacity.stop_never
            if self.attempts is None
            else tenacity.stop_after_attempt(self.attempts - 1)
        )
        return {
            "stop": stop,
            "wait": wait,
            "retry": tenacity.retry_if_exception(retry_on_exception)
            | tenacity.retry_if_result(retry_on_result),
            "before": before,
            "before_sleep": before_sleep,
            "reraise": True,
            # the last attempt's outcome as it is: its result, or its exception re-raised
            "retry_error_callback": lambda state: state.outcome.result(),
        }

    def call(
        self,
        fn: Callable[[], T],
        *,
        retry_on_exception: Callable[[BaseException], bool] = never,
        retry_on_result: Callable[[T], bool] = never,
        before_attempt: Callable[[int], None] | None = None,
        on_retry: Callable[[int, float, BaseException | None], None] | None = None,
        sleep: Callable[[float], None] | None = None,
    ) -> T:
        """``fn()`` until it succeeds or the attempts run out.

        ``before_attempt(n)`` runs before attempt ``n`` (it may raise to stop early);
        ``on_retry(n, delay, error)`` before each wait (``error`` is None for a result
        that was retried).
        """
        sleep = sleep or time.sleep
        if before_attempt is not None:
            before_attempt(1)
        try:
            result = fn()
        except BaseException as error:
            if not self._again(error, retry_on_exception(error), on_retry):
                raise
        else:
            if not self._again(None, retry_on_result(result), on_retry):
                return result
        sleep(self.delay(1))
        options = self._options(retry_on_exception, retry_on_result, before_attempt, on_retry)
        return tenacity.Retrying(sleep=sleep, **options)(fn)

    async def acall(
        self,
        fn: Callable[[], Awaitable[T]],
        *,
        retry_on_exception: Callable[[BaseException], bool] = never,
        retry_on_result: Callable[[T], bool] = never,
        before_attempt: Callable[[int], None] | None = None,
        on_retry: Callable[[int, float, BaseException | None], None] | None = None,
        sleep: Callable[[float], Awaitable[None]] | None = None,
    ) -> T:
        """The coroutine form of :meth:`call`."""
        sleep = sleep or asyncio.sleep
        if before_attempt is not None:
            before_attempt(1)
        try:
            result = await fn()
        except BaseException as error:
            if not self._again(error, retry_on_exception(error), on_retry):
                raise
        else:
            if not self._again(None, retry_on_result(result), on_retry):
                return result
        await sleep(self.delay(1))
        options = self._options(retry_on_exception, retry_on_result, before_attempt, on_retry)

        async def attempt() -> T:
            # a coroutine function, so every tenacity release awaits it (9.2 calls a plain
            # callable, a lambda returning a coroutine, without awaiting its result)
            return await fn()

        return await tenacity.AsyncRetrying(sleep=sleep, **options)(attempt)

    def _again(
        self,
        error: BaseException | None,
        retryable: bool,
        on_retry: Callable[[int, float, BaseException | None], None] | None,
    ) -> bool:
        """Whether a second attempt follows the first (which failed with ``error``, or
        returned a result that ``retryable`` says to retry). The first attempt runs without
        tenacity: most calls succeed at once, and tenacity costs a few hundred
        microseconds per call."""
        if not retryable or self.attempts == 1:
            return False
        if on_retry is not None:
            on_retry(1, self.delay(1), error)
        return True
