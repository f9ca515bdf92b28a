"""The local Arena server: the OpenAPI routes the client uses, the LLM gateway, tasks.

Routes (all under ``/openapi/v1`` need ``Authorization: Bearer <token>``: 401 without a
token, 403 with a wrong one):

=======  ===============================================  ==================================
E1 GET   ``/streams?status=ACTIVE``                       ``{"items": [...], "total": n}``
E2 GET   ``/streams/{stream_id}``                         the Stream (wrapped: ``data.stream``)
E3 POST  ``/streams/{stream_id}/dataset?limit&offset``    one page of ``data_ids`` and items
E4 POST  ``/llm/models``                                  register a route (201; 200 replaced)
E5 GET   ``/llm/models/{model_name}``                     the route (404 when absent)
E6 DEL   ``/llm/models/{model_name}``                     204 (404 when absent)
E7 POST  ``/streams/{stream_id}/launch_one_task``         ``{"task_id", "status": "PENDING"}``
E8 GET   ``/tasks/{task_id}/result``                      the result envelope
E9 GET   ``/harnesses/{key}/versions/{version}``          the Harness version and its status
E10 GET  ``/streams/{stream_id}/tasks?limit&offset``      recent tasks, newest first
E11 PATCH ``/llm/models/{model_name}``                    renew a route (404 when absent)
=======  ===============================================  ==================================

Local additions: ``GET/PUT /openapi/v1/local/faults`` (fault settings, see
:mod:`.faults`), ``POST /openapi/v1/local/routes/expire`` (garbage-collect every route
now), ``GET /health`` (no auth). The LLM gateway lives at ``/api`` (:mod:`.gateway`);
request bodies are read and JSON answers written by :mod:`.http_io`.

``envelope="wrapped"`` answers E2, E5, E7-E10 inside ``{"data": ...}`` (E2 as
``data.stream``, E10 as ``data.items``), as some Arena deployments do; ``"plain"``
answers the bare objects (E10 as a ``data`` list). The client accepts both.

Limits: a request body over ``max_body_bytes`` (default 16 MiB, ``--max-body-bytes``) is
answered 413 before it is read whole, whether it declares a ``Content-Length`` or is
chunked, and one that stalls ``body_timeout`` seconds between two parts (default 60,
``--body-timeout``) gets 408; the process entry point also closes connections whose
request headers take longer than ``--header-timeout`` seconds, and those whose request
was answered before its body arrived whole (see :mod:`.limits`). Keys in launch and
route bodies are stripped of surrounding whitespace. When the server stops, running tasks
are cancelled and their child processes killed, and requests held by an injected latency
or a slow upstream are answered 503 at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response

from areal.proxy.keys import same_secret
from areal.utils import logging
from areal.utils.http_limits import BodyLimitMiddleware
from examples.swe.local_arena.faults import SPANNER_MARKER, WAITING_PAGE, FaultConfig
from examples.swe.local_arena.gateway import LLMGateway
from examples.swe.local_arena.http_io import (
    HTTPError,
    LaunchBody,
    RouteRegistration,
    error_response,
    json_response,
    page_args,
    read_model,
    read_object,
    stopping_response,
)
from examples.swe.local_arena.limits import LIMITS, limit_error
from examples.swe.local_arena.store import Route, Store
from examples.swe.local_arena.tasks import Launch, TaskRunner
from examples.swe.local_arena.types import Catalog, Ref

__all__ = ["LocalArena", "LocalArenaConfig", "create_app"]

logger = logging.getLogger("local_arena.server")

ENVELOPES = ("plain", "wrapped")
ROUTE_PREFIX = "stream-areal-"
DEFAULT_MAX_BODY_BYTES = LIMITS.max_body_bytes
DEFAULT_BODY_TIMEOUT_S = LIMITS.body_timeout
BODY_BYTES_RANGE = (1024, 1024**3)
MAX_TASK_TIMEOUT_S = 86_400.0
MAX_CONCURRENT_TASKS = 1024


@dataclass
class LocalArenaConfig:
    db: Path
    catalog: Catalog
    token: str
    llm_api_keys: tuple[str, ...] = ()  # keys the gateway accepts besides the token
    artifacts: Path | None = None  # default: next to the database
    task_timeout: float = 600.0  # seconds per task, in (0, 86400]
    max_concurrent_tasks: int = 64  # in [1, 1024]
    faults: FaultConfig = field(default_factory=FaultConfig)
    envelope: str = "plain"
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get 413
    body_timeout: float = DEFAULT_BODY_TIMEOUT_S  # seconds a body may stall; 408 after

    def __post_init__(self) -> None:
        self.token = self.token.strip()
        self.llm_api_keys = tuple(k.strip() for k in self.llm_api_keys if k.strip())
        if not self.token:
            raise ValueError("the local Arena needs a non-empty API token")
        if self.envelope not in ENVELOPES:
            raise ValueError(f"envelope must be one of {ENVELOPES}, got {self.envelope!r}")
        timeout = self.task_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)):
            raise ValueError(f"task_timeout (--task-timeout) must be a number, got {timeout!r}")
        if not (math.isfinite(timeout) and 0 < timeout <= MAX_TASK_TIMEOUT_S):
            raise ValueError(
                f"task_timeout (--task-timeout) must be in (0, {MAX_TASK_TIMEOUT_S:g}] "
                f"seconds, got {timeout:g}"
            )
        _check_int(
            "max_concurrent_tasks (--max-concurrent-tasks)",
            self.max_concurrent_tasks,
            1,
            MAX_CONCURRENT_TASKS,
        )
        _check_int("max_body_bytes (--max-body-bytes)", self.max_body_bytes, *BODY_BYTES_RANGE)
        gap = self.body_timeout
        if isinstance(gap, bool) or not isinstance(gap, (int, float)) or not gap > 0:
            raise ValueError(f"body_timeout (--body-timeout) must be positive, got {gap!r}")
        if not math.isfinite(gap):
            raise ValueError(f"body_timeout (--body-timeout) must be finite, got {gap!r}")


def _check_int(what: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{what} must be an integer in [{low}, {high}], got {value!r}")


class LocalArena:
    """The server state: catalog, store, task runner, gateway and fault settings."""

    def __init__(self, config: LocalArenaConfig):
        self.config = config
        self.catalog = config.catalog
        self.faults = config.faults
        self.store = Store.open(config.db)
        artifacts = config.artifacts or config.db.with_name(config.db.name + ".artifacts")
        self.runner = TaskRunner(
            self.store,
            artifacts,
            lambda: self.faults,
            config.task_timeout,
            config.max_concurrent_tasks,
        )
        self.stopping = asyncio.Event()  # set when the server stops: delays end at once
        self.gateway = LLMGateway(self.store, self.accepts_llm_key, self.stopping)
        self._gc_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        logging.register_secret(config.token)
        for key in config.llm_api_keys:
            logging.register_secret(key)

    def accepts_llm_key(self, key: str) -> bool:
        return any(same_secret(key, k) for k in (self.config.token, *self.config.llm_api_keys))

    def wrap(self, payload: Any, key: str | None = None) -> Any:
        if self.config.envelope == "plain":
            return payload
        return {"data": {key: payload} if key else payload}

    # --- lifecycle ---

    @contextlib.asynccontextmanager
    async def lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        self._loop = asyncio.get_running_loop()
        await self.gateway.start()
        self._gc_task = asyncio.create_task(self._collect_routes())
        try:
            yield
        finally:
            self._begin_stop()
            self._gc_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._gc_task
            await self.runner.close()
            await self.gateway.close()
            self.store.close()

    def request_stop(self) -> None:
        """Begin stopping; safe from any thread or a signal handler (see :meth:`_begin_stop`)."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._begin_stop)

    def _begin_stop(self) -> None:
        """Cancel the running tasks (recorded as interrupted) and kill their children, then
        end every injected delay and held gateway call with a 503."""
        if not self.stopping.is_set():
            self.runner.stop()
            self.stopping.set()

    async def injected_delay(self) -> bool:
        """Sleep the injected latency; ``False`` when the server began stopping meanwhile."""
        delay = self.faults.latency_ms / 1000
        if delay > 0 and not self.stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), delay)
        return not self.stopping.is_set()

    async def _collect_routes(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            self.expire_routes()

    def expire_routes(self) -> None:
        ttl = self.faults.route_ttl_seconds
        if ttl is not None:
            for name in self.store.expire_routes(ttl):
                logger.info("route %s garbage-collected (not renewed within %gs)", name, ttl)

    # --- guard: auth and faults on /openapi/v1 ---

    async def guard(self, request: Request) -> Response | None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return error_response(401, "missing bearer token (Authorization: Bearer ...)", "auth")
        if not same_secret(token.strip(), self.config.token):
            return error_response(403, "this token may not use the Arena API", "forbidden")
        if request.url.path.startswith("/openapi/v1/local/"):
            return None  # fault settings stay reachable, undelayed, whatever the faults
        if not await self.injected_delay():
            return stopping_response()
        kind = self.faults.draw_error()
        if kind == "429":
            return error_response(429, "rate limited (injected fault)", "rate_limited")
        if kind == "500":
            return error_response(500, "internal error (injected fault)", "internal")
        if kind == "403_marker":
            return error_response(403, f"rejected by gateway: {SPANNER_MARKER}", "gateway")
        if kind == "302_fromspanner":
            return Response(status_code=302, headers={"Location": WAITING_PAGE})
        return None

    # --- streams and datasets ---

    def stream_json(self, stream_id: str) -> dict[str, Any]:
        stream = self.catalog.streams[stream_id]
        return {
            "stream_id": stream.stream_id,
            "name": stream.stream_id,
            "status": stream.status,
            "description": stream.description,
            "tags": list(stream.tags),
            "default_harness_ref": stream.default_harness.to_json(),
            "default_reward_ref": stream.default_reward.to_json(),
            "dataset_total": len(self.catalog.rows(stream_id)),
        }

    def known_stream(self, stream_id: str) -> None:
        if stream_id not in self.catalog.streams:
            raise HTTPError(404, f"no Stream {stream_id!r}", "not_found")

    def list_streams(self, request: Request) -> Response:
        wanted = request.query_params.get("status")
        items = [
            self.stream_json(sid)
            for sid, stream in self.catalog.streams.items()
            if not wanted or stream.status.upper() == wanted.strip().upper()
        ]
        return json_response({"items": items, "total": len(items)})

    def get_stream(self, stream_id: str) -> Response:
        self.known_stream(stream_id)
        return json_response(self.wrap(self.stream_json(stream_id), "stream"))

    def dataset(self, stream_id: str, request: Request) -> Response:
        self.known_stream(stream_id)
        limit, offset = page_args(request, 100)
        rows = self.catalog.rows(stream_id)
        page = rows[offset : offset + limit]
        stream_tags = list(self.catalog.streams[stream_id].tags)
        return json_response(
            {
                "total": len(rows),
                "offset": offset,
                "limit": limit,
                "count": len(page),
                "data_ids": [row.data_id for row in page],
                "items": [
                    {"data_id": row.data_id, "tags": list(dict.fromkeys([*stream_tags, *row.tags]))}
                    for row in page
                ],
            }
        )

    def harness_version(self, key: str, version: str) -> Response:
        spec = self.catalog.harness(Ref(key, version))
        if spec is None:
            raise HTTPError(404, f"no Harness {key}@{version}", "not_found")
        payload = {
            "key": key,
            "version": version,
            "status": spec.status,
            "protocol": spec.protocol,
            "kind": spec.kind,
        }
        return json_response(self.wrap(payload))

    # --- routes (E4-E6, E11) ---

    async def register_route(self, request: Request) -> Response:
        body = await read_model(request, RouteRegistration)
        if not body.model_name.startswith(ROUTE_PREFIX):
            raise HTTPError(400, f"model_name must start with {ROUTE_PREFIX!r}", "invalid_body")
        endpoint = body.endpoints[0]
        now = time.time()
        existing = self.store.get_route(body.model_name)
        created = self.store.put_route(
            Route(
                model_name=body.model_name,
                upstream_model=endpoint.upstream_model,
                base_url=endpoint.base_url.rstrip("/"),
                api_key=endpoint.api_key,
                deployment_id=endpoint.endpoint_id,
                inbound_protos=list(endpoint.inbound_protos),
                metadata=dict(body.metadata),
                enabled=body.enabled and endpoint.enabled,
                created_at=existing.created_at if existing else now,
                renewed_at=now,
            )
        )
        return json_response({"model_name": body.model_name}, 201 if created else 200)

    def get_route(self, model_name: str) -> Response:
        self.expire_routes()
        route = self.store.get_route(model_name)
        if route is None:
            raise HTTPError(404, f"no model {model_name!r}", "not_found")
        return json_response(self.wrap(route.public()))

    def delete_route(self, model_name: str) -> Response:
        if not self.store.delete_route(model_name):
            raise HTTPError(404, f"no model {model_name!r}", "not_found")
        return Response(status_code=204)

    def renew_route(self, model_name: str) -> Response:
        self.expire_routes()
        if not self.store.renew_route(model_name):
            raise HTTPError(404, f"no model {model_name!r}", "not_found")
        return json_response(self.wrap({"model_name": model_name}))

    # --- tasks (E7, E8, E10) ---

    async def launch(self, stream_id: str, request: Request) -> Response:
        if self.stopping.is_set():
            return stopping_response()
        self.known_stream(stream_id)
        body = await read_model(request, LaunchBody)
        stream = self.catalog.streams[stream_id]
        if stream.status.upper() != "ACTIVE":
            raise HTTPError(409, f"Stream {stream_id!r} is {stream.status}, not ACTIVE", "inactive")
        row = self.catalog.row(stream_id, body.data_id)
        if row is None:
            raise HTTPError(404, f"Stream {stream_id!r} has no data_id {body.data_id!r}")
        try:
            ref = Ref.parse(body.harness) if body.harness else stream.default_harness
        except ValueError as e:
            raise HTTPError(400, f"harness: {e}", "invalid_body") from None
        harness = self.catalog.harness(ref)
        if harness is None:
            raise HTTPError(404, f"no Harness {ref}", "not_found")
        if harness.status != "PUBLISHED":
            raise HTTPError(409, f"Harness {ref} is {harness.status}, not PUBLISHED", "draft")
        reward = self.catalog.rewards[stream.default_reward]
        if body.harness:  # a pinned version runs as that version, even through a `*` entry
            harness = dataclasses.replace(harness, version=ref.version)
        record = self.runner.launch(
            Launch(
                stream=stream,
                row=row,
                harness=harness,
                reward=reward,
                model_name=body.model_name,
                base_url=body.base_url,
                api_key=body.api_key,
                envs=dict(body.envs),
                session_id=body.session_id,
            )
        )
        return json_response(self.wrap(record.envelope()), 202)

    def task_result(self, task_id: str) -> Response:
        record = self.store.get_task(task_id)
        if record is None:
            raise HTTPError(404, f"no task {task_id!r}", "not_found")
        return json_response(self.wrap(record.envelope()))

    def stream_tasks(self, stream_id: str, request: Request) -> Response:
        self.known_stream(stream_id)
        limit, offset = page_args(request, 100)
        records, total = self.store.list_tasks(stream_id, limit, offset)
        rows = [record.envelope() for record in records]
        if self.config.envelope == "plain":
            return json_response({"data": rows, "total": total})
        return json_response({"data": {"items": rows, "total": total}})

    # --- local administration ---

    async def put_faults(self, request: Request) -> Response:
        data = await read_object(request)
        try:
            self.faults = FaultConfig.from_mapping(data)
        except ValueError as e:
            raise HTTPError(400, str(e), "invalid_body") from None
        return json_response(self.faults.to_json())

    def expire_all_routes(self) -> Response:
        names = [route.model_name for route in self.store.list_routes()]
        for name in names:
            self.store.delete_route(name)
        return json_response({"expired": names})


def create_app(config: LocalArenaConfig) -> FastAPI:
    arena = LocalArena(config)
    app = FastAPI(title="local Arena", lifespan=arena.lifespan, openapi_url=None, docs_url=None)
    app.state.arena = arena

    @app.middleware("http")
    async def guard(request: Request, call_next):
        if request.url.path.startswith("/openapi/v1"):
            rejection = await arena.guard(request)
            if rejection is not None:
                return rejection
        elif request.url.path.startswith("/api") and not await arena.injected_delay():
            return stopping_response()
        return await call_next(request)

    limits = dataclasses.replace(
        LIMITS, max_body_bytes=config.max_body_bytes, body_timeout=config.body_timeout
    )
    app.add_middleware(BodyLimitMiddleware, limits=limits, error_shape=limit_error)

    @app.exception_handler(HTTPError)
    async def http_error(request: Request, exc: HTTPError) -> Response:
        return error_response(exc.status, exc.message, exc.code)

    v1 = "/openapi/v1"

    @app.get("/health")
    async def health() -> Response:
        return json_response({"status": "ok", "running_tasks": len(arena.runner.running)})

    @app.get(f"{v1}/streams")
    async def list_streams(request: Request) -> Response:
        return arena.list_streams(request)

    @app.post(v1 + "/streams/{stream_id:path}/dataset")
    async def dataset(stream_id: str, request: Request) -> Response:
        return arena.dataset(stream_id, request)

    @app.post(v1 + "/streams/{stream_id:path}/launch_one_task")
    async def launch(stream_id: str, request: Request) -> Response:
        return await arena.launch(stream_id, request)

    @app.get(v1 + "/streams/{stream_id:path}/tasks")
    async def stream_tasks(stream_id: str, request: Request) -> Response:
        return arena.stream_tasks(stream_id, request)

    @app.get(v1 + "/streams/{stream_id:path}")
    async def get_stream(stream_id: str) -> Response:
        return arena.get_stream(stream_id)

    @app.get(v1 + "/harnesses/{key:path}/versions/{version}")
    async def harness_version(key: str, version: str) -> Response:
        return arena.harness_version(key, version)

    @app.post(f"{v1}/llm/models")
    async def register_route(request: Request) -> Response:
        return await arena.register_route(request)

    @app.get(v1 + "/llm/models/{model_name:path}")
    async def get_route(model_name: str) -> Response:
        return arena.get_route(model_name)

    @app.delete(v1 + "/llm/models/{model_name:path}")
    async def delete_route(model_name: str) -> Response:
        return arena.delete_route(model_name)

    @app.patch(v1 + "/llm/models/{model_name:path}")
    async def renew_route(model_name: str) -> Response:
        return arena.renew_route(model_name)

    @app.get(v1 + "/tasks/{task_id:path}/result")
    async def task_result(task_id: str) -> Response:
        return arena.task_result(task_id)

    @app.get(f"{v1}/local/faults")
    async def get_faults() -> Response:
        return json_response(arena.faults.to_json())

    @app.put(f"{v1}/local/faults")
    async def put_faults(request: Request) -> Response:
        return await arena.put_faults(request)

    @app.post(f"{v1}/local/routes/expire")
    async def expire_routes() -> Response:
        return arena.expire_all_routes()

    # --- the LLM gateway ---

    @app.api_route("/api", methods=["GET", "HEAD"])
    @app.api_route("/api/", methods=["GET", "HEAD"])
    async def gateway_root() -> Response:
        return json_response({"status": "ok"})

    @app.get("/api/v1/models")
    async def gateway_models() -> Response:
        return json_response(arena.gateway.models())

    for path, protocol in (
        ("/api/v1/chat/completions", "chat_completions"),
        ("/api/chat/completions", "chat_completions"),
        ("/api/v1/responses", "responses"),
        ("/api/responses", "responses"),
        ("/api/v1/messages", "anthropic"),
    ):
        app.add_api_route(path, _gateway_endpoint(arena, protocol), methods=["POST"])

    return app


def _gateway_endpoint(arena: LocalArena, protocol: str):
    async def endpoint(request: Request) -> Response:
        return await arena.gateway.handle(protocol, request)

    return endpoint


def new_token() -> str:
    return "la-" + secrets.token_urlsafe(32)
