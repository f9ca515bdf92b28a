"""RetryPolicy: the waits, the attempt counts, and which outcome the caller sees."""

from __future__ import annotations

import pytest

from areal.utils.retry import RetryPolicy


class Flaky:
    """Fails (raises ``error`` or returns ``bad``) ``failures`` times, then returns "ok"."""

    def __init__(self, failures: int, error: type[Exception] | None = OSError, bad=None):
        self.failures = failures
        self.error = error
        self.bad = bad
        self.calls = 0
        self.raised: list[BaseException] = []

    def __call__(self):
        self.calls += 1
        if self.calls > self.failures:
            return "ok"
        if self.error is None:
            return self.bad
        error = self.error(f"failure {self.calls}")
        self.raised.append(error)
        raise error


def is_os_error(error: BaseException) -> bool:
    return isinstance(error, OSError)


# --- delays ---


def test_delays_grow_geometrically_up_to_the_cap():
    policy = RetryPolicy(first_delay=1.0, multiplier=2.0, max_delay=10.0)
    # 1 * 2**(n - 1): 1, 2, 4, 8, 16 -> 10, 32 -> 10, 64 -> 10
    assert [policy.delay(n) for n in range(1, 8)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0, 10.0]


def test_half_second_start_capped_at_five():
    policy = RetryPolicy(first_delay=0.5, multiplier=2.0, max_delay=5.0)
    # 0.5 * 2**(n - 1): 0.5, 1, 2, 4, 8 -> 5
    assert [policy.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 4.0, 5.0]


def test_multiplier_one_waits_the_same_each_time():
    policy = RetryPolicy(first_delay=0.25, multiplier=1.0)
    assert [policy.delay(n) for n in range(1, 5)] == [0.25, 0.25, 0.25, 0.25]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"attempts": 0},
        {"attempts": -1},
        {"first_delay": -0.1},
        {"multiplier": 0.5},
        {"max_delay": -1.0},
    ],
)
def test_invalid_settings_are_refused(kwargs):
    with pytest.raises(ValueError, match="RetryPolicy"):
        RetryPolicy(**kwargs)


# --- attempts and outcomes ---


def test_success_after_failures_waits_between_attempts_only():
    sleeps: list[float] = []
    fn = Flaky(failures=2)
    policy = RetryPolicy(attempts=5, first_delay=1.0, multiplier=3.0)
    assert policy.call(fn, retry_on_exception=is_os_error, sleep=sleeps.append) == "ok"
    assert fn.calls == 3
    assert sleeps == [1.0, 3.0]  # after attempt 1: 1 * 3**0; after attempt 2: 1 * 3**1


def test_attempts_run_out_and_the_last_exception_is_raised_unchanged():
    sleeps: list[float] = []
    fn = Flaky(failures=100)
    policy = RetryPolicy(attempts=4, first_delay=1.0, multiplier=2.0)
    with pytest.raises(OSError) as raised:
        policy.call(fn, retry_on_exception=is_os_error, sleep=sleeps.append)
    assert fn.calls == 4
    assert sleeps == [1.0, 2.0, 4.0]  # 3 waits between 4 attempts
    assert raised.value is fn.raised[-1]  # the very object, not a tenacity wrapper
    assert str(raised.value) == "failure 4"


def test_one_attempt_never_waits():
    sleeps: list[float] = []
    fn = Flaky(failures=1)
    with pytest.raises(OSError, match="failure 1"):
        RetryPolicy(attempts=1).call(fn, retry_on_exception=is_os_error, sleep=sleeps.append)
    assert fn.calls == 1 and sleeps == []


def test_an_exception_not_retried_is_raised_at_once():
    sleeps: list[float] = []
    fn = Flaky(failures=3, error=KeyError)
    with pytest.raises(KeyError) as raised:
        RetryPolicy(attempts=5).call(fn, retry_on_exception=is_os_error, sleep=sleeps.append)
    assert raised.value is fn.raised[0]
    assert fn.calls == 1 and sleeps == []


def test_no_predicates_means_no_retry():
    fn = Flaky(failures=1)
    with pytest.raises(OSError):
        RetryPolicy(attempts=5).call(fn, sleep=lambda s: pytest.fail("slept"))
    assert fn.calls == 1


def test_retried_results_end_with_the_last_result_returned():
    sleeps: list[float] = []
    results = iter([503, 502, 504, 200])

    policy = RetryPolicy(attempts=3, first_delay=2.0, multiplier=2.0)
    outcome = policy.call(
        lambda: next(results), retry_on_result=lambda status: status >= 500, sleep=sleeps.append
    )
    assert outcome == 504  # the third and last attempt's result, as it is
    assert sleeps == [2.0, 4.0]  # 2 * 2**0, 2 * 2**1


