"""Per-sample execution context of a rollout, and shared HTTP clients per event loop.

Agents read ``get()`` to learn whether they run for evaluation, which task they serve
and which sample of the group they are; concurrent samples on one event loop each see
their own values (a context variable). ``stat_scope()`` names the stats scope to record
under: ``eval-rollout`` or ``rollout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Iterator
from contextvars import ContextVar, Token
from dataclasses import dataclass

__all__ = [
    "WorkflowContext",
    "close_clients",
    "get",
    "get_aiohttp_session",
    "get_http_pool",
    "get_httpx_client",
    "scoped",
    "set",
    "stat_scope",
]

DEFAULT_HTTP_TIMEOUT = 3600.0


@dataclass(frozen=True)
class WorkflowContext:
    is_eval: bool = False
    task_id: int | None = None
    sample_idx: int | None = None


_DEFAULT = WorkflowContext()  # frozen, so sharing it as the default is safe
_context: ContextVar[WorkflowContext] = ContextVar("areal_workflow_context", default=_DEFAULT)


def get() -> WorkflowContext:
    return _context.get()


def set(context: WorkflowContext) -> Token:
    return _context.set(context)


@contextlib.contextmanager
def scoped(**changes) -> Iterator[WorkflowContext]:
    """Temporarily replace fields of the current context."""
    token = _context.set(dataclasses.replace(_context.get(), **changes))
    try:
        yield _context.get()
    finally:
        _context.reset(token)


def stat_scope() -> str:
    return "eval-rollout" if get().is_eval else "rollout"


_lock = threading.Lock()
_aiohttp: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_httpx: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_pools: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def get_http_pool():
    """This event loop's keep-alive pool for engine requests (created on first use)."""
    from areal.utils.http_pool import HTTPPool

    loop = asyncio.get_running_loop()
    pool = _pools.get(loop)
    if pool is not None and not pool.closed:  # the hot path: no lock needed to read
        return pool
    with _lock:
        pool = _pools.get(loop)
        if pool is None or pool.closed:
            pool = _pools[loop] = HTTPPool()
        return pool


async def get_aiohttp_session():
    """This event loop's shared ``aiohttp.ClientSession`` (created on first use)."""
    import aiohttp

    loop = asyncio.get_running_loop()
    with _lock:
        session = _aiohttp.get(loop)
        if session is None or session.closed:
            session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=DEFAULT_HTTP_TIMEOUT),
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
            )
            _aiohttp[loop] = session
        return session


async def get_httpx_client():
    """This event loop's shared ``httpx.AsyncClient`` (created on first use)."""
    import httpx

    loop = asyncio.get_running_loop()
    with _lock:
        client = _httpx.get(loop)
        if client is None or client.is_closed:
            client = httpx.AsyncClient(timeout=DEFAULT_HTTP_TIMEOUT)
            _httpx[loop] = client
        return client


async def close_clients() -> None:
    """Close this event loop's shared clients (call before the loop shuts down)."""
    loop = asyncio.get_running_loop()
    with _lock:
        session, client = _aiohttp.pop(loop, None), _httpx.pop(loop, None)
        pool = _pools.pop(loop, None)
    if pool is not None:
        await pool.close()
    if session is not None:
        await session.close()
    if client is not None:
        await client.aclose()
