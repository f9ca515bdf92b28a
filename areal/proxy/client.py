"""Client of the proxy's session endpoints, used by rollout workflows.

Starting a session is retried until it succeeds on transient statuses (408, 429, 502,
503, 504), connection errors and timeouts, waiting 0.5, 1, 2, 4, 5, 5, ... seconds
between attempts (:data:`SESSION_RETRY`); ending one is tried up to 10 times; exporting
once (it waits for the session to finish, so it has no client timeout; the proxy bounds
that wait).
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import numpy as np
import torch

from areal.proxy.interaction import ExportedInteraction
from areal.utils import logging
from areal.utils.retry import RetryPolicy
from areal.utils.secrets import reveal

__all__ = ["OpenAIProxyClient", "ProxyError", "deserialize_interactions", "is_transient"]

logger = logging.getLogger("proxy.client")
TRANSIENT = frozenset({408, 429, 502, 503, 504})
ATTEMPT_TIMEOUT = 10.0
SESSION_RETRY = RetryPolicy(attempts=None, first_delay=0.5, multiplier=2.0, max_delay=5.0)
"""Waits of 0.5, 1, 2, 4, 5, 5, ... seconds; each call sets its own number of attempts."""


class ProxyError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"proxy answered HTTP {status}: {message}")
        self.status = status


def is_transient(error: BaseException) -> bool:
    """A connection failure, a timeout or a transient status: worth another attempt."""
    if isinstance(error, ProxyError):
        return error.status in TRANSIENT
    return isinstance(error, (httpx.TransportError, TimeoutError))


def deserialize_interactions(items: list[dict]) -> dict[str, ExportedInteraction]:
    out: dict[str, ExportedInteraction] = {}
    for item in items:
        tensors = {}
        for key, spec in item["tensors"].items():
            dtype = getattr(torch, spec["dtype"])
            array = np.frombuffer(
                base64.b64decode(spec["data"]), dtype=torch.empty(0, dtype=dtype).numpy().dtype
            )
            tensors[key] = torch.from_numpy(array.copy()).reshape(spec["shape"])
        out[item["id"]] = ExportedInteraction(
            id=item["id"],
            reward=item.get("reward"),
            tensors=tensors,
            metadata=item.get("metadata", {}),
        )
    return out


class OpenAIProxyClient:
    """Session management against one proxy (``base_url`` like ``http://host:port``)."""

    def __init__(
        self,
        base_url: str,
        admin_api_key: str,
        http_client: httpx.AsyncClient,
        *,
        sleep: Callable[[float], Awaitable[None]] | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self._admin = reveal(admin_api_key)
        self.http = http_client
        self._sleep = sleep  # between retries; None: asyncio.sleep (tests pass a recorder)

    def _auth(self, key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {reveal(key)}"}

    async def _post(self, path: str, body: dict, key: str, timeout: float | None) -> dict[str, Any]:
        response = await self.http.post(
            f"{self.base_url}{path}", json=body, headers=self._auth(key), timeout=timeout
        )
        if response.status_code >= 300:
            try:
                message = response.json().get("error", {}).get("message", response.text)
            except ValueError:
                message = response.text
            raise ProxyError(response.status_code, str(message)[:500])
        return response.json()

    async def _retrying(
        self, path: str, body: dict, key: str, attempts: int | None
    ) -> dict[str, Any]:
        def log_retry(attempt: int, delay: float, error: BaseException | None) -> None:
            logger.info("%s failed (%s); retrying in %.1fs", path, type(error).__name__, delay)

        return await dataclasses.replace(SESSION_RETRY, attempts=attempts).acall(
            lambda: self._post(path, body, key, ATTEMPT_TIMEOUT),
            retry_on_exception=is_transient,
            on_retry=log_retry,
            sleep=self._sleep,
        )

    async def grant_capacity(self) -> int:
        return (await self._post("/grant_capacity", {}, self._admin, ATTEMPT_TIMEOUT))["capacity"]

    async def start_session(
        self, task_id: str, api_key: str | None = None, metadata: dict[str, Any] | None = None
    ) -> tuple[str, str]:
        """``(session_id, session_key)``; retried until admitted."""
        body = {"task_id": task_id, "api_key": api_key, "metadata": metadata or {}}
        result = await self._retrying("/rl/start_session", body, self._admin, attempts=None)
        return result["session_id"], result["api_key"]

    async def end_session(self, session_key: str) -> dict[str, Any]:
        """Diagnostics: ``interaction_count``, ``context_overflow``, ``system_error``."""
        return await self._retrying("/rl/end_session", {}, session_key, attempts=10)

    async def set_reward(
        self, session_key: str, reward: float, interaction_id: str | None = None
    ) -> None:
        body = {"interaction_id": interaction_id, "reward": float(reward)}
        await self._post("/rl/set_reward", body, session_key, ATTEMPT_TIMEOUT)

    async def export(
        self,
        session_id: str,
        discount: float = 1.0,
        style: str = "individual",
        drop_retry_orphans: bool = False,
        last_reward: float | None = None,
    ) -> dict[str, ExportedInteraction]:
        """The session's interactions; ``last_reward`` first overrides the last one's reward.

        The session must have been ended (the proxy refuses rewards from its key after
        that, so a reward decided afterwards travels with the export).
        """
        body = {
            "session_id": session_id,
            "discount": discount,
            "style": style,
            "drop_retry_orphans": drop_retry_orphans,
            "last_reward": last_reward,
        }
        result = await self._post("/export_trajectories", body, self._admin, timeout=None)
        return deserialize_interactions(result["interactions"])
