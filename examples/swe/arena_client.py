"""Client for the Arena OpenAPI: Streams, datasets, LLM routes and tasks.

Every call carries ``Authorization: Bearer $ARENA_OPENAPI_TOKEN`` and follows the retry
policy of :mod:`examples.swe.arena_http`. Each operation has a blocking and an ``_async``
form built from the same flow; both reuse one pooled HTTP client per client object (per
event loop for async), unless the caller passes its own ``client``. The task launch and
its polling are written in :mod:`examples.swe.arena_task_flows`, and the LLM protocol
helpers in :mod:`examples.swe.arena_protocols` (re-exported here).

Endpoints (under the base URL):

====  ======  ================================================  ==========================
E1    GET     /openapi/v1/streams?status=ACTIVE                 :meth:`list_streams`
E2    GET     /openapi/v1/streams/{stream_id}                   :meth:`resolve_stream`
E3    POST    /openapi/v1/streams/{stream_id}/dataset           :meth:`get_all_dataset_rows`
E4    POST    /openapi/v1/llm/models                            :meth:`register_llm_proxy`
E5    GET     /openapi/v1/llm/models/{model_name}               :meth:`llm_proxy_exists_async`
E6    DELETE  /openapi/v1/llm/models/{model_name}               :meth:`delete_llm_proxy`
E7    POST    /openapi/v1/streams/{stream_id}/launch_one_task   :meth:`launch_one_task_result`
E8    GET     /openapi/v1/tasks/{task_id}/result                (polling)
E9    GET     /openapi/v1/harnesses/{key}/versions/{version}    :meth:`get_harness_version`
E10   GET     /openapi/v1/streams/{stream_id}/tasks             :meth:`list_stream_tasks`
E11   PATCH   /openapi/v1/llm/models/{model_name}               :meth:`renew_llm_proxy_async`
====  ======  ================================================  ==========================
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import httpx

from areal.utils.secrets import SecretStr, redact_url, refuse_printed_form, reveal
from examples.swe.arena_dataset import DatasetPages, dataset_total, plan_pages
from examples.swe.arena_http import ArenaRequest, ArenaTransport, Flow, check_http_url, encode_path
from examples.swe.arena_protocols import (
    LLM_PROTOCOLS,
    LLMProtocol,
    infer_llm_protocol,
    infer_llm_protocol_from_harness,
    resolve_llm_protocol,
)
from examples.swe.arena_results import (
    FAILED_TASK_STATUSES,
    ArenaAPIError,
    ArenaTaskFailedError,
    ArenaTaskResult,
    _arena_task_type_from_tags,
    _parse_task_result,
)
from examples.swe.arena_task_flows import MANAGED_TASK_ENVS, launch_body, launch_task_flow

# The protocol helpers and result types are re-exported: callers import them from here.
__all__ = [
    "LLM_PROTOCOLS",
    "MANAGED_TASK_ENVS",
    "ArenaAPIError",
    "ArenaOpenAPIClient",
    "ArenaTaskFailedError",
    "ArenaTaskResult",
    "LLMProtocol",
    "_arena_task_type_from_tags",
    "_parse_task_result",
    "infer_llm_protocol",
    "infer_llm_protocol_from_harness",
    "resolve_arena_credentials",
    "resolve_llm_protocol",
]

MODEL_NAME_PREFIX = "stream-areal-"
REGISTRY_TIMEOUT = 180.0
API = "/openapi/v1"


# --- credentials ---


def resolve_arena_credentials(base_url: str = "", api_token: str = "") -> tuple[str, str]:
    """``(base URL without trailing '/', token)`` from the arguments or the environment.

    The token is stripped of surrounding whitespace (a token file's trailing newline would
    otherwise break the ``Authorization`` header and escape redaction).
    """
    base = (base_url or os.environ.get("ARENA_OPENAPI_BASE", "")).strip()
    token = (reveal(api_token) or os.environ.get("ARENA_OPENAPI_TOKEN", "")).strip()
    refuse_printed_form(token, "the Arena token (ARENA_OPENAPI_TOKEN)")
    if not base:
        raise ValueError(
            "Arena base URL is not set: set econfig.arena_base_url or ARENA_OPENAPI_BASE"
        )
    if not token:
        raise ValueError("ARENA_OPENAPI_TOKEN is required for Arena OpenAPI calls")
    return base.rstrip("/"), token


def _check_model_name(model_name: str) -> None:
    if not isinstance(model_name, str) or not model_name.startswith(MODEL_NAME_PREFIX):
        raise ValueError(f"Arena route model_name must start with {MODEL_NAME_PREFIX!r}")


def _object(payload: Any, what: str) -> dict[str, Any]:
    if not isinstance(payload, dict):
        raise ArenaAPIError(f"{what} must be a JSON object")
    return payload


def _unwrap_data(payload: Any, what: str) -> Any:
    return _object(payload, what).get("data", payload)


# The default waits between retries and polls look ``time`` and ``asyncio`` up on this
# module at each call, so patching ``arena_client.time`` / ``arena_client.asyncio`` in a
# test takes effect on clients that already exist.


def _sleep(seconds: float) -> None:
    time.sleep(seconds)


async def _async_sleep(seconds: float) -> None:
    await asyncio.sleep(seconds)


class ArenaOpenAPIClient:
    """Arena control-plane client (see the module docstring for the endpoints)."""

    MAX_DATASET_LIMIT = 1000
    FAILED_TASK_STATUSES = FAILED_TASK_STATUSES

    def __init__(
        self,
        base_url: str = "",
        api_token: str = "",
        llm_api_key: str = "",
        timeout: float = 60.0,
        poll_interval: float = 5.0,
        request_retries: int = 3,
        *,
        max_connections: int = 100,
        transport: httpx.BaseTransport | None = None,
        async_transport: httpx.AsyncBaseTransport | None = None,
        sleep: Callable[[float], None] | None = None,
        async_sleep: Callable[[float], Awaitable[None]] | None = None,
    ):
        base, token = resolve_arena_credentials(base_url, api_token)
        self.base_url = base
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.request_retries = request_retries
        self._llm_api_key = SecretStr(  # stripped, like the token
            reveal(llm_api_key) or os.environ.get("ARENA_LLM_API_KEY", "")
        )
        refuse_printed_form(self._llm_api_key, "the Arena LLM key (ARENA_LLM_API_KEY)")
        check_http_url(base, "Arena base URL", "econfig.arena_base_url (or ARENA_OPENAPI_BASE)")
        override = os.environ.get("ARENA_LLM_BASE_URL", "").strip().rstrip("/")
        if override:
            check_http_url(override, "Arena LLM base URL", "ARENA_LLM_BASE_URL")
            self.llm_gateway_base_url = override
        else:
            self.llm_gateway_base_url = f"{base}/api"
        self._http = ArenaTransport(
            base,
            token,
            retries=request_retries,
            timeout=timeout,
            max_connections=max_connections,
            transport=transport,
            async_transport=async_transport,
            sleep=sleep or _sleep,
            async_sleep=async_sleep or _async_sleep,
            secrets=(self._llm_api_key,),
        )

    def __repr__(self) -> str:
        return f"ArenaOpenAPIClient(base_url={redact_url(self.base_url)!r})"

    @property
    def llm_gateway_api_key(self) -> str:
        """The key Harnesses present to Arena's LLM gateway (``ARENA_LLM_API_KEY``)."""
        if not self._llm_api_key:
            raise ValueError("ARENA_LLM_API_KEY is required for Arena LLM gateway routes")
        return self._llm_api_key

    def close(self) -> None:
        self._http.close()

    async def aclose(self) -> None:
        await self._http.aclose()

    def __enter__(self) -> ArenaOpenAPIClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> ArenaOpenAPIClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    # --- E1, E2: Streams ---

    def _list_streams_flow(self, status: str | None, timeout: float | None) -> Flow[list[dict]]:
        request = ArenaRequest(
            "GET", f"{API}/streams", params={"status": status} if status else None, timeout=timeout
        )
        payload = self._http.read_json((yield request), request)
        items = payload.get("items") if isinstance(payload, dict) else None
        if not isinstance(items, list):
            raise ArenaAPIError("Arena Stream list response is missing an 'items' array")
        return [dict(item) for item in items if isinstance(item, dict)]

    def list_streams(self, status: str | None = "ACTIVE", *, client: httpx.Client | None = None):
        return self._http.run(self._list_streams_flow(status, None), client)

    async def list_streams_async(
        self,
        status: str | None = "ACTIVE",
        *,
        client: httpx.AsyncClient | None = None,
        timeout: float | None = None,
    ) -> list[dict]:
        return await self._http.arun(self._list_streams_flow(status, timeout), client)

    def _resolve_stream_flow(self, stream_id: str, timeout: float | None) -> Flow[dict]:
        if not stream_id:
            streams = yield from self._list_streams_flow("ACTIVE", timeout)
            if not streams:
                raise ArenaAPIError("Arena has no active Streams")
            return streams[0]
        request = ArenaRequest("GET", f"{API}/streams/{encode_path(stream_id)}", timeout=timeout)
        payload = _unwrap_data(self._http.read_json((yield request), request), "Stream response")
        payload = _object(payload, "Stream response data")
        stream = _object(payload.get("stream", payload), "Stream object")
        if stream.get("stream_id") != stream_id:
            raise ArenaAPIError(
                f"Arena returned id {stream.get('stream_id')!r} for Stream {stream_id!r}"
            )
        status = stream.get("status")
        if status is not None and status != "ACTIVE":
            raise ArenaAPIError(f"Arena Stream {stream_id!r} is not ACTIVE (status {status!r})")
        return dict(stream)

    def resolve_stream(self, stream_id: str = "", *, client: httpx.Client | None = None) -> dict:
        """The Stream ``stream_id`` (must be ACTIVE), or the first ACTIVE Stream if empty."""
        return self._http.run(self._resolve_stream_flow(stream_id, None), client)

    async def resolve_stream_async(
        self,
        stream_id: str = "",
        *,
        client: httpx.AsyncClient | None = None,
        timeout: float | None = None,
    ) -> dict:
        return await self._http.arun(self._resolve_stream_flow(stream_id, timeout), client)

    def resolve_stream_id(self, stream_id: str = "", *, client: httpx.Client | None = None) -> str:
        resolved = self.resolve_stream(stream_id, client=client).get("stream_id")
        if not isinstance(resolved, str) or not resolved:
            raise ArenaAPIError("Arena Stream has no stream_id")
        return resolved

    # --- E3: dataset rows ---

    def _dataset_request(self, stream_id: str, limit: int, offset: int) -> ArenaRequest:
        return ArenaRequest(
            "POST",
            f"{API}/streams/{encode_path(stream_id)}/dataset",
            params={"limit": str(limit), "offset": str(offset)},
        )

    def _dataset_flow(self, stream_id: str, llm_protocol: str, batch: int) -> Flow[list[dict]]:
        probe_request = self._dataset_request(stream_id, 1, 0)
        probe = self._http.read_json((yield probe_request), probe_request)
        pages = DatasetPages(stream_id, dataset_total(probe, stream_id))
        plan = plan_pages(pages.total, self.MAX_DATASET_LIMIT)
        if pages.total == 1:  # the probe already is the only page
            pages.add(probe, *plan[0])
            return pages.rows(llm_protocol)
        for start in range(0, len(plan), batch):
            chunk = plan[start : start + batch]
            requests = [self._dataset_request(stream_id, *page) for page in chunk]
            responses = yield requests
            for (limit, offset), request, response in zip(chunk, requests, responses):
                pages.add(self._http.read_json(response, request), limit, offset)
        return pages.rows(llm_protocol)

    def get_all_dataset_rows(
        self,
        stream_id: str,
        llm_protocol: str = "chat_completions",
        *,
        client: httpx.Client | None = None,
    ) -> list[dict]:
        """Every row of a Stream's dataset, in Arena's order, paged 1000 ids at a time."""
        return self._http.run(self._dataset_flow(stream_id, llm_protocol, batch=1), client)

    async def get_all_dataset_rows_async(
        self,
        stream_id: str,
        llm_protocol: str = "chat_completions",
        *,
        client: httpx.AsyncClient | None = None,
        concurrency: int = 8,
    ) -> list[dict]:
        """As :meth:`get_all_dataset_rows`, fetching ``concurrency`` pages at a time."""
        flow = self._dataset_flow(stream_id, llm_protocol, batch=max(1, concurrency))
        return await self._http.arun(flow, client)

    # --- E4, E5, E6, E11: LLM routes ---

    def _register_flow(
        self,
        model_name: str,
        upstream_base_url: str,
        upstream_api_key: str,
        deployment_id: str,
        protocol: str,
        timeout: float | None,
    ) -> Flow[tuple[str, str]]:
        _check_model_name(model_name)
        if not upstream_base_url or not reveal(upstream_api_key).strip():
            raise ValueError("an Arena route needs a non-empty upstream base URL and API key")
        check_http_url(upstream_base_url, "proxy base URL", "the Arena route's upstream")
        if protocol not in LLM_PROTOCOLS:
            raise ValueError(f"unsupported Arena LLM protocol {protocol!r}")
        body = {
            "model_name": model_name,
            "endpoints": [
                {
                    "endpoint_id": deployment_id,
                    "upstream_model": model_name,
                    "base_url": upstream_base_url.rstrip("/"),
                    "api_key": reveal(upstream_api_key).strip(),
                    # Arena converts Messages/Responses traffic to Chat for the upstream.
                    "inbound_protos": ["chat"],
                    "enabled": True,
                }
            ],
            "enabled": True,
            "metadata": {"deployment_id": deployment_id},
        }
        request = ArenaRequest("POST", f"{API}/llm/models", json=body, timeout=timeout)
        payload = self._http.read_json((yield request), request)
        returned = payload.get("model_name") if isinstance(payload, dict) else None
        if not isinstance(returned, str) or not returned:
            raise ArenaAPIError("Arena route registration response is missing model_name")
        if returned != model_name:
            raise ArenaAPIError(
                f"Arena route registration returned an unexpected model_name {returned!r}"
            )
        return self.llm_gateway_base_url, model_name

    def register_llm_proxy(
        self,
        model_name: str,
        upstream_base_url: str,
        upstream_api_key: str,
        *,
        deployment_id: str | None = None,
        protocol: str = "chat_completions",
        client: httpx.Client | None = None,
    ) -> tuple[str, str]:
        """Register an LLM route to ``upstream_base_url``; returns ``(gateway base, name)``."""
        flow = self._register_flow(
            model_name,
            upstream_base_url,
            upstream_api_key,
            deployment_id or str(uuid.uuid4()),
            protocol,
            None,
        )
        return self._http.run(flow, client)

    async def register_llm_proxy_async(
        self,
        model_name: str,
        upstream_base_url: str,
        upstream_api_key: str,
        deployment_id: str,
        *,
        protocol: str = "chat_completions",
        client: httpx.AsyncClient | None = None,
        timeout: float = REGISTRY_TIMEOUT,
    ) -> tuple[str, str]:
        flow = self._register_flow(
            model_name, upstream_base_url, upstream_api_key, deployment_id, protocol, timeout
        )
        return await self._http.arun(flow, client)

    def _route_present_flow(
        self, method: str, model_name: str, timeout: float | None
    ) -> Flow[bool]:
        _check_model_name(model_name)
        path = f"{API}/llm/models/{encode_path(model_name)}"
        if method == "PATCH":  # renewal: an empty JSON body
            request = ArenaRequest("PATCH", path, json={}, timeout=timeout)
        else:
            request = ArenaRequest("GET", path, timeout=timeout)
        response = yield request
        if response.status_code == 404:
            return False
        model = _object(
            _unwrap_data(self._http.read_json(response, request), "Arena route"), "Arena route"
        )
        if model.get("model_name") != model_name:
            raise ArenaAPIError(
                f"Arena route lookup returned an unexpected model_name {model.get('model_name')!r}"
            )
        return True

    def llm_proxy_exists(self, model_name: str, *, client: httpx.Client | None = None) -> bool:
        return self._http.run(self._route_present_flow("GET", model_name, None), client)

    async def llm_proxy_exists_async(
        self,
        model_name: str,
        *,
        client: httpx.AsyncClient | None = None,
        timeout: float = REGISTRY_TIMEOUT,
    ) -> bool:
        """Whether the route still exists (Arena may garbage-collect idle routes)."""
        return await self._http.arun(self._route_present_flow("GET", model_name, timeout), client)

    async def renew_llm_proxy_async(
        self,
        model_name: str,
        *,
        client: httpx.AsyncClient | None = None,
        timeout: float = REGISTRY_TIMEOUT,
    ) -> bool:
        """Keep a route alive; ``False`` when Arena no longer has it (re-register then)."""
        return await self._http.arun(self._route_present_flow("PATCH", model_name, timeout), client)

    def _delete_flow(self, model_name: str, timeout: float | None) -> Flow[None]:
        _check_model_name(model_name)
        request = ArenaRequest(
            "DELETE", f"{API}/llm/models/{encode_path(model_name)}", timeout=timeout
        )
        response = yield request
        if response.status_code != 404:
            self._http.check_status(response, request)

    def delete_llm_proxy(self, model_name: str, *, client: httpx.Client | None = None) -> None:
        """Delete a route; a route that is already gone counts as deleted."""
        self._http.run(self._delete_flow(model_name, None), client)

    async def delete_llm_proxy_async(
        self,
        model_name: str,
        *,
        client: httpx.AsyncClient | None = None,
        timeout: float = REGISTRY_TIMEOUT,
    ) -> None:
        await self._http.arun(self._delete_flow(model_name, timeout), client)

    # --- E7, E8: tasks ---

    async def launch_one_task_result(
        self,
        stream_id: str,
        data_id: str,
        model_name: str,
        proxy_base_url: str,
        proxy_api_key: str,
        *,
        session_id: str = "",
        harness: str = "",
        task_envs: Mapping[str, str] | None = None,
        client: httpx.AsyncClient | None = None,
        on_launch_success: Callable[[str | None], Any] | None = None,
    ) -> ArenaTaskResult:
        """Launch one task for ``data_id`` and poll until it is terminal.

        ``MODEL_NAME``, ``BASE_URL`` and ``API_KEY`` in the task environment always equal
        the route the Harness must call. ``on_launch_success(task_id)`` runs once, when
        Arena has accepted the task. There is no internal deadline: bound the call with
        the episode timeout (Arena has no cancel endpoint; an abandoned task keeps going).
        """
        body = launch_body(
            data_id,
            model_name,
            proxy_base_url,
            proxy_api_key,
            session_id=session_id,
            harness=harness,
            task_envs=task_envs,
        )
        flow = launch_task_flow(self._http, stream_id, body, self.poll_interval, on_launch_success)
        return await self._http.arun(flow, client)

    async def launch_one_task(self, *args: Any, **kwargs: Any) -> float:
        """As :meth:`launch_one_task_result`, returning only the score."""
        result = await self.launch_one_task_result(*args, **kwargs)
        if result.score is None:
            raise ArenaAPIError(f"Arena task {result.task_id} has no top-level 'score'")
        return result.score

    # --- E9, E10: read-only checks used by preflight ---

    def _harness_flow(self, key: str, version: str) -> Flow[dict]:
        request = ArenaRequest(
            "GET", f"{API}/harnesses/{encode_path(key)}/versions/{encode_path(version)}"
        )
        payload = self._http.read_json((yield request), request)
        return _object(_unwrap_data(payload, "Harness response"), "Harness version")

    def get_harness_version(
        self, key: str, version: str, *, client: httpx.Client | None = None
    ) -> dict:
        """The Harness version object (its ``status`` is ``PUBLISHED`` when usable)."""
        return self._http.run(self._harness_flow(key, version), client)

    async def get_harness_version_async(
        self, key: str, version: str, *, client: httpx.AsyncClient | None = None
    ) -> dict:
        return await self._http.arun(self._harness_flow(key, version), client)

    def _tasks_flow(self, stream_id: str, limit: int, offset: int) -> Flow[Any]:
        request = ArenaRequest(
            "GET",
            f"{API}/streams/{encode_path(stream_id)}/tasks",
            params={"limit": str(limit), "offset": str(offset)},
        )
        return _unwrap_data(self._http.read_json((yield request), request), "Stream tasks response")

    def list_stream_tasks(
        self,
        stream_id: str,
        limit: int = 100,
        offset: int = 0,
        *,
        client: httpx.Client | None = None,
    ) -> Any:
        """Recent task rows of a Stream (the response's ``data``: a list or ``{items}``)."""
        return self._http.run(self._tasks_flow(stream_id, limit, offset), client)

    async def list_stream_tasks_async(
        self,
        stream_id: str,
        limit: int = 100,
        offset: int = 0,
        *,
        client: httpx.AsyncClient | None = None,
    ) -> Any:
        return await self._http.arun(self._tasks_flow(stream_id, limit, offset), client)
