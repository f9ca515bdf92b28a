"""The controller's one event loop for worker RPC, on a daemon thread.

Every :class:`~areal.infra.rpc.client.RPCClient` keeps its connections (an
``aiohttp.ClientSession``) on this loop, so they are pooled and reused whoever calls, and a
fan-out to many workers is one ``asyncio.gather`` here rather than a thread per call.
Coroutines started on another loop are handed to this one (:func:`on_rpc_loop`);
synchronous code enters through :func:`run_sync`, the one place where an RPC blocks.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import os
import threading
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

__all__ = ["in_rpc_loop", "on_rpc_loop", "rpc_loop", "run_on_rpc_loop", "run_sync"]

T = TypeVar("T")
P = ParamSpec("P")

# blocking helpers of RPC coroutines (liveness checks, encoding big bodies) run here
BLOCKING_THREADS = 32

_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None


def rpc_loop() -> asyncio.AbstractEventLoop:
    """The RPC loop, started on first use."""
    global _loop
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            loop.set_default_executor(
                concurrent.futures.ThreadPoolExecutor(
                    BLOCKING_THREADS, thread_name_prefix="rpc-blocking"
                )
            )
            started = threading.Event()
            threading.Thread(
                target=_serve, args=(loop, started), name="rpc-loop", daemon=True
            ).start()
            started.wait()
            _loop = loop
        return _loop


def _serve(loop: asyncio.AbstractEventLoop, started: threading.Event) -> None:
    asyncio.set_event_loop(loop)
    loop.call_soon(started.set)
    loop.run_forever()


def _forget_loop() -> None:
    """A forked child has no RPC thread: it starts its own loop if it needs one."""
    global _loop, _lock
    _loop = None
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_loop)


def in_rpc_loop() -> bool:
    """Whether the caller runs on the RPC loop."""
    try:
        return _loop is not None and asyncio.get_running_loop() is _loop
    except RuntimeError:
        return False


def run_sync(awaitable: Awaitable[T]) -> T:
    """Run ``awaitable`` on the RPC loop and wait for its outcome (from any thread but the
    loop's own, which would wait for itself)."""
    if in_rpc_loop():
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        raise RuntimeError("run_sync() on the RPC loop would wait for itself; await instead")
    future = asyncio.run_coroutine_threadsafe(_awaited(awaitable), rpc_loop())
    try:
        return future.result()
    except BaseException:
        future.cancel()  # interrupted (Ctrl-C): the request stops too
        raise


async def _awaited(awaitable: Awaitable[T]) -> T:
    return await awaitable


async def run_on_rpc_loop(coro: Coroutine[Any, Any, T]) -> T:
    """Await ``coro`` on the RPC loop: directly when already there, else handed over (and
    cancelled there when the caller is)."""
    if in_rpc_loop():
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, rpc_loop()))


def on_rpc_loop(
    fn: Callable[P, Coroutine[Any, Any, T]],
) -> Callable[P, Coroutine[Any, Any, T]]:
    """Decorator: the coroutine function always runs on the RPC loop, whoever awaits it."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        return await run_on_rpc_loop(fn(*args, **kwargs))

    return wrapper
