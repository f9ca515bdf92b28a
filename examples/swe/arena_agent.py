"""``ArenaStreamAgentWorkflow``: one Arena task per rollout, its top-level score as the reward.

The agent is hosted by the rollout proxy workflow (:mod:`areal.proxy.workflow`), which
opens a proxy session per sample and calls ``run(data, **AgentRunKwargs)``. ``run`` makes
the proxy reachable to Arena, launches one task for the row, waits for it within the
episode timeout and turns the task's top-level ``score`` into the RL reward.

Route modes (``econfig.arena_llm_route_mode``), i.e. how the Harness reaches the proxy:

* ``gateway``: one Arena LLM route per rollout, registered with the session's key and
  kept alive by a renewal loop (routes must outlive long generation pauses).
* ``session_gateway``: one route per rollout worker, registered with the generation-only
  gateway key; each task proves its session with ``X-Session-Id`` / ``X-Session-Token``
  headers. This avoids a control-plane registration per sample.
* ``direct``: no registration; the sandbox reaches the proxy over a private network.

Rewards come only from the envelope's top-level ``score`` (``raw`` belongs to the
grader), mapped by the Stream's transform and threshold. Failed tasks are classified by
``classify_proxy_failure``: a model failure trains as reward 0 on the recorded
interactions, anything else rejects the sample. Every task outcome can be appended to
private JSONL audit shards (``econfig.arena_result_dump_dir``).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import json
import math
import os
import re
import secrets
import socket
import stat
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, TypeVar
from urllib.parse import urlsplit

from areal.infra import workflow_context
from areal.proxy.hooks import FailureDisposition
from areal.proxy.keys import same_secret
from areal.proxy.workflow import HARNESS_OUTCOME_METRIC_CODES
from areal.utils import logging, stats_tracker
from areal.utils.secrets import REDACTED, SecretStr, reveal
from examples.swe.arena_client import LLM_PROTOCOLS, ArenaOpenAPIClient
from examples.swe.arena_config import load_arena_stream_configs
from examples.swe.arena_results import (
    SUCCESS_TASK_STATUSES,
    ArenaAPIError,
    ArenaTaskFailedError,
    ArenaTaskResult,
    normalize_status,
)
from examples.swe.arena_types import ArenaStreamConfig

__all__ = ["ArenaStreamAgentWorkflow", "harness_outcome_code"]

logger = logging.getLogger("arena.agent")
T = TypeVar("T")

ROUTE_MODES = ("gateway", "session_gateway", "direct")
SESSION_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}")
SESSION_REGISTRY_ATTR = "_arena_session_gateway_registry_v1"
SESSION_REGISTRY_CALLBACK_KEY = "arena-session-gateway-registrations"
RECEIPT_FETCH_TIMEOUT = 15.0  # seconds, capped further by arena_request_timeout


def _setting(econfig: Any, key: str, default: Any) -> Any:
    """``econfig[key]`` (a mapping or an attribute object); missing or null gives default."""
    if isinstance(econfig, Mapping):
        value = econfig.get(key)
    else:
        value = getattr(econfig, key, None)
    return default if value is None else value


def _text(value: Any) -> str:
    return "" if value is None else str(value).strip()


def _mask(text: str, secret_values: tuple[str | None, ...]) -> str:
    for value in secret_values:
        plain = reveal(value)
        if plain:
            text = text.replace(plain, REDACTED)
    return text


def _describe(error: BaseException, *secret_values: str | None) -> str:
    """``Class: message`` with the given secrets masked, for logs."""
    return _mask(f"{type(error).__name__}: {error}", secret_values)


async def _bounded(awaitable: Awaitable[T], seconds: float) -> T:
    """``await awaitable`` within ``seconds`` (``TimeoutError`` after).

    Not ``asyncio.wait_for``: on Python 3.11 it can swallow a cancellation that arrives as
    the inner call completes, which would let a cancelled background loop keep running.
    """
    async with asyncio.timeout(seconds):
        return await awaitable


def _scrub(error: BaseException, *secret_values: str | None) -> None:
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


# --- metrics ---


def _record(**values: float) -> None:
    """Record ``arena/<name>`` scalars in the current scope (``rollout``/``eval-rollout``)."""
    scope = workflow_context.stat_scope()
    stats_tracker.get("rollout").scalar(
        **{f"{scope}/arena/{name}": float(value) for name, value in values.items()}
    )


def _record_scoped(values: Mapping[str, float]) -> None:
    scope = workflow_context.stat_scope()
    stats_tracker.get("rollout").scalar(
        **{f"{scope}/{key}": float(value) for key, value in values.items()}
    )


def _task_type(data: Mapping[str, Any]) -> str:
    value = data.get("arena_task_type")
    return value.strip() if isinstance(value, str) and value.strip() else "unknown"


# --- failure attribution (spec 9.1 baseline, 14.4 strict) ---

_SYSTEM_FAILURE_STATUSES = frozenset(
    {"CANCELLED", "COLLECT_FAILED", "EVAL_FAILED", "FAILED", "SETUP_FAILED"}
)
_AGENT_PHASE_EXITED = "harness: harness agent phase exited with code"
_CLAUDE_AGENT_PHASE_ERROR = "harness: agent phase error: claude reported error"
_OUTCOME_MARKER = "GAMEAGENT_OUTCOME_CODE="
_OUTCOME_CODE_RE = re.compile(r"[A-Z][A-Z0-9_]{0,127}")
_MODEL_OUTCOME_CODES = frozenset({"AGENT_MAX_TURNS_EXCEEDED", "AUTONOMOUS_INCOMPLETE_NO_SHIP"})
_NATIVE_RUN_FAILURE_CODES = frozenset({"RUNTIME_EXECUTION_FAILED", "DSH_PUBLIC_ANSWER_MISSING"})
# Error text that points at infrastructure, never at the model.
_SYSTEM_ERROR_RE = re.compile(
    "|".join(
        (
            r"authentication",
            r"unauthori[sz]ed",
            r"invalid api key",
            r"permission denied",
            r"rate[ _-]?limit",
            r"connection (?:reset|refused|error)",
            r"timed out",
            r"timeout",
            r"service unavailable",
            r"internal server error",
            r"bad gateway",
            r"out of memory",
            r"no space left",
            r"traceback",
            r"llm_response_failed",
            r"system_failure",
            r"export_failed",
            r"setup_failed",
            r"eval_failed",
            r"(?:http|status|api error)\D{0,12}\b(?:401|403|408|429|500|502|503|504)\b",
        )
    ),
    re.IGNORECASE,
)
_CONTEXT_REASON_RE = re.compile(
    r"prompt.{0,4}too.{0,2}long"
    r"|context (?:window|length).{0,24}(?:exceeded|exhausted)"
    r"|(?:length|window) (?:exceeded|exhausted)"
    r"|maximum context length"
    r"|max(?:imum)?[ _-]turns? (?:exceeded|reached)"
)
_RUNNER_CONTEXT_RE = re.compile(
    r"model.{0,40}(?:length|context)|maximum context|no output|compaction.{0,40}disabled"
)


def _failure_raw(error: BaseException) -> Any:
    result = getattr(error, "result", None)
    if isinstance(result, ArenaTaskResult):
        return result.raw
    payload = getattr(error, "payload", None)
    return payload.get("raw") if isinstance(payload, Mapping) else None


def _raw_error_text(raw: Any) -> str:
    text = raw.get("error") if isinstance(raw, Mapping) else None
    return text if isinstance(text, str) else ""


def harness_outcome_code(raw: Any) -> str | None:
    """The one outcome code a result reports (``raw.outcome.code``, ``raw.outcome_code``,
    ``GAMEAGENT_OUTCOME_CODE=<CODE>`` markers in ``raw.error``), else ``None``.

    A malformed marker voids the result; so do two different codes.
    """
    if not isinstance(raw, Mapping):
        return None
    candidates: list[Any] = []
    outcome = raw.get("outcome")
    if isinstance(outcome, Mapping):
        candidates.append(outcome.get("code"))
    candidates.append(raw.get("outcome_code"))
    codes = {c for c in candidates if isinstance(c, str) and _OUTCOME_CODE_RE.fullmatch(c)}
    for marker in re.finditer(re.escape(_OUTCOME_MARKER) + r"(\S*)", _raw_error_text(raw)):
        if not _OUTCOME_CODE_RE.fullmatch(marker.group(1)):
            return None
        codes.add(marker.group(1))
    return codes.pop() if len(codes) == 1 else None


def _outcome_bucket(code: str | None) -> str:
    """A bounded metric-key suffix: listed codes as themselves, everything else ``OTHER``."""
    return code if code in HARNESS_OUTCOME_METRIC_CODES else "OTHER"


def _result_families(raw: Mapping[str, Any], text: str) -> set[str]:
    """Which Harness result formats ``raw`` looks like (exactly one is attributable)."""
    lowered = text.lower()
    families = set()
    if (
        any(str(key).startswith("native") for key in raw)
        or any(key in raw for key in ("runTerminals", "runFailures", "exportedRunCount"))
        or raw.get("harness") == "AReaLHarness"
    ):
        families.add("native")
    if (
        "outcome" in raw
        or "outcome_code" in raw
        or _OUTCOME_MARKER in text
        or "gameagent.envarena:" in lowered
    ):
        families.add("gameagent")
    if "harness agent phase exited with code" in lowered and "claude reported error" in lowered:
        families.add("legacy-claude")
    if "implementation" in raw or (isinstance(raw.get("harness"), Mapping) and not families):
        families.add("native-runner")
    return families


def _vetoed(raw: Mapping[str, Any]) -> bool:
    """Signs that a failed result is not the model's doing (14.4 common vetoes)."""
    if "trajectoryHealth" in raw and raw["trajectoryHealth"] != "healthy":
        return True
    if raw.get("failure") is not None:
        return True
    if "status" in raw and raw["status"] != "ERROR":
        return True
    error = raw.get("error")
    if error is not None and not isinstance(error, str):
        return True
    text = error or ""
    if _SYSTEM_ERROR_RE.search(text):
        return True
    return any(
        any(word in line for word in ("export", "collect", "setup"))
        and ("failed" in line or "error" in line)
        for line in text.lower().splitlines()
    )


