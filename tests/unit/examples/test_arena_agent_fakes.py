"""Shared fakes for the ``ArenaStreamAgentWorkflow`` tests (this module holds no tests).

``FakeArena`` is a stateful Arena OpenAPI peer for ``httpx.MockTransport``: it keeps the
registered LLM routes, numbers launched tasks and answers polls from a script. Any
operation can be overridden once per queued reply (``fake.script(op, ...)``).
"""

from __future__ import annotations

import inspect
import json
import logging
import re
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import httpx

from areal.utils import stats_tracker
from examples.swe.arena_agent import ArenaStreamAgentWorkflow
from examples.swe.arena_client import ArenaOpenAPIClient
from tests.conftest import SECRET_SENTINEL

BASE = "https://arena.test"
TOKEN = f"tok-{SECRET_SENTINEL}"
LLM_KEY = f"llm-{SECRET_SENTINEL}"
SESSION_KEY = f"sk-{SECRET_SENTINEL}"
GATEWAY_KEY = f"gw-{SECRET_SENTINEL}"
PROXY = "http://rollout-proxy:1234"
HARNESS = "claude-code@1.0.0"
ROW = {
    "data_id": "data-1",
    "stream_id": "stream-a",
    "llm_protocol": "anthropic",
    "arena_task_type": "swe",
    "arena_stream_name": "default",
    "reward_ref_key": "",
    "reward_ref_version": "",
}
ARENA_ENV = ("ARENA_OPENAPI_BASE", "ARENA_OPENAPI_TOKEN", "ARENA_LLM_API_KEY", "ARENA_LLM_BASE_URL")

_OPS = (
    ("register", "POST", re.compile(r"/openapi/v1/llm/models")),
    ("exists", "GET", re.compile(r"/openapi/v1/llm/models/(?P<name>[^/]+)")),
    ("renew", "PATCH", re.compile(r"/openapi/v1/llm/models/(?P<name>[^/]+)")),
    ("delete", "DELETE", re.compile(r"/openapi/v1/llm/models/(?P<name>[^/]+)")),
    ("stream", "GET", re.compile(r"/openapi/v1/streams/(?P<name>[^/]+)")),
    ("launch", "POST", re.compile(r"/openapi/v1/streams/(?P<name>[^/]+)/launch_one_task")),
    ("poll", "GET", re.compile(r"/openapi/v1/tasks/(?P<name>[^/]+)/result")),
)


@dataclass
class Call:
    op: str
    name: str  # the model name, Stream id or task id in the path ("" for register)
    body: Any
    headers: httpx.Headers


class FakeArena:
    """A stateful fake Arena (see the module docstring)."""

    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.models: dict[str, dict] = {}
        self.scripts: dict[str, deque] = defaultdict(deque)
        self.streams: dict[str, dict] = {"stream-a": {"stream_id": "stream-a", "status": "ACTIVE"}}
        self.launch_payload: dict[str, Any] = {"status": "PENDING"}
        self.polls: list[dict[str, Any]] = [{"status": "DONE", "score": 1.0}]
        self.on_launch: Callable[[FakeArena, dict], None] | None = None
        self.on_poll: Callable[[FakeArena, str], dict] | None = None
        self._poll_index: dict[str, int] = defaultdict(int)

    # --- scripting ---

    def script(self, op: str, *replies: Any) -> FakeArena:
        """Queue one-shot replies: a Response, an exception, or ``fn(request)`` returning a
        Response or ``None`` (then the default behaviour answers), or an awaitable of one
        (async clients only)."""
        self.scripts[op].extend(replies)
        return self

    def ops(self, *ops: str) -> list[Call]:
        return [c for c in self.calls if c.op in ops]

    def op_names(self) -> list[str]:
        return [c.op for c in self.calls]

    @property
    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handler)

    # --- serving ---

    def handler(self, request: httpx.Request) -> Any:
        path = request.url.raw_path.decode().split("?", 1)[0]
        op, name = next(
            (
                (op, m.groupdict().get("name", ""))
                for op, method, pattern in _OPS
                if request.method == method and (m := pattern.fullmatch(path))
            ),
            ("unknown", ""),
        )
        body = json.loads(request.content) if request.content else None
        self.calls.append(Call(op, name, body, request.headers))
        if self.scripts[op]:
            reply = self.scripts[op].popleft()
            if isinstance(reply, BaseException):
                raise reply
            if callable(reply):
                reply = reply(request)
            if inspect.isawaitable(reply):
                return self._finish(reply, op, name, body)
            if reply is not None:
                return reply
        return self.default(op, name, body)

    async def _finish(self, pending: Any, op: str, name: str, body: Any) -> httpx.Response:
        reply = await pending
        return reply if reply is not None else self.default(op, name, body)

    def default(self, op: str, name: str, body: Any) -> httpx.Response:
        if op == "register":
            self.models[body["model_name"]] = body
            return httpx.Response(201, json={"model_name": body["model_name"]})
        if op in ("exists", "renew"):
            if name not in self.models:
                return httpx.Response(404, json={"error": "not found"})
            return httpx.Response(200, json={"data": {"model_name": name}})
        if op == "delete":
            self.models.pop(name, None)
            return httpx.Response(204)
        if op == "stream":
            return httpx.Response(200, json={"data": {"stream": self.streams[name]}})
        if op == "launch":
            task_id = f"task-{len(self.ops('launch'))}"
            if self.on_launch is not None:
                self.on_launch(self, body)
            return httpx.Response(202, json={"task_id": task_id, **self.launch_payload})
        if op == "poll":
            if self.on_poll is not None:
                payload = self.on_poll(self, name)
            else:
                index = min(self._poll_index[name], len(self.polls) - 1)
                self._poll_index[name] += 1
                payload = self.polls[index]
            return httpx.Response(200, json={"task_id": name, **payload})
        return httpx.Response(404, json={"error": f"no route for {op}"})


