"""Sessions of the rollout proxy: creation under capacity, key lookup, idle sweeping.

A session collects the interactions of one rollout sample. It is started (admin), used
for generation and rewards (session key, or the gateway key plus session headers),
ended (session key) and finally exported and deleted (admin). Sessions idle for longer
than ``session_timeout`` seconds are swept (at most once a minute, on session start).

Session ids are ``<task_id>-<n>.<run nonce>``: ``n`` counts the sessions this proxy has
started and the nonce is random per proxy start (or given), so an id is never issued
twice, not even for the same task id after an export or by the proxy of a resumed run.
That matters because a gateway session token is derived from the id alone: a reused id
would let an old token reach a new session. An ended session refuses generation and
rewards (410); an exported or swept one is remembered for ``session_timeout`` seconds so
that its key and token keep getting 410 rather than reaching anything else.

A caller of ``start_session`` may choose the session's key, but only a fresh one: never
the admin key, the gateway key, a secret's printed form, or a key this proxy has bound to
any session before (live, ended, exported or swept; a digest of every key is kept for
the proxy's lifetime). Whoever still holds an old key could otherwise reach the new
session and write into its trajectory.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import re
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from areal.proxy.interaction import InteractionCache, PrefixMatcher
from areal.proxy.keys import (
    derive_gateway_key,
    derive_session_token,
    new_session_key,
    same_secret,
)
from areal.utils.secrets import REDACTED, reveal

__all__ = ["ProxyAuthError", "Session", "SessionStore", "new_run_nonce"]

SWEEP_INTERVAL = 60.0
# The Arena agent accepts session ids of up to 200 characters from this alphabet; a task
# id of at most 128 leaves room for the "-<n>.<nonce>" suffix.
TASK_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}")
NONCE_PATTERN = re.compile(r"[A-Za-z0-9]{1,32}")


def _digest(key: str) -> bytes:
    return hashlib.sha256(reveal(key).encode()).digest()


def new_run_nonce() -> str:
    """A random run nonce (8 hex digits) that makes this proxy's session ids its own."""
    return secrets.token_hex(4)