def _legacy_claude_model_failure(text: str, context_overflow: bool) -> bool:
    lowered = text.lower()
    reasons = {m.group(1).strip() for m in re.finditer(r"claude reported error:?([^\n]*)", lowered)}
    if len(reasons) != 1:
        return False
    lines = [line for line in lowered.splitlines() if line.strip()]
    last = lines[-1].rstrip() if lines else ""
    if "collect" in last and (last.endswith(("...", "\u2026")) or "truncated" in last):
        return False  # the collect log was cut off: the real cause may be missing
    (reason,) = reasons
    if not reason:
        return context_overflow
    return bool(_CONTEXT_REASON_RE.search(reason))


def _native_model_failure(raw: Mapping[str, Any]) -> bool:
    """A version-1, healthy, completed native receipt whose runs failed only at runtime.

    This port reads the receipt from ``raw``: ``nativeReceiptVersion == 1``,
    ``trajectoryHealth == "healthy"``, ``nativeStatus == "completed"`` and a non-empty
    ``runFailures`` list whose every entry has ``code`` RUNTIME_EXECUTION_FAILED or
    DSH_PUBLIC_ANSWER_MISSING (or ``reason`` ``public_answer_missing``).
    """
    version = raw.get("nativeReceiptVersion")
    if isinstance(version, bool) or version != 1:
        return False
    if raw.get("trajectoryHealth") != "healthy":
        return False
    if _text(raw.get("nativeStatus")).lower() != "completed":
        return False
    failures = raw.get("runFailures")
    if not isinstance(failures, list) or not failures:
        return False
    return all(
        isinstance(f, Mapping)
        and (
            f.get("code") in _NATIVE_RUN_FAILURE_CODES or f.get("reason") == "public_answer_missing"
        )
        for f in failures
    )


def _runner_model_failure(raw: Mapping[str, Any], receipt: Any, context_overflow: bool) -> bool:
    """A typed context-length failure the proxy also saw, or a fetched runner receipt with
    exactly one failed turn whose message is about model length, no output or compaction."""
    typed = raw.get("error_type", raw.get("errorType"))
    if context_overflow and _text(typed).lower() == "context_length_exceeded":
        return True
    turns = receipt.get("turns") if isinstance(receipt, Mapping) else None
    if not isinstance(turns, list):
        return False
    failed = [
        t for t in turns if isinstance(t, Mapping) and _text(t.get("status")).lower() == "failed"
    ]
    if len(failed) != 1 or not isinstance(failed[0].get("error"), str):
        return False
    return bool(_RUNNER_CONTEXT_RE.search(failed[0]["error"].lower()))


def _model_attributed(error: ArenaTaskFailedError, context_overflow: bool) -> bool:
    raw = _failure_raw(error)
    if not isinstance(raw, Mapping) or _vetoed(raw):
        return False
    text = _raw_error_text(raw)
    families = _result_families(raw, text)
    if len(families) != 1:
        return False
    (family,) = families
    if family == "gameagent":
        return harness_outcome_code(raw) in _MODEL_OUTCOME_CODES
    if family == "legacy-claude":
        return _legacy_claude_model_failure(text, context_overflow)
    if family == "native":
        return _native_model_failure(raw)
    return _runner_model_failure(raw, error.harness_result, context_overflow)


