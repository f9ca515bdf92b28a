"""HTTP client of one worker's RPC server, with the retry rules of §10.1.

Every request, ``/health`` included, is signed with the experiment token (the ``token``
argument, else ``$AREAL_RPC_TOKEN``) as :mod:`areal.infra.rpc.auth` describes; the token
itself is never sent. Every answer must carry the worker's signature for that request:
one that does not (a process that is not a worker of this run, or a relay) raises
:class:`~areal.infra.scheduler.exceptions.RPCAuthenticationError` and is never acted
on. Engine calls are retried on timeouts, connection errors, 503, and 500s whose error
mentions "timeout", with exponential backoff (each attempt signed afresh);
``max_retries`` is the total number of attempts. Before each attempt an optional
``liveness_check`` runs, so a dead worker surfaces as the scheduler's
``WorkerFailedError`` instead of a string of connection errors.

No request carries a secret in clear (DESIGN 15): a :class:`~areal.utils.secrets.SecretStr`
in a config or argument goes as the name of the worker environment variable that holds
it (``secret_env``, exported by the scheduler; :mod:`areal.infra.rpc.secret_env`), one of
the run's secrets that this worker's role does not use (``withheld_secrets``) is sent
redacted, and any other is refused before anything is sent.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import httpx

from areal.api.scheduler_api import RPC_TOKEN_ENV
from areal.infra.rpc.auth import RequestSigner, SignatureError
from areal.infra.rpc.secret_env import secret_refs
from areal.infra.rpc.serialization import (
    deserialize_value,
    json_dumps,
    json_loads,
    serialize_value,
)
from areal.infra.scheduler.exceptions import (
    EngineCallError,
    EngineCreationError,
    EngineImportError,
    PortAllocationError,
    RPCAuthenticationError,
    RPCConnectionError,
    SchedulerError,
    WorkerConfigurationError,
)
from areal.utils.network import httpx_transport
from areal.utils.secrets import SecretStr, reveal

__all__ = ["RPCClient"]

CONTROL_TIMEOUT = 60.0  # seconds for fork / configure / set_env / alloc_ports
CREATE_ENGINE_TIMEOUT = 600.0
_RETRY_STATUSES = frozenset({503})


def _error_text(response: httpx.Response) -> str:
    try:
        data = json_loads(response.content)
    except ValueError:
        return response.text[:2000]
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        return data["error"]
    return response.text[:2000]


def _retryable(response: httpx.Response) -> bool:
    if response.status_code in _RETRY_STATUSES:
        return True
    return response.status_code == 500 and "timeout" in _error_text(response).lower()


def _plain_env(env: Mapping[str, str], path: str) -> Mapping[str, str]:
    """``env`` unless it holds a secret, which must not travel in a request body."""
    secret = sorted(k for k, v in env.items() if isinstance(v, SecretStr))
    if secret:
        raise WorkerConfigurationError(
            f"{path}: {', '.join(secret)} hold secrets, which never travel in a request; "
            "put them in the experiment config (the scheduler exports its secrets to every "
            "worker's environment at start)"
        )
    return env


class RPCClient:
    """Talks to the RPC server at ``address`` (``host:port``) of worker ``worker_id``."""

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        worker_id: str | None = None,
        liveness_check: Callable[[], None] | None = None,
        secret_env: Mapping[str, str] | None = None,
        withheld_secrets: Iterable[str] = (),
    ):
        """``secret_env``: ``{variable name: secret}`` the worker has in its environment;
        ``withheld_secrets``: the run's secrets it is not given (they arrive empty)."""
        self.address = address
        self.worker_id = worker_id or address
        self.base_url = f"http://{address}"
        token = reveal(token) if token else os.environ.get(RPC_TOKEN_ENV, "")
        if not token:
            raise RPCAuthenticationError(
                f"worker {self.worker_id}: no RPC token to sign requests with (pass token= "
                f"or set ${RPC_TOKEN_ENV})"
            )
        self._auth = RequestSigner(token)
        self._liveness_check = liveness_check
        self._secret_refs = {
            **{reveal(s): "" for s in withheld_secrets if reveal(s)},
            **secret_refs(secret_env or {}),
        }
        self._client = self._new_client(httpx.Client)

    def _new_client(self, cls: type) -> Any:
        headers = {"content-type": "application/json"}
        options = {"transport": httpx_transport()} if cls is httpx.Client else {}
        return cls(base_url=self.base_url, headers=headers, auth=self._auth, **options)

    def _unauthenticated(self, path: str, error: SignatureError) -> RPCAuthenticationError:
        return RPCAuthenticationError(
            f"{path} on worker {self.worker_id} at {self.address}: {error}; the process "
            "there did not prove it holds this run's RPC token, so nothing it says is used"
        )

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> RPCClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- control endpoints ---

    def health(self, timeout: float = 5.0) -> dict[str, Any]:
        """``GET /health``; raises :class:`RPCConnectionError` when unreachable or unhealthy."""
        try:
            response = self._client.get("/health", timeout=timeout)
        except httpx.HTTPError as e:
            raise RPCConnectionError(f"worker {self.worker_id} at {self.address}: {e}") from e
        except SignatureError as e:
            raise self._unauthenticated("/health", e) from None
        if response.status_code == 401:
            raise RPCAuthenticationError(
                f"worker {self.worker_id} at {self.address} refused our signature: "
                f"{_error_text(response)}"
            )
        if response.status_code != 200:
            raise RPCConnectionError(
                f"worker {self.worker_id} health check: HTTP {response.status_code}"
            )
        return json_loads(response.content)

    def alloc_ports(self, count: int) -> list[int]:
        data = self._control("/alloc_ports", {"count": count}, PortAllocationError)
        return [int(p) for p in data["ports"]]

    def fork(
        self,
        role: str,
        worker_index: int,
        raw_cmd: list[str],
        env: dict[str, str] | None = None,
    ) -> dict[str, Any]:
        """Start a child worker on this worker's host: ``{"status", "host", "pid"}``."""
        body: dict[str, Any] = {"role": role, "worker_index": worker_index, "raw_cmd": raw_cmd}
        if env:
            body["env"] = _plain_env(env, "/fork")
        return self._control("/fork", body, SchedulerError)

    def kill_forked_worker(self, role: str, worker_index: int) -> dict[str, Any]:
        body = {"role": role, "worker_index": worker_index}
        return self._control("/kill_forked_worker", body, SchedulerError)

    def set_env(self, env: dict[str, str]) -> None:
        self._control("/set_env", {"env": _plain_env(env, "/set_env")}, WorkerConfigurationError)

    async def async_set_env(self, env: dict[str, str]) -> None:
        body = {"env": _plain_env(env, "/set_env")}
        await self._async_control("/set_env", body, WorkerConfigurationError)

    def _encode(self, value: Any) -> Any:
        return serialize_value(value, secret_env=self._secret_refs)

    def configure(self, config: Any, role: str, rank: int) -> dict[str, Any]:
        """``POST /configure``; secrets in ``config`` go by reference (DESIGN 15)."""
        body = {"config": self._encode(config), "role": role, "rank": rank}
        return self._control("/configure", body, WorkerConfigurationError)

    async def async_configure(self, config: Any, role: str, rank: int) -> dict[str, Any]:
        body = {"config": self._encode(config), "role": role, "rank": rank}
        return await self._async_control("/configure", body, WorkerConfigurationError)

    def _control(
        self,
        path: str,
        body: dict[str, Any],
        error: type[SchedulerError],
        timeout: float = CONTROL_TIMEOUT,
    ) -> dict[str, Any]:
        try:
            response = self._client.post(path, content=json_dumps(body), timeout=timeout)
        except httpx.HTTPError as e:
            raise RPCConnectionError(f"{path} on worker {self.worker_id}: {e}") from e
        except SignatureError as e:
            raise self._unauthenticated(path, e) from None
        return self._control_result(path, response, error)

    async def _async_control(
        self,
        path: str,
        body: dict[str, Any],
        error: type[SchedulerError],
        timeout: float = CONTROL_TIMEOUT,
    ) -> dict[str, Any]:
        try:
            async with self._new_client(httpx.AsyncClient) as c:
                response = await c.post(path, content=json_dumps(body), timeout=timeout)
        except httpx.HTTPError as e:
            raise RPCConnectionError(f"{path} on worker {self.worker_id}: {e}") from e
        except SignatureError as e:
            raise self._unauthenticated(path, e) from None
        return self._control_result(path, response, error)

    def _control_result(
        self, path: str, response: httpx.Response, error: type[SchedulerError]
    ) -> dict[str, Any]:
        if response.status_code == 401:
            raise error(
                f"{path} on worker {self.worker_id}: the worker refused our signature: "
                f"{_error_text(response)} (the controller and workers must share "
                f"${RPC_TOKEN_ENV} and agree on the time)"
            )
        if response.status_code != 200:
            raise error(
                f"{path} on worker {self.worker_id}: HTTP {response.status_code}: "
                f"{_error_text(response)}"
            )
        return json_loads(response.content)

    # --- engines ---

    def _create_body(self, engine: str, engine_name: str, args: tuple, kwargs: dict) -> bytes:
        return json_dumps(
            {
                "engine": engine,
                "engine_name": engine_name,
                "init_args": self._encode(list(args)),
                "init_kwargs": self._encode(kwargs),
            }
        )

    def _create_result(self, engine: str, response: httpx.Response) -> str:
        if response.status_code == 200:
            return json_loads(response.content)["engine_name"]
        text = _error_text(response)
        detail = f"{engine} on worker {self.worker_id}: {text}"
        not_importable = text.startswith("cannot import") or "is not a TrainEngine" in text
        if response.status_code == 400 and not_importable:
            raise EngineImportError(detail)
        raise EngineCreationError(f"HTTP {response.status_code}: {detail}")

    def create_engine(
        self, engine: str, engine_name: str | None = None, *args: Any, **kwargs: Any
    ) -> str:
        """Build ``engine`` (``"<module>.<Class>"``) on the worker; returns the engine name."""
        name = engine_name or self.worker_id
        body = self._create_body(engine, name, args, kwargs)
        try:
            response = self._client.post(
                "/create_engine", content=body, timeout=CREATE_ENGINE_TIMEOUT
            )
        except httpx.HTTPError as e:
            raise RPCConnectionError(f"/create_engine on worker {self.worker_id}: {e}") from e
        except SignatureError as e:
            raise self._unauthenticated("/create_engine", e) from None
        return self._create_result(engine, response)

    async def async_create_engine(
        self, engine: str, engine_name: str | None = None, *args: Any, **kwargs: Any
    ) -> str:
        name = engine_name or self.worker_id
        body = self._create_body(engine, name, args, kwargs)
        try:
            async with self._new_client(httpx.AsyncClient) as c:
                response = await c.post(
                    "/create_engine", content=body, timeout=CREATE_ENGINE_TIMEOUT
                )
        except httpx.HTTPError as e:
            raise RPCConnectionError(f"/create_engine on worker {self.worker_id}: {e}") from e
        except SignatureError as e:
            raise self._unauthenticated("/create_engine", e) from None
        return self._create_result(engine, response)

    def _call_body(
        self,
        method: str,
        engine_name: str | None,
        args: tuple,
        kwargs: dict,
        rpc_meta: dict | None,
    ) -> bytes:
        return json_dumps(
            {
                "method": method,
                "engine_name": engine_name or self.worker_id,
                "args": self._encode(list(args)),
                "kwargs": self._encode(kwargs),
                "rpc_meta": rpc_meta,
            }
        )

    def _call_outcome(
        self, method: str, response: httpx.Response, attempt: int, last: bool
    ) -> tuple[bool, Any]:
        """``(done, result)``; raises :class:`EngineCallError` for a final failure."""
        if response.status_code == 200:
            return True, deserialize_value(json_loads(response.content).get("result"))
        if _retryable(response) and not last:
            return False, None
        detail = f"HTTP {response.status_code}: {_error_text(response)}"
        raise EngineCallError(self.worker_id, method, detail, attempt)

    def call_engine(
        self,
        method: str,
        *args: Any,
        engine_name: str | None = None,
        rpc_meta: dict[str, Any] | None = None,
        http_timeout: float = 7200.0,
        max_retries: int = 3,
        retry_delay: float = 1.0,
        **kwargs: Any,
    ) -> Any:
        """``POST /call``: ``engine.method(*args, **kwargs)`` on the worker; its result."""
        body = self._call_body(method, engine_name, args, kwargs, rpc_meta)
        attempts = max(1, max_retries)
        for attempt in range(1, attempts + 1):
            if self._liveness_check is not None:
                self._liveness_check()
            last = attempt == attempts
            try:
                response = self._client.post("/call", content=body, timeout=http_timeout)
            except (httpx.TimeoutException, httpx.TransportError) as e:
                if last:
                    self._fail_unreachable(method, e, attempt)
            except SignatureError as e:
                raise self._unauthenticated("/call", e) from None
            else:
                done, result = self._call_outcome(method, response, attempt, last)
                if done:
                    return result
            time.sleep(retry_delay * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    async def async_call_engine(
        self,
        method: str,
        *args: Any,
        engine_name: str | None = None,
        rpc_meta: dict[str, Any] | None = None,
        http_timeout: float = 7200.0,
        max_retries: int = 3,
        retry_delay: float = 1.0,
        **kwargs: Any,
    ) -> Any:
        body = self._call_body(method, engine_name, args, kwargs, rpc_meta)
        attempts = max(1, max_retries)
        async with self._new_client(httpx.AsyncClient) as client:
            for attempt in range(1, attempts + 1):
                if self._liveness_check is not None:
                    self._liveness_check()
                last = attempt == attempts
                try:
                    response = await client.post("/call", content=body, timeout=http_timeout)
                except (httpx.TimeoutException, httpx.TransportError) as e:
                    if last:
                        self._fail_unreachable(method, e, attempt)
                except SignatureError as e:
                    raise self._unauthenticated("/call", e) from None
                else:
                    done, result = self._call_outcome(method, response, attempt, last)
                    if done:
                        return result
                await asyncio.sleep(retry_delay * 2 ** (attempt - 1))
        raise AssertionError("unreachable")

    def _fail_unreachable(self, method: str, error: Exception, attempt: int) -> None:
        if self._liveness_check is not None:
            self._liveness_check()  # a dead worker explains the failure better
        detail = f"no answer from {self.address}: {type(error).__name__}: {error}"
        raise EngineCallError(self.worker_id, method, detail, attempt) from error
