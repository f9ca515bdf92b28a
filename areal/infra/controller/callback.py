"""Train ranks' view of the rollout side, and the controller's callback server.

Train ranks run in worker processes and cannot reach the rollout workers' engines
directly; :class:`RolloutCallback` (what ``connect_engine`` hands them) posts each
request to the controller, whose :class:`CallbackServer` forwards it to every rollout
worker. Rollout workers also report finished tasks here (``rollout_complete``).

Both directions are signed with the experiment's RPC token as
:mod:`areal.infra.rpc.auth` describes (the token never travels): the server admits
only signed requests (401 otherwise), caps bodies at ``CALLBACK_MAX_BODY_BYTES``
(64 MiB, 413 beyond) and signs its answers; :class:`RolloutCallback` signs its requests
and refuses answers that do not verify. Another client (the workflow executor's
completion report) signs with :func:`areal.infra.rpc.auth.signed_headers`.

Weight-update calls return futures: the NCCL group and the disk load both need the
trainer to act (join, broadcast, publish the checkpoint) while the rollout side waits.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from areal.api.io_struct import ParamSpec, WeightUpdateMeta
from areal.api.scheduler_api import RPC_TOKEN_ENV
from areal.infra.rpc.auth import RequestSigner, SignatureError
from areal.infra.rpc.guard import SignedRequestGuard
from areal.infra.rpc.serialization import deserialize_value, json_dumps, serialize_value

__all__ = ["CallbackServer", "RolloutCallback"]

CALLBACK_TIMEOUT = 7200.0
CALLBACK_MAX_BODY_BYTES = 64 * 1024 * 1024  # weight-update metadata and parameter specs
_pool = concurrent.futures.ThreadPoolExecutor(max_workers=4, thread_name_prefix="rollout-callback")


@dataclass
class RolloutCallback:
    """A rollout "engine" for train ranks: every call goes through the controller."""

    controller_addr: str
    experiment_name: str = ""
    trial_name: str = ""

    @property
    def config(self) -> SimpleNamespace:
        return SimpleNamespace(experiment_name=self.experiment_name, trial_name=self.trial_name)

    def _post(self, path: str, **payload: Any) -> Any:
        token = os.environ.get(RPC_TOKEN_ENV, "")
        if not token:
            raise RuntimeError(f"callback {path}: ${RPC_TOKEN_ENV} is empty; cannot sign")
        try:
            response = httpx.post(
                f"http://{self.controller_addr}/callback/{path}",
                content=json_dumps(serialize_value(payload)),
                headers={"content-type": "application/json"},
                auth=RequestSigner(token),
                timeout=CALLBACK_TIMEOUT,
            )
        except SignatureError as e:
            raise RuntimeError(
                f"callback {path}: {self.controller_addr} is not this run's controller: {e}"
            ) from None
        if response.status_code >= 300:
            raise RuntimeError(
                f"callback {path}: HTTP {response.status_code}: {response.text[:500]}"
            )
        return deserialize_value(response.json())

    def pause_generation(self) -> None:
        self._post("pause_generation")

    def continue_generation(self) -> None:
        self._post("continue_generation")

    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> concurrent.futures.Future:
        return _pool.submit(self._post, "update_weights_disk", meta=meta)

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> concurrent.futures.Future:
        return _pool.submit(self._post, "init_weights_group", meta=meta)

    def update_weights_from_distributed(
        self, meta: WeightUpdateMeta, param_specs: list[ParamSpec]
    ) -> concurrent.futures.Future:
        return _pool.submit(self._post, "update_weights_xccl", meta=meta, param_specs=param_specs)


class CallbackServer:
    """The controller's HTTP endpoint for train ranks and rollout workers.

    ``handlers`` maps an action (``pause_generation``, ``continue_generation``,
    ``update_weights_disk``, ``init_weights_group``, ``update_weights_xccl``,
    ``rollout_complete``) to a function of the decoded payload; handlers run in the
    server's thread pool, so a long weight update does not delay completion reports.
    """

    def __init__(
        self,
        handlers: dict[str, Callable[..., Any]],
        token: str,
        *,
        max_body_bytes: int = CALLBACK_MAX_BODY_BYTES,
    ):
        self.handlers = handlers
        api = FastAPI(openapi_url=None, docs_url=None)
        api.add_api_route("/callback/{action}", self._handle, methods=["POST"])
        self.app = SignedRequestGuard(api, token, max_body_bytes=max_body_bytes)

    async def _handle(self, action: str, request: Request) -> JSONResponse:
        handler = self.handlers.get(action)
        if handler is None:
            return JSONResponse({"error": f"no callback {action!r}"}, status_code=404)
        raw = await request.body()
        try:
            payload = deserialize_value(orjson.loads(raw)) if raw else {}
            result = await run_in_threadpool(handler, **payload)
        except Exception as e:
            return JSONResponse({"error": f"{type(e).__name__}: {e}"}, status_code=500)
        return JSONResponse(serialize_value(result))
