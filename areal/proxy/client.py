"""Client of the proxy's session endpoints, used by rollout workflows.

Starting a session is retried until it succeeds on transient statuses (408, 429, 502,
503, 504) and connection errors; ending one up to 10 times; exporting once (it waits for
the session to finish, so it has no client timeout; the proxy bounds that wait).
"""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import httpx
import numpy as np
import torch

from areal.proxy.interaction import ExportedInteraction
from areal.utils import logging
from areal.utils.secrets import reveal

__all__ = ["OpenAIProxyClient", "ProxyError", "deserialize_interactions"]

logger = logging.getLogger("proxy.client")
TRANSIENT = frozenset({408, 429, 502, 503, 504})
ATTEMPT_TIMEOUT = 10.0


class ProxyError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"proxy answered HTTP {status}: {message}")
        self.status = status


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

    def __init__(self, base_url: str, admin_api_key: str, http_client: httpx.AsyncClient):
        self.base_url = base_url.rstrip("/")
        self._admin = reveal(admin_api_key)
        self.http = http_client

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
        delay = 0.5
        attempt = 0
        while True:
            attempt += 1
            try:
                return await self._post(path, body, key, ATTEMPT_TIMEOUT)
            except ProxyError as e:
                if e.status not in TRANSIENT or (attempts is not None and attempt >= attempts):
                    raise
                failure: Exception = e
            except (httpx.TransportError, TimeoutError) as e:
                if attempts is not None and attempt >= attempts:
                    raise
                failure = e
            logger.info("%s failed (%s); retrying in %.1fs", path, type(failure).__name__, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

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
