"""Arena LLM routes of the agent: the shared session-gateway route and per-rollout renewal.

In ``session_gateway`` mode one route per rollout worker (kept in a registry on the
worker runtime) serves every run; in ``gateway`` mode each rollout registers its own
route and a renewal loop keeps it alive through long generation pauses.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from areal.proxy.keys import same_secret
from areal.utils import logging
from areal.utils.secrets import SecretStr, reveal
from examples.swe.arena_agent_common import bounded, describe_error
from examples.swe.arena_client import ArenaOpenAPIClient
from examples.swe.arena_metrics import record_arena_scalars
from examples.swe.arena_results import ArenaAPIError

__all__ = [
    "SESSION_REGISTRY_ATTR",
    "SESSION_REGISTRY_CALLBACK_KEY",
    "SessionGatewayRegistry",
    "delete_route",
    "renew_gateway_route",
    "worker_session_registry",
]

logger = logging.getLogger("arena.agent")

SESSION_REGISTRY_ATTR = "_arena_session_gateway_registry_v1"
SESSION_REGISTRY_CALLBACK_KEY = "arena-session-gateway-registrations"


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

    async def exists(self) -> bool:
        """Whether Arena still has this route (one bounded GET)."""
        timeout = self.registration_timeout
        return await bounded(
            self.client.llm_proxy_exists_async(self.model_name, client=self.http, timeout=timeout),
            timeout,
        )


class SessionGatewayRegistry:
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

    @property
    def _targets(self) -> dict[tuple[str, str], _SessionRoute]:
        """The routes by (Arena base, proxy base): the same dict as ``_routes``, under the
        name the reference registry uses."""
        return self._routes

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
            gateway_url, _ = await bounded(
                client.register_llm_proxy_async(
                    model_name=model_name,
                    upstream_base_url=key[1],
                    upstream_api_key=gateway_key,
                    deployment_id=f"session-{suffix}",
                    protocol="chat_completions",
                    client=http,
                    timeout=registration_timeout,
                ),
                registration_timeout,
            )
        except BaseException:
            record_arena_scalars(registration_success=0.0, call_success=0.0)
            # The POST may have succeeded with its response lost: delete that exact name.
            await delete_route(client, http, model_name, registration_timeout, gateway_key)
            raise
        record_arena_scalars(registration_success=1.0)
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
        try:
            present = await route.exists()
        except Exception as e:
            route.last_probe_at = time.monotonic()  # throttle from the probe's completion
            record_arena_scalars(registration_probe_success=0.0)
            logger.warning(
                "probe of Arena route %s failed: %s",
                route.model_name,
                describe_error(e, route.gateway_key),
            )
            if route.known_missing:
                raise ArenaAPIError(
                    f"Arena route {route.model_name} remains unavailable (probe failed)"
                ) from e
            return  # advisory: only an explicit 404 marks the route missing
        route.last_probe_at = time.monotonic()
        record_arena_scalars(registration_probe_success=1.0, registration_present=float(present))
        if present:
            route.known_missing = False
            return
        route.known_missing = True
        logger.warning("Arena route %s was garbage-collected; restoring it", route.model_name)
        await self._restore(route)

    async def _restore(self, route: _SessionRoute) -> None:
        timeout = route.registration_timeout
        try:
            await bounded(
                route.client.register_llm_proxy_async(
                    model_name=route.model_name,
                    upstream_base_url=route.upstream_url,
                    upstream_api_key=route.gateway_key,
                    deployment_id=route.deployment_id,
                    protocol="chat_completions",
                    client=route.http,
                    timeout=timeout,
                ),
                timeout,
            )
        except asyncio.CancelledError:
            route.last_probe_at = time.monotonic()
            record_arena_scalars(registration_restore_success=0.0)
            raise
        except Exception as error:
            try:  # the POST may have landed although it failed here
                present = await route.exists()
            except Exception:
                present = False
            if not present:
                route.last_probe_at = time.monotonic()
                record_arena_scalars(registration_restore_success=0.0)
                raise error
        route.known_missing = False
        route.last_probe_at = time.monotonic()
        record_arena_scalars(registration_restore_success=1.0)

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
                            describe_error(e, route.gateway_key),
                        )
        except asyncio.CancelledError:
            return

    async def release(self, route: _SessionRoute) -> None:
        removed = None
        async with self._lock:
            if self._routes.get(route.key) is not route or route.users <= 0:
                logger.error("Arena route %s released more often than acquired", route.model_name)
                record_arena_scalars(cleanup_success=0.0)
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
            await delete_route(
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
                    describe_error(e, route.gateway_key),
                )


def worker_session_registry(runtime: Any) -> SessionGatewayRegistry:
    """The persistent registry of a rollout worker, created on first use.

    Its :meth:`SessionGatewayRegistry.close` is registered as the worker's destroy
    callback, so the shared route is deleted when the worker shuts down.
    """
    register = getattr(runtime, "register_destroy_callback", None)
    if not callable(register):
        raise TypeError(
            f"worker_runtime {type(runtime).__name__} has no callable "
            "register_destroy_callback(key, fn)"
        )
    registry = getattr(runtime, SESSION_REGISTRY_ATTR, None)
    if registry is None:
        registry = SessionGatewayRegistry(persistent=True)
        setattr(runtime, SESSION_REGISTRY_ATTR, registry)
    elif not isinstance(registry, SessionGatewayRegistry):
        raise TypeError(
            f"worker_runtime.{SESSION_REGISTRY_ATTR} holds a {type(registry).__name__}, "
            "not an Arena session-gateway registry"
        )
    register(SESSION_REGISTRY_CALLBACK_KEY, registry.close)
    return registry


# --- route deletion (both registering modes) and per-rollout renewal ---


async def delete_route(
    client: ArenaOpenAPIClient,
    http: Any,
    model_name: str,
    timeout: float,
    *secret_values: str | None,
) -> None:
    """Best-effort, bounded DELETE of a route; records ``arena/cleanup_success``."""
    try:
        await bounded(
            client.delete_llm_proxy_async(model_name, client=http, timeout=timeout),
            timeout,
        )
    except Exception as e:
        record_arena_scalars(cleanup_success=0.0)
        logger.warning(
            "could not delete Arena route %s: %s", model_name, describe_error(e, *secret_values)
        )
    else:
        record_arena_scalars(cleanup_success=1.0)


async def renew_gateway_route(
    model_name: str,
    *,
    client: ArenaOpenAPIClient,
    http: Any,
    reregister: Callable[[], Awaitable[object]],
    interval: float,
    timeout: float,
    secret_values: tuple[str, ...],
) -> None:
    """Keep a rollout's route alive; ``reregister`` it (same name) if Arena dropped it.

    Runs until cancelled: every ``interval`` seconds it renews the route, recording
    ``arena/registration_renew_success``; failures are logged and retried next round.
    """
    while True:
        await asyncio.sleep(interval)
        try:
            present = await bounded(
                client.renew_llm_proxy_async(model_name, client=http, timeout=timeout),
                timeout,
            )
            if not present:
                logger.warning("Arena route %s vanished; re-registering it", model_name)
                await reregister()
        except Exception as e:
            record_arena_scalars(registration_renew_success=0.0)
            logger.warning(
                "renewal of Arena route %s failed: %s",
                model_name,
                describe_error(e, *secret_values),
            )
        else:
            record_arena_scalars(registration_renew_success=1.0)