class StrictCallArenaClient:
    """An Arena client that accepts only the call shapes of the reference suite.

    The Stream or route identifier of ``resolve_stream[_async]``, ``llm_proxy_exists_async``,
    ``renew_llm_proxy_async`` and ``delete_llm_proxy[_async]`` is positional-only (``/``);
    every other parameter of every method is keyword-only (``*``). It forwards to a real
    :class:`ArenaOpenAPIClient` (over a fake transport) and records the name of every call,
    so a caller that passes an identifier by keyword, or anything else positionally, fails
    here with a ``TypeError``, as it would on a subclass or wrapper shaped like this.
    """

    def __init__(self, *, inner: ArenaOpenAPIClient):
        self._inner = inner
        self.base_url = inner.base_url
        self.calls: list[str] = []

    @property
    def llm_gateway_api_key(self) -> str:
        return self._inner.llm_gateway_api_key

    def resolve_stream(self, stream_id: str = "", /, *, client: Any = None) -> dict:
        self.calls.append("resolve_stream")
        return self._inner.resolve_stream(stream_id, client=client)

    async def resolve_stream_async(
        self, stream_id: str = "", /, *, client: Any = None, timeout: float | None = None
    ) -> dict:
        self.calls.append("resolve_stream_async")
        return await self._inner.resolve_stream_async(stream_id, client=client, timeout=timeout)

    def get_all_dataset_rows(
        self, *, stream_id: str, llm_protocol: str = "chat_completions", client: Any = None
    ) -> list[dict]:
        self.calls.append("get_all_dataset_rows")
        return self._inner.get_all_dataset_rows(
            stream_id=stream_id, llm_protocol=llm_protocol, client=client
        )

    def register_llm_proxy(
        self,
        *,
        model_name: str,
        upstream_base_url: str,
        upstream_api_key: str,
        deployment_id: str | None = None,
        protocol: str = "chat_completions",
        client: Any = None,
    ) -> tuple[str, str]:
        self.calls.append("register_llm_proxy")
        return self._inner.register_llm_proxy(
            model_name=model_name,
            upstream_base_url=upstream_base_url,
            upstream_api_key=upstream_api_key,
            deployment_id=deployment_id,
            protocol=protocol,
            client=client,
        )

    async def register_llm_proxy_async(
        self,
        *,
        model_name: str,
        upstream_base_url: str,
        upstream_api_key: str,
        deployment_id: str,
        protocol: str = "chat_completions",
        client: Any = None,
        timeout: float = 180.0,
    ) -> tuple[str, str]:
        self.calls.append("register_llm_proxy_async")
        return await self._inner.register_llm_proxy_async(
            model_name=model_name,
            upstream_base_url=upstream_base_url,
            upstream_api_key=upstream_api_key,
            deployment_id=deployment_id,
            protocol=protocol,
            client=client,
            timeout=timeout,
        )

    async def llm_proxy_exists_async(
        self, model_name: str, /, *, client: Any = None, timeout: float = 180.0
    ) -> bool:
        self.calls.append("llm_proxy_exists_async")
        return await self._inner.llm_proxy_exists_async(model_name, client=client, timeout=timeout)

    async def renew_llm_proxy_async(
        self, model_name: str, /, *, client: Any = None, timeout: float = 180.0
    ) -> bool:
        self.calls.append("renew_llm_proxy_async")
        return await self._inner.renew_llm_proxy_async(model_name, client=client, timeout=timeout)

    def delete_llm_proxy(self, model_name: str, /, *, client: Any = None) -> None:
        self.calls.append("delete_llm_proxy")
        self._inner.delete_llm_proxy(model_name, client=client)

    async def delete_llm_proxy_async(
        self, model_name: str, /, *, client: Any = None, timeout: float = 180.0
    ) -> None:
        self.calls.append("delete_llm_proxy_async")
        await self._inner.delete_llm_proxy_async(model_name, client=client, timeout=timeout)

    async def launch_one_task_result(
        self,
        *,
        stream_id: str,
        data_id: str,
        model_name: str,
        proxy_base_url: str,
        proxy_api_key: str,
        session_id: str = "",
        harness: str = "",
        task_envs: dict[str, str] | None = None,
        client: Any = None,
        on_launch_success: Callable[[str | None], Any] | None = None,
    ) -> Any:
        self.calls.append("launch_one_task_result")
        return await self._inner.launch_one_task_result(
            stream_id=stream_id,
            data_id=data_id,
            model_name=model_name,
            proxy_base_url=proxy_base_url,
            proxy_api_key=proxy_api_key,
            session_id=session_id,
            harness=harness,
            task_envs=task_envs,
            client=client,
            on_launch_success=on_launch_success,
        )

    def close(self) -> None:
        self._inner.close()

    async def aclose(self) -> None:
        await self._inner.aclose()