def _baseline_disposition(
    error: BaseException, context_overflow: bool, interaction_count: int
) -> FailureDisposition:
    if not isinstance(error, ArenaTaskFailedError):
        return "system_failure_reject"
    status = normalize_status(error.status)
    if status in _SYSTEM_FAILURE_STATUSES:
        return "system_failure_reject"
    if status in ("NO_OUTPUT", "TIMEOUT") and interaction_count > 0:
        return "model_failure_zero"
    if status == "HARNESS_FAILED" and interaction_count > 0:
        text = _raw_error_text(_failure_raw(error)).lower()
        claude_error = _AGENT_PHASE_EXITED in text and _CLAUDE_AGENT_PHASE_ERROR in text
        if context_overflow or claude_error:
            return "model_failure_zero"
    return "unknown_failure_reject"


def _strict_disposition(
    error: BaseException, context_overflow: bool, interaction_count: int
) -> FailureDisposition:
    if not isinstance(error, ArenaTaskFailedError):
        return "system_failure_reject"
    status = normalize_status(error.status)
    if status in _SYSTEM_FAILURE_STATUSES:
        return "system_failure_reject"
    if (
        status == "HARNESS_FAILED"
        and interaction_count > 0
        and _model_attributed(error, context_overflow)
    ):
        return "model_failure_zero"
    return "unknown_failure_reject"


# --- audit shards ---

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_SHARD_FLAGS = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