class ProxyAuthError(Exception):
    """An authentication or admission failure with its HTTP status."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class Session:
    session_id: str
    task_id: str
    api_key: str
    cache: InteractionCache
    metadata: dict[str, Any] = field(default_factory=dict)
    finished: bool = False
    last_access: float = field(default_factory=time.monotonic)
    context_overflow: bool = False
    context_overflow_message: str | None = None
    system_error: bool = False
    system_error_message: str | None = None
    _requests: itertools.count = field(default_factory=itertools.count, repr=False)
    _finished_event: asyncio.Event | None = field(default=None, repr=False)

    def touch(self) -> None:
        self.last_access = time.monotonic()

    def next_request_index(self) -> int:
        return next(self._requests)

    def finished_event(self) -> asyncio.Event:
        if self._finished_event is None:
            self._finished_event = asyncio.Event()
            if self.finished:
                self._finished_event.set()
        return self._finished_event

    def finish(self) -> None:
        self.finished = True
        if self._finished_event is not None:
            self._finished_event.set()

    def diagnostics(self) -> dict[str, Any]:
        return {
            "interaction_count": len(self.cache),
            "context_overflow": self.context_overflow,
            "context_overflow_message": self.context_overflow_message,
            "system_error": self.system_error,
            "system_error_message": self.system_error_message,
        }


class SessionStore:
    """All sessions of one proxy, keyed by id and by session key."""

    def __init__(
        self,
        admin_key: str,
        session_timeout: float = 3600.0,
        prefix_matcher: PrefixMatcher | None = None,
        run_nonce: str | None = None,
    ):
        nonce = new_run_nonce() if run_nonce is None else run_nonce
        if not NONCE_PATTERN.fullmatch(nonce):
            raise ValueError(f"the session-id nonce must be 1-32 letters or digits, got {nonce!r}")
        self.admin_key = admin_key
        self.session_timeout = session_timeout
        self.prefix_matcher = prefix_matcher
        self.run_nonce = nonce
        self.capacity = 0
        self._sessions: dict[str, Session] = {}
        self._key_to_session: dict[str, str] = {}
        self._gone: dict[str, float] = {}  # removed session id -> when
        self._used_keys: set[bytes] = set()  # SHA-256 of every key ever bound here
        self._serial = itertools.count()
        self._last_sweep = time.monotonic()

    def __len__(self) -> int:
        return len(self._sessions)

    def grant_capacity(self, count: int = 1) -> int:
        self.capacity += count
        return self.capacity

    def start(
        self, task_id: str, api_key: str | None = None, metadata: dict | None = None
    ) -> Session:
        self._maybe_sweep()
        if not isinstance(task_id, str) or not TASK_ID_PATTERN.fullmatch(task_id):
            raise ProxyAuthError(
                400,
                "task_id must be 1-128 characters of letters, digits and '_.:-', starting "
                f"with a letter or digit; got {task_id!r}",
            )
        if api_key is not None and (not isinstance(api_key, str) or not api_key.strip()):
            raise ProxyAuthError(400, "api_key must be a non-empty string or null")
        if metadata is not None and not isinstance(metadata, dict):
            raise ProxyAuthError(400, "metadata must be an object or null")
        if self.capacity <= 0:
            raise ProxyAuthError(429, "no session capacity; the controller has not admitted one")
        if api_key is not None:
            self._check_fresh_key(api_key)
        key = api_key or new_session_key()
        session_id = f"{task_id}-{next(self._serial)}.{self.run_nonce}"
        self.capacity -= 1
        session = Session(
            session_id=session_id,
            task_id=task_id,
            api_key=key,
            cache=InteractionCache(self.prefix_matcher),
            metadata=dict(metadata or {}),
        )
        self._sessions[session_id] = session
        self._key_to_session[key] = session_id
        self._used_keys.add(_digest(key))
        return session

    def _check_fresh_key(self, api_key: str) -> None:
        """Refuse a caller-chosen session key that is, or was, another credential."""
        if reveal(api_key).strip() == REDACTED:
            raise ProxyAuthError(400, f"api_key is {REDACTED!r}, the printed form of a secret")
        if same_secret(api_key, self.admin_key):
            raise ProxyAuthError(400, "the admin key cannot be a session key")
        if same_secret(api_key, derive_gateway_key(self.admin_key)):
            raise ProxyAuthError(400, "the gateway key cannot be a session key")
        if _digest(api_key) in self._used_keys:
            raise ProxyAuthError(
                409,
                "this api_key was already bound to a session of this proxy; session keys are "
                "never reused (omit api_key to get a fresh one)",
            )

    def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    def by_key(self, token: str) -> Session | None:
        """The session of a session key; raises 410 for a key whose session is gone."""
        session_id = self._key_to_session.get(token)
        if session_id is None:
            return None
        session = self._sessions.get(session_id)
        if session is None:
            raise ProxyAuthError(410, "the session of this key has ended and was removed")
        return session

    def by_gateway_headers(self, session_id: str | None, token: str | None) -> Session:
        """The session a gateway request names, after checking its token."""
        if not session_id or not token:
            raise ProxyAuthError(401, "the gateway key needs X-Session-Id and X-Session-Token")
        if not same_secret(token, derive_session_token(self.admin_key, session_id)):
            raise ProxyAuthError(401, "X-Session-Token does not match X-Session-Id")
        session = self._sessions.get(session_id)
        if session is None:
            if session_id in self._gone:
                raise ProxyAuthError(410, f"session {session_id!r} has ended and was removed")
            raise ProxyAuthError(401, f"session {session_id!r} is not active")
        return session

    def remove(self, session_id: str) -> Session | None:
        """Drop a session; its key and id keep answering 410 for ``session_timeout``."""
        session = self._sessions.pop(session_id, None)
        if session is not None:
            self._gone[session_id] = time.monotonic()
        return session

    def _maybe_sweep(self) -> None:
        now = time.monotonic()
        if now - self._last_sweep < SWEEP_INTERVAL:
            return
        self._last_sweep = now
        for session_id in [
            sid for sid, s in self._sessions.items() if now - s.last_access > self.session_timeout
        ]:
            self.remove(session_id)
        for session_id in [
            sid for sid, when in self._gone.items() if now - when > self.session_timeout
        ]:
            del self._gone[session_id]
        known = self._sessions.keys() | self._gone.keys()
        for key in [k for k, sid in self._key_to_session.items() if sid not in known]:
            del self._key_to_session[key]