class FakeClock:
    """Stands in for the ``time`` module of :mod:`examples.swe.arena_routes` in tests that
    throttle route probes: the test advances it, so no outcome depends on machine speed."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeRuntime:
    """A rollout engine stand-in: keeps the first destroy callback per key."""

    def __init__(self) -> None:
        self.callbacks: dict[str, Callable[[], Any]] = {}
        self.registrations = 0

    def register_destroy_callback(self, key: str, fn: Callable[[], Any]) -> bool:
        self.registrations += 1
        if key in self.callbacks:
            return False
        self.callbacks[key] = fn
        return True

    def destroy(self) -> None:
        callbacks, self.callbacks = self.callbacks, {}
        for fn in callbacks.values():
            fn()


def make_client(fake: FakeArena, *, retries: int = 0, llm_key: str = LLM_KEY, **kwargs: Any):
    return ArenaOpenAPIClient(
        base_url=BASE,
        api_token=TOKEN,
        llm_api_key=llm_key,
        poll_interval=kwargs.pop("poll_interval", 0.002),
        request_retries=retries,
        transport=fake.transport,
        async_transport=fake.transport,
        **kwargs,
    )


def make_agent(
    fake: FakeArena,
    *,
    retries: int = 0,
    llm_key: str = LLM_KEY,
    flag: bool = False,
    strict_calls: bool = False,
    **econfig: Any,
) -> ArenaStreamAgentWorkflow:
    """An agent on the legacy single Stream ``stream-a`` (econfig keys override);
    ``strict_calls`` hands it a :class:`StrictCallArenaClient`."""
    settings: dict[str, Any] = {
        "stream_id": "stream-a",
        "arena_harness": HARNESS,
        "arena_llm_route_mode": "gateway",
        "arena_registration_probe_interval": 60.0,
        "timeout": 30.0,
    }
    settings.update(econfig)
    client: Any = make_client(fake, retries=retries, llm_key=llm_key)
    if strict_calls:
        client = StrictCallArenaClient(inner=client)
    return ArenaStreamAgentWorkflow(
        settings, reject_terminal_task_failures=flag, arena_client=client
    )


def run_kwargs(session: str = "sess-1", **overrides: Any) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "base_url": PROXY,
        "api_key": SESSION_KEY,
        "session_id": session,
        "proxy_gateway_api_key": GATEWAY_KEY,
        "proxy_session_token": f"st-{session}-{SECRET_SENTINEL}",
    }
    kwargs.update(overrides)
    return {k: v for k, v in kwargs.items() if v is not None}


def metrics() -> dict[str, float]:
    """Everything recorded in any tracker since the last call (then reset), as a rollout
    worker exports it: ``rollout/*``, ``eval-rollout/*``, ``debug/*``."""
    return stats_tracker.export_all()


class LogRecords(logging.Handler):
    """Collects records of the ``areal`` loggers, unmasked, for assertions."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int = logging.DEBUG) -> list[str]:
        return [r.getMessage() for r in self.records if r.levelno >= level]


class FakeArenaASGI:
    """Serves a :class:`FakeArena` as an ASGI app (for clients that cannot take a transport)."""

    def __init__(self, fake: FakeArena):
        self.fake = fake

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        body, more = b"", True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        query = scope.get("query_string", b"").decode()
        url = f"http://arena{scope['raw_path'].decode()}" + (f"?{query}" if query else "")
        headers = [(k.decode(), v.decode()) for k, v in scope["headers"]]
        response = self.fake.handler(
            httpx.Request(scope["method"], url, headers=headers, content=body)
        )
        if inspect.isawaitable(response):
            response = await response
        content = response.read()
        await send(
            {
                "type": "http.response.start",
                "status": response.status_code,
                "headers": [(k.encode(), v.encode()) for k, v in response.headers.items()],
            }
        )
        await send({"type": "http.response.body", "body": content})