def test_on_retry_sees_the_attempt_the_wait_and_the_error():
    seen: list[tuple[int, float, object]] = []
    outcomes = iter(["retry me", None])

    def fn():
        outcome = next(outcomes, "done")
        if outcome is None:
            raise OSError("down")
        return outcome

    policy = RetryPolicy(attempts=5, first_delay=1.5, multiplier=2.0)
    result = policy.call(
        fn,
        retry_on_exception=is_os_error,
        retry_on_result=lambda value: value == "retry me",
        on_retry=lambda n, delay, error: seen.append((n, delay, error)),
        sleep=lambda seconds: None,
    )
    assert result == "done"
    assert [(n, delay) for n, delay, _ in seen] == [(1, 1.5), (2, 3.0)]
    assert seen[0][2] is None  # a retried result has no error
    assert isinstance(seen[1][2], OSError) and str(seen[1][2]) == "down"


def test_before_attempt_numbers_attempts_and_its_error_stops_the_retries():
    numbers: list[int] = []

    class ClosedError(Exception):
        pass

    def before(n: int) -> None:
        numbers.append(n)
        if n == 3:
            raise ClosedError(f"closed before attempt {n}")

    fn = Flaky(failures=100)
    with pytest.raises(ClosedError, match="closed before attempt 3"):
        RetryPolicy(attempts=10).call(
            fn, retry_on_exception=is_os_error, before_attempt=before, sleep=lambda s: None
        )
    assert numbers == [1, 2, 3]
    assert fn.calls == 2  # attempt 3 never ran


def test_none_attempts_retries_until_success():
    sleeps: list[float] = []
    fn = Flaky(failures=12)

    def bounded_sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) > 50:  # the test's own bound: "forever" must end at the success
            pytest.fail("still retrying after 50 waits")

    policy = RetryPolicy(attempts=None, first_delay=0.5, multiplier=2.0, max_delay=5.0)
    assert policy.call(fn, retry_on_exception=is_os_error, sleep=bounded_sleep) == "ok"
    assert fn.calls == 13
    # 12 waits: 0.5, 1, 2, 4, then 5 eight times
    assert sleeps == [0.5, 1.0, 2.0, 4.0] + [5.0] * 8
    assert sum(sleeps) == 47.5  # 7.5 + 8 * 5


# --- the coroutine form ---


async def test_acall_retries_a_coroutine_with_an_async_sleep():
    sleeps: list[float] = []
    calls = 0

    async def fn() -> str:
        nonlocal calls
        calls += 1
        if calls < 3:
            raise ConnectionError(f"attempt {calls}")
        return "connected"

    async def record(seconds: float) -> None:
        sleeps.append(seconds)

    policy = RetryPolicy(attempts=4, first_delay=1.0, multiplier=2.0, max_delay=10.0)
    assert await policy.acall(fn, retry_on_exception=is_os_error, sleep=record) == "connected"
    assert calls == 3 and sleeps == [1.0, 2.0]


async def test_acall_reraises_the_last_exception_unchanged():
    raised: list[BaseException] = []

    async def fn():
        error = TimeoutError(f"timeout {len(raised) + 1}")
        raised.append(error)
        raise error

    async def no_wait(seconds: float) -> None:
        pass

    with pytest.raises(TimeoutError) as caught:
        await RetryPolicy(attempts=3).acall(fn, retry_on_exception=is_os_error, sleep=no_wait)
    assert len(raised) == 3 and caught.value is raised[-1]


async def test_acall_returns_the_last_retried_result():
    statuses = iter([429, 429])

    async def fn() -> int:
        return next(statuses)

    async def no_wait(seconds: float) -> None:
        pass

    policy = RetryPolicy(attempts=2)
    assert await policy.acall(fn, retry_on_result=lambda s: s == 429, sleep=no_wait) == 429


async def test_acall_awaits_a_plain_callable_that_returns_a_coroutine():
    """A lambda (not a coroutine function) returning a coroutine, as the clients pass: each
    attempt's coroutine is awaited, on the first attempt and on tenacity's retries."""
    calls = 0

    async def connect(n: int) -> dict:
        if n < 3:
            raise ConnectionError(f"attempt {n}")
        return {"session_id": "s-1"}

    def fn():
        nonlocal calls
        calls += 1
        return connect(calls)

    async def no_wait(seconds: float) -> None:
        pass

    result = await RetryPolicy(attempts=4).acall(
        lambda: fn(), retry_on_exception=is_os_error, sleep=no_wait
    )
    assert result == {"session_id": "s-1"} and calls == 3