def _open_private_dir(path: str) -> int:
    """A descriptor of ``path``, walked from ``/`` without following any symlink.

    Missing components are created with mode 0700; the last one must belong to the
    effective user and is set to 0700.
    """
    fd = os.open("/", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in [p for p in os.path.abspath(path).split(os.sep) if p]:
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):  # created concurrently
                    os.mkdir(part, 0o700, dir_fd=fd)
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            os.close(fd)
            fd = child
        if os.fstat(fd).st_uid != os.geteuid():
            raise PermissionError("the audit directory is not owned by the effective user")
        os.fchmod(fd, 0o700)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _append_private_line(directory: str, filename: str, line: bytes) -> None:
    """Append ``line`` to ``directory/filename`` (regular, ours, mode 0600, no symlinks)."""
    dir_fd = _open_private_dir(directory)
    try:
        fd = os.open(filename, _SHARD_FLAGS, 0o600, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.geteuid():
            raise PermissionError("the audit shard is not a regular file of the effective user")
        os.fchmod(fd, 0o600)
        view = memoryview(line)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def _compact_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _audit_line(record: dict[str, Any], raw: Any, max_raw_bytes: int) -> bytes:
    """The JSONL line of ``record``, with ``raw`` dropped when it exceeds the cap."""
    size = len(_compact_json(raw).encode("utf-8"))
    truncated = size > max_raw_bytes
    record["raw"] = None if truncated else raw
    record["raw_present"] = raw is not None
    record["raw_size_bytes"] = size
    record["raw_truncated"] = truncated
    return (_compact_json(record) + "\n").encode("utf-8")


def _shard_name() -> str:
    host = socket.gethostname().replace(os.sep, "_") or "localhost"
    return f"arena_results_{host}_{os.getpid()}.jsonl"


# --- session-gateway route registry (one Arena route per rollout worker) ---


@dataclass(eq=False)
class _SessionRoute:
    """One worker-level route; ``users`` counts the runs currently launched through it."""

    key: tuple[str, str]
    model_name: str
    deployment_id: str
    gateway_url: str
    upstream_url: str
    gateway_key: SecretStr
    client: ArenaOpenAPIClient
    http: Any
    registration_timeout: float
    probe_interval: float
    last_probe_at: float
    known_missing: bool = False
    users: int = 0
    probe_task: asyncio.Task | None = None


class _SessionGatewayRegistry:
    """Shares one Arena route per (Arena base, proxy base) among concurrent runs.

    Arena may garbage-collect idle routes, so an acquire after ``probe_interval`` checks
    the route exists (at most one probe in flight: everything runs under one lock) and
    re-registers it under the same name, which queued tasks still reference. While runs
    are active a background task repeats that check. A persistent registry (one per
    rollout worker) keeps its route when idle; :meth:`close` deletes it at shutdown.
    """

    def __init__(self, persistent: bool):
        self.persistent = persistent
        self._routes: dict[tuple[str, str], _SessionRoute] = {}
        self._lock = asyncio.Lock()
        self._closed = False

    async def acquire(
        self,
        client: ArenaOpenAPIClient,
        http: Any,
        proxy_url: str,
        gateway_key: str,
        registration_timeout: float,
        probe_interval: float,
    ) -> _SessionRoute:
        async with self._lock:
            if self._closed:
                raise RuntimeError("the Arena session-gateway registry is closed")
            key = (client.base_url, proxy_url.rstrip("/"))
            route = self._routes.get(key)
            if route is None:
                route = await self._register_new(
                    key, client, http, gateway_key, registration_timeout, probe_interval
                )
                self._routes[key] = route
            else:
                if not same_secret(route.gateway_key, gateway_key):
                    raise RuntimeError(
                        "the proxy gateway key changed within a rollout worker; the Arena "
                        "session-gateway route cannot be shared"
                    )
                route.client, route.http = client, http
                route.registration_timeout = registration_timeout
                route.probe_interval = min(route.probe_interval, probe_interval)
                await self._ensure_live(route)
            route.users += 1
            if route.probe_task is None or route.probe_task.done():
                route.probe_task = asyncio.create_task(self._probe_while_active(route))
            return route

    async def _register_new(
        self,
        key: tuple[str, str],
        client: ArenaOpenAPIClient,
        http: Any,
        gateway_key: str,
        registration_timeout: float,
        probe_interval: float,
    ) -> _SessionRoute:
        suffix = secrets.token_hex(8)
        model_name = f"stream-areal-session-{suffix}"
        try:
            gateway_url, _ = await _bounded(
                client.register_llm_proxy_async(
                    model_name,
                    key[1],
                    gateway_key,
                    f"session-{suffix}",
                    protocol="chat_completions",
                    client=http,
                    timeout=registration_timeout,
                ),
                registration_timeout,
            )
        except BaseException:
            _record(registration_success=0.0, call_success=0.0)
            # The POST may have succeeded with its response lost: delete that exact name.
            await _delete_route(client, http, model_name, registration_timeout, gateway_key)
            raise
        _record(registration_success=1.0)
        return _SessionRoute(
            key=key,
            model_name=model_name,
            deployment_id=f"session-{suffix}",
            gateway_url=gateway_url,
            upstream_url=key[1],
            gateway_key=SecretStr(reveal(gateway_key)),
            client=client,
            http=http,
            registration_timeout=registration_timeout,
            probe_interval=probe_interval,
            last_probe_at=time.monotonic(),
        )

    async def _ensure_live(self, route: _SessionRoute) -> None:
        """Probe the route if the interval elapsed; restore it if Arena dropped it (lock held)."""
        if time.monotonic() - route.last_probe_at < route.probe_interval:
            if route.known_missing:
                raise ArenaAPIError(
                    f"Arena route {route.model_name} is missing and restore retries are "
                    f"throttled for {route.probe_interval:g}s"
                )
            return
        timeout = route.registration_timeout
        try:
            present = await _bounded(
                route.client.llm_proxy_exists_async(
                    route.model_name, client=route.http, timeout=timeout
                ),
                timeout,
            )
        except Exception as e:
            route.last_probe_at = time.monotonic()  # throttle from the probe's completion
            _record(registration_probe_success=0.0)
            logger.warning(
                "probe of Arena route %s failed: %s",
                route.model_name,
                _describe(e, route.gateway_key),
            )
            if route.known_missing:
                raise ArenaAPIError(
                    f"Arena route {route.model_name} remains unavailable (probe failed)"
                ) from e
            return  # advisory: only an explicit 404 marks the route missing
        route.last_probe_at = time.monotonic()
        _record(registration_probe_success=1.0, registration_present=float(present))
        if present:
            route.known_missing = False
            return
        route.known_missing = True
        logger.warning("Arena route %s was garbage-collected; restoring it", route.model_name)
        await self._restore(route)

    async def _restore(self, route: _SessionRoute) -> None:
        timeout = route.registration_timeout
        try:
            await _bounded(
                route.client.register_llm_proxy_async(
                    route.model_name,
                    route.upstream_url,
                    route.gateway_key,
                    route.deployment_id,
                    protocol="chat_completions",
                    client=route.http,
                    timeout=timeout,
                ),
                timeout,
            )
        except asyncio.CancelledError:
            route.last_probe_at = time.monotonic()
            _record(registration_restore_success=0.0)
            raise
        except Exception as error:
            try:  # the POST may have landed although it failed here
                present = await _bounded(
                    route.client.llm_proxy_exists_async(
                        route.model_name, client=route.http, timeout=timeout
                    ),
                    timeout,
                )
            except Exception:
                present = False
            if not present:
                route.last_probe_at = time.monotonic()
                _record(registration_restore_success=0.0)
                raise error
        route.known_missing = False
        route.last_probe_at = time.monotonic()
        _record(registration_restore_success=1.0)

    async def _probe_while_active(self, route: _SessionRoute) -> None:
        try:
            while True:
                await asyncio.sleep(route.probe_interval)
                async with self._lock:
                    if self._closed or self._routes.get(route.key) is not route:
                        return
                    if route.users <= 0:
                        return
                    try:
                        await self._ensure_live(route)
                    except Exception as e:
                        logger.warning(
                            "background check of Arena route %s failed: %s",
                            route.model_name,
                            _describe(e, route.gateway_key),
                        )
        except asyncio.CancelledError:
            return

    async def release(self, route: _SessionRoute) -> None:
        removed = None
        async with self._lock:
            if self._routes.get(route.key) is not route or route.users <= 0:
                logger.error("Arena route %s released more often than acquired", route.model_name)
                _record(cleanup_success=0.0)
                return
            route.users -= 1
            probe = None
            if route.users == 0:
                probe, route.probe_task = route.probe_task, None
                if not self.persistent:
                    removed = self._routes.pop(route.key)
        if probe is not None:
            probe.cancel()
            await asyncio.gather(probe, return_exceptions=True)
        if removed is not None:
            await _delete_route(
                removed.client,
                removed.http,
                removed.model_name,
                removed.registration_timeout,
                removed.gateway_key,
            )

    def close(self) -> None:
        """Delete every route (blocking); safe from any thread, idempotent."""
        if self._closed:
            return
        self._closed = True
        routes, self._routes = list(self._routes.values()), {}
        for route in routes:
            task, route.probe_task = route.probe_task, None
            if task is None or task.done():
                continue
            try:
                loop = task.get_loop()
                if loop.is_running():
                    loop.call_soon_threadsafe(task.cancel)
                elif not loop.is_closed():
                    task.cancel()
            except Exception as e:
                logger.warning("could not cancel the probe of %s: %s", route.model_name, e)
        for route in routes:
            try:
                route.client.delete_llm_proxy(route.model_name)
            except Exception as e:
                logger.warning(
                    "could not delete Arena route %s at shutdown: %s",
                    route.model_name,
                    _describe(e, route.gateway_key),
                )


async def _delete_route(
    client: ArenaOpenAPIClient,
    http: Any,
    model_name: str,
    timeout: float,
    *secret_values: str | None,
) -> None:
    """Best-effort, bounded DELETE of a route; records ``arena/cleanup_success``."""
    try:
        await _bounded(
            client.delete_llm_proxy_async(model_name, client=http, timeout=timeout), timeout
        )
    except Exception as e:
        _record(cleanup_success=0.0)
        logger.warning(
            "could not delete Arena route %s: %s", model_name, _describe(e, *secret_values)
        )
    else:
        _record(cleanup_success=1.0)


# --- the agent ---


@dataclass
class _Episode:
    """Task-local state a run leaves for the proxy's hooks (export, audit, metrics)."""

    session_id: str | None = None
    result: ArenaTaskResult | None = None
    dumped: bool = False


@dataclass
class _Launch:
    """What one run needs to launch its task (filled in by the route mode)."""

    data: Mapping[str, Any]
    stream: ArenaStreamConfig
    stream_id: str
    data_id: str
    protocol: str
    proxy_url: str
    api_key: str
    session_id: str
    http: Any
    episode: _Episode
    model_name: str = ""
    deployment_id: str = ""
    url: str = ""
    key: str = ""
    envs: dict[str, str] = field(default_factory=dict)
    credentials: tuple[str, ...] = ()  # the session key, gateway key and session token

    def secrets(self) -> tuple[str, ...]:
        """Every secret this run knows, for masking log text."""
        return (*self.credentials, reveal(self.key))


class ArenaStreamAgentWorkflow:
    """Runs one Arena task per rollout and returns its (transformed) score.

    Hosted by :class:`areal.proxy.workflow.OpenAIProxyWorkflow`; ``run`` takes the keyword
    arguments of :class:`areal.proxy.hooks.AgentRunKwargs` and the other public methods
    are the optional :class:`areal.proxy.hooks.AgentHooks`.

    Args:
        econfig: the ``econfig`` block (a mapping or ``SWEEnvConfig``).
        gen_args: sampling arguments, attached to each proxy session as metadata.
        timeout: seconds one episode may take, used when ``econfig`` has no ``timeout``.
        reject_terminal_task_failures: switch to the stricter failure attribution (only
            a recognized ``HARNESS_FAILED`` result trains as a zero reward).
        arena_client: a ready client (tests inject fake transports through it); by
            default one is built from ``econfig`` and the environment.
    """

    def __init__(
        self,
        econfig: Any = None,
        gen_args: Mapping[str, Any] | None = None,
        timeout: float = 3600.0,
        reject_terminal_task_failures: bool = False,
        *,
        arena_client: ArenaOpenAPIClient | None = None,
    ):
        self.gen_args = dict(gen_args or {})
        self.timeout = self._positive("timeout", _setting(econfig, "timeout", timeout))
        self.registration_timeout = self._positive(
            "arena_registration_timeout", _setting(econfig, "arena_registration_timeout", 180.0)
        )
        self.registration_probe_interval = self._positive(
            "arena_registration_probe_interval",
            _setting(econfig, "arena_registration_probe_interval", 60.0),
        )
        self.request_timeout = self._positive(
            "arena_request_timeout", _setting(econfig, "arena_request_timeout", 60.0)
        )
        mode = _setting(econfig, "arena_llm_route_mode", "") or "gateway"
        self.route_mode = str(mode).strip()
        if self.route_mode not in ROUTE_MODES:
            raise ValueError(
                f"econfig.arena_llm_route_mode must be one of {', '.join(ROUTE_MODES)}, "
                f"got {mode!r}"
            )
        self.reject_terminal_task_failures = bool(reject_terminal_task_failures)

        streams = load_arena_stream_configs(econfig)
        self.streams = {stream.name: stream for stream in streams}
        self.default_stream_name = streams[0].name if len(streams) == 1 else None
        self._transforms = {
            s.name: _import_transform(s.reward_transform_fn)
            for s in streams
            if s.reward_transform_fn
        }

        self.result_dump_dir = _text(_setting(econfig, "arena_result_dump_dir", ""))
        max_bytes = _setting(econfig, "arena_result_dump_max_bytes", 1_000_000)
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(
                f"econfig.arena_result_dump_max_bytes must be an integer > 0, got {max_bytes!r}"
            )
        self.result_dump_max_bytes = max_bytes
        self._dump_lock = asyncio.Lock()

        self._episode: contextvars.ContextVar[_Episode | None] = contextvars.ContextVar(
            f"arena_episode_{id(self)}", default=None
        )
        self._session_registry = _SessionGatewayRegistry(persistent=False)
        self.client = arena_client or ArenaOpenAPIClient(
            base_url=_text(_setting(econfig, "arena_base_url", "")),
            timeout=self.timeout,
            poll_interval=float(_setting(econfig, "arena_poll_interval", 5.0)),
            request_retries=int(_setting(econfig, "arena_request_retries", 3)),
        )

    @staticmethod
    def _positive(name: str, value: Any) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"econfig.{name} must be a number of seconds, got {value!r}") from None
        if not (math.isfinite(number) and number > 0):
            raise ValueError(f"econfig.{name} must be finite and positive, got {value!r}")
        return number

    # --- run ---

    async def run(self, data: Mapping[str, Any], **kwargs: Any) -> float:
        """Launch one Arena task for ``data`` and return its reward (see the module doc)."""
        session_id = _text(kwargs.get("session_id"))
        episode = _Episode(session_id=session_id or None)
        self._episode.set(episode)
        credentials = tuple(
            reveal(kwargs.get(name))
            for name in ("api_key", "proxy_gateway_api_key", "proxy_session_token")
        )
        try:
            return await self._run(data, kwargs, session_id, episode, credentials)
        except BaseException as error:
            _scrub(error, *credentials)
            raise

    async def _run(
        self,
        data: Mapping[str, Any],
        kwargs: dict[str, Any],
        session_id: str,
        episode: _Episode,
        credentials: tuple[str, ...],
    ) -> float:
        stream = self._stream_for(data)
        row_stream_id = _text(data.get("stream_id"))
        if row_stream_id and stream.stream_id and row_stream_id != stream.stream_id:
            raise ValueError(
                f"row Stream mismatch: the row names stream_id {row_stream_id!r} but Stream "
                f"{stream.name!r} is {stream.stream_id!r}"
            )
        if "llm_protocol" in data:
            protocol = _text(data.get("llm_protocol"))
        else:
            protocol = stream.llm_protocol or "chat_completions"
        api_key, gateway_key, session_token = credentials
        launch = _Launch(
            data=data,
            stream=stream,
            stream_id=row_stream_id or stream.stream_id,
            data_id=_text(data.get("data_id")),
            protocol=protocol,
            proxy_url=_text(kwargs.get("base_url")).rstrip("/"),
            api_key=api_key,
            session_id=session_id,
            http=kwargs.get("arena_http_client") or kwargs.get("http_client"),
            episode=episode,
            credentials=credentials,
        )
        for name, value in (
            ("stream_id", launch.stream_id),
            ("data_id", launch.data_id),
            ("base_url", launch.proxy_url),
            ("api_key", launch.api_key),
        ):
            if not value:
                raise ValueError(f"{name} is required for ArenaStreamAgentWorkflow")
        if self.route_mode in ("direct", "session_gateway") and not SESSION_ID_RE.fullmatch(
            session_id
        ):
            raise ValueError(
                f"a valid session_id is required for route mode {self.route_mode!r} (1-200 "
                "characters: a letter or digit, then letters, digits, '_', '.', ':' or '-')"
            )
        if self.route_mode == "session_gateway" and not (gateway_key and session_token):
            raise ValueError(
                "route mode 'session_gateway' requires proxy_gateway_api_key and "
                "proxy_session_token from the proxy workflow"
            )
        self._check_row(data, stream, protocol)
        if stream.expected_reward_ref.key:
            await self._check_live_reward_ref(launch)

        launch.model_name = f"stream-areal-{secrets.token_hex(6)}"
        launch.deployment_id = str(uuid.uuid4())
        launch.url, launch.key = launch.proxy_url, launch.api_key
        launch.envs = dict(stream.task_envs)
        if self.route_mode == "gateway":
            return await self._run_gateway(launch)
        if self.route_mode == "session_gateway":
            return await self._run_session_gateway(
                launch, kwargs.get("worker_runtime"), gateway_key, session_token
            )
        return await self._run_direct(launch)

    def _stream_for(self, data: Mapping[str, Any]) -> ArenaStreamConfig:
        name = _text(data.get("arena_stream_name")) or self.default_stream_name
        if not name:
            raise ValueError("arena_stream_name is required for a multi-Stream run")
        stream = self.streams.get(name)
        if stream is None:
            raise ValueError(
                f"unknown Arena Stream {name!r}; configured: {', '.join(sorted(self.streams))}"
            )
        return stream

    @staticmethod
    def _check_row(data: Mapping[str, Any], stream: ArenaStreamConfig, protocol: str) -> None:
        pin = stream.expected_reward_ref
        if pin.key:
            row_ref = (_text(data.get("reward_ref_key")), _text(data.get("reward_ref_version")))
            if row_ref != (pin.key, pin.version):
                raise ValueError(
                    f"reward_ref mismatch for Stream {stream.name!r}: the row has "
                    f"{row_ref[0]}@{row_ref[1]}, the Stream pins {pin.key}@{pin.version}"
                )
        if protocol not in LLM_PROTOCOLS:
            raise ValueError(
                f"unsupported Arena LLM protocol {protocol!r} in the row; use one of "
                f"{', '.join(LLM_PROTOCOLS)}"
            )
        if stream.llm_protocol and protocol != stream.llm_protocol:
            raise ValueError(
                f"LLM protocol mismatch: the row has {protocol!r}, Stream {stream.name!r} is "
                f"configured with {stream.llm_protocol!r}"
            )

    async def _check_live_reward_ref(self, launch: _Launch) -> None:
        """Refuse to launch when the Stream's live grader differs from the pinned one."""
        pin = launch.stream.expected_reward_ref
        try:
            live = await _bounded(
                self.client.resolve_stream_async(
                    launch.stream_id, client=launch.http, timeout=self.request_timeout
                ),
                self.request_timeout,
            )
            ref = live.get("default_reward_ref")
            if not isinstance(ref, Mapping):
                raise ArenaAPIError(f"Arena Stream {launch.stream_id} has no default_reward_ref")
            actual = (ref.get("key"), ref.get("version"))
            if actual != (pin.key, pin.version):
                raise ArenaAPIError(
                    f"Arena Stream {launch.stream_id} reward_ref drifted before launch: "
                    f"expected {pin.key}@{pin.version}, got {actual[0]}@{actual[1]}"
                )
        except BaseException:
            _record(reward_ref_validation_success=0.0)
            raise
        _record(reward_ref_validation_success=1.0)

    # --- route modes ---

    async def _run_gateway(self, launch: _Launch) -> float:
        renewal = None
        try:  # from the first attempt on: a POST may land although its response is lost
            try:
                gateway_url, model_name = await self._register_gateway_route(launch)
            except BaseException:
                _record(registration_success=0.0, call_success=0.0)
                raise
            _record(registration_success=1.0)
            launch.url, launch.model_name = gateway_url, model_name
            launch.key = self.client.llm_gateway_api_key
            renewal = asyncio.create_task(self._renew_gateway_route(launch))
            return await self._launch_and_score(launch)
        finally:
            if renewal is not None:  # stopped first, so it cannot resurrect a deleted route
                renewal.cancel()
                await asyncio.gather(renewal, return_exceptions=True)
            await _delete_route(
                self.client,
                launch.http,
                launch.model_name,
                self.registration_timeout,
                *launch.secrets(),
            )

    async def _register_gateway_route(self, launch: _Launch) -> tuple[str, str]:
        return await _bounded(
            self.client.register_llm_proxy_async(
                launch.model_name,
                launch.proxy_url,
                launch.api_key,
                launch.deployment_id,
                protocol=launch.protocol,
                client=launch.http,
                timeout=self.registration_timeout,
            ),
            self.registration_timeout,
        )

    async def _renew_gateway_route(self, launch: _Launch) -> None:
        """Keep the rollout's route alive; re-register it (same name) if Arena dropped it."""
        while True:
            await asyncio.sleep(self.registration_probe_interval)
            try:
                present = await _bounded(
                    self.client.renew_llm_proxy_async(
                        launch.model_name, client=launch.http, timeout=self.registration_timeout
                    ),
                    self.registration_timeout,
                )
                if not present:
                    logger.warning("Arena route %s vanished; re-registering it", launch.model_name)
                    await self._register_gateway_route(launch)
            except Exception as e:
                _record(registration_renew_success=0.0)
                logger.warning(
                    "renewal of Arena route %s failed: %s",
                    launch.model_name,
                    _describe(e, *launch.secrets()),
                )
            else:
                _record(registration_renew_success=1.0)

    async def _run_session_gateway(
        self, launch: _Launch, runtime: Any, gateway_key: str, session_token: str
    ) -> float:
        launch.key = self.client.llm_gateway_api_key
        registry = self._session_registry_for(runtime)
        route = await registry.acquire(
            self.client,
            launch.http,
            launch.proxy_url,
            gateway_key,
            self.registration_timeout,
            self.registration_probe_interval,
        )
        try:
            launch.url, launch.model_name = route.gateway_url, route.model_name
            headers = [f"X-Session-Id: {launch.session_id}", f"X-Session-Token: {session_token}"]
            existing = launch.envs.get("ANTHROPIC_CUSTOM_HEADERS", "").strip()
            launch.envs["ANTHROPIC_CUSTOM_HEADERS"] = "\n".join(
                [existing, *headers] if existing else headers
            )
            _record(session_gateway_route=1.0)
            return await self._launch_and_score(launch)
        finally:
            await registry.release(route)

    def _session_registry_for(self, runtime: Any) -> _SessionGatewayRegistry:
        if runtime is None:
            return self._session_registry
        register = getattr(runtime, "register_destroy_callback", None)
        if not callable(register):
            raise TypeError(
                f"worker_runtime {type(runtime).__name__} has no callable "
                "register_destroy_callback(key, fn)"
            )
        registry = getattr(runtime, SESSION_REGISTRY_ATTR, None)
        if registry is None:
            registry = _SessionGatewayRegistry(persistent=True)
            setattr(runtime, SESSION_REGISTRY_ATTR, registry)
        elif not isinstance(registry, _SessionGatewayRegistry):
            raise TypeError(
                f"worker_runtime.{SESSION_REGISTRY_ATTR} holds a {type(registry).__name__}, "
                "not an Arena session-gateway registry"
            )
        register(SESSION_REGISTRY_CALLBACK_KEY, registry.close)
        return registry

    async def _run_direct(self, launch: _Launch) -> float:
        host = urlsplit(launch.proxy_url).hostname
        if not host:
            raise ValueError(f"the proxy base_url {launch.proxy_url!r} has no host name")
        configured = launch.envs.get("NO_PROXY") or launch.envs.get("no_proxy") or ""
        hosts = [h.strip() for h in configured.split(",") if h.strip()]
        if host not in hosts:
            hosts.append(host)
        no_proxy = ",".join(hosts)
        launch.envs.update(
            ANTHROPIC_BASE_URL=launch.proxy_url,
            OPENAI_BASE_URL=launch.proxy_url,
            ANTHROPIC_API_KEY=launch.api_key,
            OPENAI_API_KEY=launch.api_key,
            NO_PROXY=no_proxy,
            no_proxy=no_proxy,
        )
        _record(direct_route=1.0)
        return await self._launch_and_score(launch)

    # --- launch, wait, score ---

    async def _launch_and_score(self, launch: _Launch) -> float:
        accepted: list[str | None] = []  # the Arena task id, once Arena accepted the task

        def on_launch_success(task_id: str | None) -> None:
            if not accepted:
                accepted.append(task_id)
                _record(launch_success=1.0)

        def record_unfinished() -> None:
            _record(**({"terminal_success": 0.0} if accepted else {"launch_success": 0.0}))
            _record(call_success=0.0)

        try:
            async with asyncio.timeout(self.timeout) as deadline:
                outcome = await self.client.launch_one_task_result(
                    launch.stream_id,
                    launch.data_id,
                    model_name=launch.model_name,
                    proxy_base_url=launch.url,
                    proxy_api_key=launch.key,
                    session_id=launch.session_id,
                    harness=launch.stream.harness,
                    task_envs=launch.envs,
                    client=launch.http,
                    on_launch_success=on_launch_success,
                )
        except ArenaTaskFailedError as error:
            _record(terminal_success=0.0, call_success=0.0)
            launch.episode.result = error.result
            await self._attach_harness_receipt(error, launch.http)
            raise
        except asyncio.CancelledError:
            if accepted:
                _record(terminal_success=0.0)
            _record(call_success=0.0)
            task_id = accepted[0] if accepted else None
            if task_id:
                await self._dump_local_status(launch, task_id, "LOCAL_WAIT_CANCELLED")
            logger.warning(
                "rollout cancelled while waiting for Arena task %s (data %s); the task keeps "
                "running in Arena",
                task_id or "unknown",
                launch.data_id,
            )
            raise
        except TimeoutError as error:
            record_unfinished()
            if not deadline.expired():
                raise
            task_id = accepted[0] if accepted else None
            if task_id:
                await self._dump_local_status(launch, task_id, "LOCAL_WAIT_TIMEOUT")
            message = (
                f"Arena task {task_id or 'unknown'} for data {launch.data_id} did not finish "
                f"within the episode timeout of {self.timeout:g}s"
            )
            logger.warning(message)
            raise TimeoutError(message) from error
        except Exception:
            record_unfinished()
            raise

        result = self._as_task_result(outcome, accepted)
        _record(terminal_success=1.0)
        launch.episode.result = result
        try:
            score = result.score
            if score is None or not math.isfinite(score):
                raise ArenaAPIError(
                    f"Arena task {result.task_id} is {result.status} without a finite "
                    "top-level 'score'"
                )
            reward = self._transform_reward(score, launch.data, launch.stream)
        except Exception:
            _record(result_processing_success=0.0, call_success=0.0)
            await self._dump(launch.data, launch.episode, result, training_score=None)
            raise
        _record(result_processing_success=1.0, call_success=1.0)
        return reward

    @staticmethod
    def _as_task_result(outcome: Any, accepted: list[str | None]) -> ArenaTaskResult:
        if isinstance(outcome, ArenaTaskResult):
            return outcome
        if isinstance(outcome, (int, float)) and not isinstance(outcome, bool):
            task_id = (accepted[0] if accepted else None) or "legacy-result"
            return ArenaTaskResult(task_id=task_id, status="DONE", score=float(outcome))
        raise ArenaAPIError(
            f"Arena launch returned {type(outcome).__name__}, not a task result or a number"
        )

    async def _attach_harness_receipt(self, error: ArenaTaskFailedError, http: Any) -> None:
        """Fetch the Harness receipt of a native-runner failure (when the client can)."""
        raw = _failure_raw(error)
        if normalize_status(error.status) != "HARNESS_FAILED" or not isinstance(raw, Mapping):
            return
        if _result_families(raw, _raw_error_text(raw)) != {"native-runner"}:
            return
        fetch = getattr(self.client, "get_harness_result_async", None)
        if fetch is None:  # the receipt endpoint is not part of this client yet
            return
        timeout = min(self.request_timeout, RECEIPT_FETCH_TIMEOUT)
        try:
            error.harness_result = await _bounded(
                fetch(error.task_id, client=http, timeout=timeout), timeout
            )
        except Exception as e:
            logger.warning(
                "could not fetch the Harness receipt of task %s: %s", error.task_id, _describe(e)
            )

    # --- rewards ---

    def _transform_reward(
        self,
        reward: float,
        data: Mapping[str, Any],
        stream_config: ArenaStreamConfig | None = None,
    ) -> float:
        """The training reward of a score: the Stream's transform, else its threshold."""
        stream = stream_config or self._stream_for(data)
        transform = self._transforms.get(stream.name)
        if transform is not None:
            extra = {}
            if stream.reward_threshold is not None:
                extra["reward_threshold"] = stream.reward_threshold
            value = float(transform(reward, data, **extra))
            if not math.isfinite(value):
                raise ValueError(
                    f"reward transform {stream.reward_transform_fn} returned a non-finite "
                    f"reward {value!r}"
                )
            return value
        if stream.reward_threshold is not None:
            return 1.0 if reward >= stream.reward_threshold else 0.0
        return float(reward)

    def _is_solved_reward(self, reward: float | None, stream: ArenaStreamConfig | None) -> bool:
        """Whether a training reward counts as solved for pass@k (``None`` never does)."""
        if reward is None:
            return False
        threshold = stream.reward_threshold if stream is not None else None
        if stream is not None and stream.name in self._transforms and threshold is not None:
            return reward >= threshold
        return reward > 0

    def _stream_or_none(self, data: Mapping[str, Any]) -> ArenaStreamConfig | None:
        name = _text(data.get("arena_stream_name")) or self.default_stream_name
        return self.streams.get(name) if name else None

    # --- hooks called by the proxy workflow ---

    def classify_proxy_failure(
        self, error: BaseException, *, context_overflow: bool, interaction_count: int
    ) -> FailureDisposition:
        """``model_failure_zero`` (train with reward 0) or a reject disposition.

        Baseline rules unless the workflow was built with ``reject_terminal_task_failures``,
        which selects the stricter attribution (only a recognized ``HARNESS_FAILED``).
        """
        rules = _strict_disposition if self.reject_terminal_task_failures else _baseline_disposition
        return rules(error, context_overflow, interaction_count)

    def should_reject_failed_sample(
        self, error: BaseException, disposition: FailureDisposition
    ) -> bool:
        """With ``reject_terminal_task_failures``: drop only this failed group member."""
        if not self.reject_terminal_task_failures or not isinstance(error, ArenaTaskFailedError):
            return False
        status = normalize_status(error.status)
        if status == "EVAL_FAILED":
            return disposition == "system_failure_reject"
        if status in ("HARNESS_FAILED", "NO_OUTPUT", "TIMEOUT"):
            return disposition == "unknown_failure_reject"
        return False

    async def record_failure_disposition(
        self, data: Mapping[str, Any], error: BaseException, disposition: FailureDisposition
    ) -> None:
        episode = self._current_episode()
        result = getattr(error, "result", None)
        if isinstance(result, ArenaTaskResult):
            episode.result = result
        if disposition == "model_failure_zero":
            return  # the final reward (0.0) is audited by persist_episode_result
        if episode.result is not None and not episode.dumped:
            await self._dump(data, episode, episode.result, training_score=None)

    async def persist_episode_result(self, data: Mapping[str, Any], reward: float | None) -> None:
        episode = self._current_episode()
        if episode.result is not None and not episode.dumped:
            await self._dump(data, episode, episode.result, training_score=reward)

    def record_episode_metrics(self, data: Mapping[str, Any], reward: float) -> None:
        """Per-episode metrics after a successful export (``run`` records no reward)."""
        episode = self._current_episode()
        try:
            self._record_episode_metrics(data, reward, episode.result)
        finally:
            episode.result, episode.dumped = None, False

    def _record_episode_metrics(
        self, data: Mapping[str, Any], reward: float, result: ArenaTaskResult | None
    ) -> None:
        task_type = _task_type(data)
        stream = self._stream_or_none(data)
        values: dict[str, float] = {"training_score": reward}
        if stream is not None:
            values[f"stream/{stream.name}/training_score"] = reward
        if result is not None and result.score is not None:
            score = result.score
            values.update(
                {
                    "arena_score": score,
                    "raw_reward": score,
                    f"{task_type}/raw_reward": score,
                    f"domain/{task_type}/raw_reward": score,
                    "arena_raw_present": float(result.raw is not None),
                    "arena_trace_present": float(bool(result.trace_id)),
                    "arena_artifacts_present": float(bool(result.artifacts_uri)),
                }
            )
            if stream is not None:
                values[f"stream/{stream.name}/arena_score"] = score
            data_id = _text(data.get("data_id"))
            if data_id:
                stats_tracker.get("rollout").scalar(**{f"debug/task/{data_id}/raw_reward": score})
        if result is not None:
            status = normalize_status(result.status)
            values["harness_success"] = float(status in SUCCESS_TASK_STATUSES)
            values["harness_error"] = float(status == "HARNESS_FAILED")
            if status == "HARNESS_FAILED":
                bucket = _outcome_bucket(harness_outcome_code(result.raw))
                for code in (*sorted(HARNESS_OUTCOME_METRIC_CODES), "OTHER"):
                    values[f"harness_error/{code}"] = float(code == bucket)
        values[f"{task_type}/reward"] = reward
        values[f"domain/{task_type}/reward"] = reward
        _record_scoped(values)

    def record_group_metrics(
        self, data: Mapping[str, Any], rewards: list[float | None], group_size: int
    ) -> None:
        """pass@k and the group's pass-count distribution, globally, per domain and Stream."""
        if len(rewards) != group_size:
            raise ValueError(f"got {len(rewards)} rewards for a group of {group_size}")
        task_type = _task_type(data)
        stream = self._stream_or_none(data)
        passed = sum(1 for reward in rewards if self._is_solved_reward(reward, stream))
        prefixes = ["", f"domain/{task_type}/"]
        if stream is not None:
            prefixes.append(f"stream/{stream.name}/")
        values = {f"{task_type}/pass@k": float(passed > 0)}
        for prefix in prefixes:
            values[f"{prefix}pass@k"] = float(passed > 0)
            values[f"{prefix}all_correct"] = float(passed == group_size)
            values[f"{prefix}all_wrong"] = float(passed == 0)
            for count in range(group_size + 1):
                values[f"{prefix}group_pass_count_{count}_ratio"] = float(count == passed)
        for count in range(group_size + 1):
            values[f"group_pass_{count}"] = float(count == passed)
        _record_scoped(values)

    def get_session_metadata(self, data: Mapping[str, Any]) -> dict[str, Any]:
        return {"generation_args": dict(self.gen_args)} if self.gen_args else {}

    def get_episode_metadata(self) -> dict[str, Any]:
        """Identity of the episode's Arena task, attached to every exported interaction."""
        episode = self._episode.get()
        if episode is None:
            return {}
        identity = self._identity(episode, episode.result)
        metadata = {}
        if episode.session_id is not None:
            metadata["session_id"] = episode.session_id
        if episode.result is not None:
            metadata["arena_task_id"] = identity["arena_task_id"]
            metadata["arena_status"] = episode.result.status
            if episode.result.status == "HARNESS_FAILED":
                metadata["harness_outcome_code"] = identity["harness_outcome_code"]
        return metadata

    def get_episode_reward_for_export(
        self, data: Mapping[str, Any], reward: float | None, *, export_style: str
    ) -> float | None:
        """The terminal reward for every concat segment of a successful episode, else None."""
        result = self._current_episode().result
        if export_style != "concat" or result is None:
            return None
        if result.status not in SUCCESS_TASK_STATUSES:
            return None
        if reward is None or not math.isfinite(reward):
            return None
        return float(reward)

    def get_failure_reward_for_export(
        self, data: Mapping[str, Any], *, export_style: str
    ) -> float | None:
        return 0.0 if export_style == "concat" else None

    def _current_episode(self) -> _Episode:
        episode = self._episode.get()
        if episode is None:
            episode = _Episode()
            self._episode.set(episode)
        return episode

    # --- audit ---

    @staticmethod
    def _identity(episode: _Episode, result: ArenaTaskResult | None) -> dict[str, Any]:
        """The identity fields shared by audit records and episode metadata."""
        failed = result is not None and result.status == "HARNESS_FAILED"
        return {
            "arena_task_id": result.task_id if result is not None else None,
            "session_id": episode.session_id,
            "harness_outcome_code": harness_outcome_code(result.raw) if failed else None,
        }

    async def _dump_local_status(self, launch: _Launch, task_id: str, status: str) -> None:
        result = ArenaTaskResult(task_id=task_id, status=status)
        await self._dump(launch.data, launch.episode, result, training_score=None)

    async def _dump(
        self,
        data: Mapping[str, Any],
        episode: _Episode,
        result: ArenaTaskResult,
        *,
        training_score: float | None,
    ) -> None:
        """Append one audit record (at most one per episode); never raises."""
        episode.dumped = True
        if not self.result_dump_dir:
            return
        try:
            stream = self._stream_for(data)
            pin = stream.expected_reward_ref
            record: dict[str, Any] = {
                "arena_stream_name": stream.name,
                "stream_id": _text(data.get("stream_id")) or stream.stream_id,
                "data_id": _text(data.get("data_id")),
                "task_id": result.task_id,
                "status": result.status,
                "expected_reward_ref": {"key": pin.key, "version": pin.version},
                "arena_score": result.score,
                "training_score": training_score,
                "raw": None,
                "raw_present": False,
                "raw_size_bytes": 0,
                "raw_truncated": False,
                "artifacts_uri": result.artifacts_uri,
                "trace_id": result.trace_id,
                "computed_at": result.computed_at,
                **self._identity(episode, result),
            }
            async with self._dump_lock:
                await asyncio.to_thread(self._write_record, record, result.raw)
        except Exception as e:
            _record(result_dump_success=0.0)
            logger.warning("could not write the Arena audit record of %s: %s", result.task_id, e)
        else:
            _record(result_dump_success=1.0)

    def _write_record(self, record: dict[str, Any], raw: Any) -> None:
        line = _audit_line(record, raw, self.result_dump_max_bytes)
        _append_private_line(self.result_dump_dir, _shard_name(), line)


def _import_transform(path: str) -> Callable[..., float]:
    """``package.module.attribute`` -> the attribute (import errors propagate)."""
    module_name, _, attribute = path.rpartition(".")
    if not module_name or not attribute:
        raise ValueError(f"reward_transform_fn {path!r} must be a dotted 'module.function' path")
    return getattr(importlib.import_module(module_name), attribute)
