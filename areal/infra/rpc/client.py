"""Async HTTP client of one worker's RPC server, with the retry rules of engine calls.

Every request is a coroutine, stated once, that runs on the controller's RPC loop
(:mod:`areal.infra.rpc.loop`), where the client's pooled connections live; one awaited on
another loop is handed over, and synchronous code uses
:func:`~areal.infra.rpc.loop.run_sync`.

Every request, ``/health`` included, is signed with the experiment token (the ``token``
argument, else ``$AREAL_RPC_TOKEN``) as :mod:`areal.infra.rpc.auth` describes; the token
itself is never sent. Every answer must carry the worker's signature for that request:
one that does not (a process that is not a worker of this run, or a relay) raises
:class:`~areal.infra.scheduler.exceptions.RPCAuthenticationError` and is never acted
on. Engine calls are retried on timeouts, connection errors, 503, and 500s whose error
mentions "timeout", with exponential backoff (``retry_delay * 2**(n - 1)`` after attempt
``n``, each attempt signed afresh); ``max_retries`` is the total number of attempts.
Before each attempt an optional ``liveness_check`` runs, so a dead worker surfaces as the
scheduler's ``WorkerFailedError`` instead of a string of connection errors.

No request carries a secret in clear: a :class:`~areal.utils.secrets.SecretStr` in a
config or argument goes as the name of the worker environment variable that holds it
(``secret_env``, exported by the scheduler; :mod:`areal.infra.rpc.secret_env`), one of
the run's secrets that this worker's role does not use (``withheld_secrets``) is sent
redacted, and any other is refused before anything is sent.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
import torch

from areal.api.scheduler_api import RPC_TOKEN_ENV
from areal.infra.rpc.auth import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    SignatureError,
    sign_request,
    verify_response,
)
from areal.infra.rpc.loop import on_rpc_loop
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
from areal.utils.retry import RetryPolicy
from areal.utils.secrets import SecretStr, reveal

__all__ = ["RPCClient"]

CONTROL_TIMEOUT = 60.0  # seconds for fork / configure / set_env / alloc_ports
CREATE_ENGINE_TIMEOUT = 600.0
_RETRY_STATUSES = frozenset({503})
# answers bigger than this are decoded off the RPC loop, which keeps serving meanwhile
_DECODE_INLINE_BYTES = 64 * 1024
POOL_CONNECTIONS = 100  # per worker: long polls and fan-outs share it


@dataclass(frozen=True)
class Answer:
    """A worker's answer: status, body and headers (read in full)."""

    status_code: int
    content: bytes
    headers: Mapping[str, str]

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", errors="replace")


def _heavy(value: Any, depth: int = 0) -> bool:
    """Whether encoding ``value`` may hold the loop: it holds a tensor within three levels
    (a batch is a list of dicts of tensors) or a container of over 64 items."""
    if isinstance(value, torch.Tensor):
        return True
    if depth > 2:
        return False
    if isinstance(value, Mapping):
        return len(value) > 64 or any(_heavy(v, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple)):
        return len(value) > 64 or any(_heavy(v, depth + 1) for v in value)
    return False


def _error_text(response: Answer) -> str:
    try:
        data = json_loads(response.content)
    except ValueError:
        return response.text[:2000]
    if isinstance(data, dict) and isinstance(data.get("error"), str):
        return data["error"]
    return response.text[:2000]


def _retryable(response: Answer) -> bool:
    if response.status_code in _RETRY_STATUSES:
        return True
    return response.status_code == 500 and "timeout" in _error_text(response).lower()


def _unanswered(error: BaseException) -> bool:
    return isinstance(error, httpx.TransportError)  # timeouts and connection errors


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
        liveness_check_blocks: bool = True,
        secret_env: Mapping[str, str] | None = None,
        withheld_secrets: Iterable[str] = (),
    ):
        """``secret_env``: ``{variable name: secret}`` the worker has in its environment;
        ``withheld_secrets``: the run's secrets it is not given (they arrive empty).
        ``liveness_check`` runs off the RPC loop unless ``liveness_check_blocks`` is false
        (a ``poll()`` of a local process, not a ``squeue``)."""
        self.address = address
        self.worker_id = worker_id or address
        self.base_url = f"http://{address}"
        token = reveal(token) if token else os.environ.get(RPC_TOKEN_ENV, "")
        if not token:
            raise RPCAuthenticationError(
                f"worker {self.worker_id}: no RPC token to sign requests with (pass token= "
                f"or set ${RPC_TOKEN_ENV})"
            )
        self._liveness_check = liveness_check
        self._liveness_check_blocks = liveness_check_blocks
        self._secret_refs = {
            **{reveal(s): "" for s in withheld_secrets if reveal(s)},
            **secret_refs(secret_env or {}),
        }
        self._token = reveal(token)
        self._http: aiohttp.ClientSession | None = None  # made on the RPC loop, at first use

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None or self._http.closed:
            # aiohttp: a round trip costs about a third of httpx's async client's here
            connector = aiohttp.TCPConnector(limit=POOL_CONNECTIONS, force_close=False)
            self._http = aiohttp.ClientSession(connector=connector, auto_decompress=False)
        return self._http

    @on_rpc_loop
    async def close(self) -> None:
        """Close the pooled connections (a later request opens new ones)."""
        if self._http is not None:
            http, self._http = self._http, None
            await http.close()

    def _unauthenticated(self, path: str, error: SignatureError) -> RPCAuthenticationError:
        return RPCAuthenticationError(
            f"{path} on worker {self.worker_id} at {self.address}: {error}; the process "
            "there did not prove it holds this run's RPC token, so nothing it says is used"
        )

    async def _send(self, method: str, path: str, content: bytes, timeout: float) -> Answer:
        """One signed request; an answer without the worker's signature raises
        :class:`RPCAuthenticationError`. Transport failures raise httpx's exception types
        (``httpx.ConnectError``, ``httpx.ReadTimeout``...), the vocabulary of this module."""
        signature = sign_request(self._token, method, self.address, path, content)
        headers = {"host": self.address, "content-type": "application/json", **signature}
        try:
            async with self._session().request(
                method,
                f"{self.base_url}{path}",
                data=content if method == "POST" else None,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout),
            ) as response:
                answer = Answer(response.status, await response.read(), response.headers)
        except TimeoutError as e:
            raise httpx.ReadTimeout(f"no answer within {timeout:g} s") from e
        except aiohttp.ClientConnectorError as e:
            raise httpx.ConnectError(str(e)) from e
        except aiohttp.ClientError as e:
            raise httpx.RemoteProtocolError(f"{type(e).__name__}: {e}") from e
        if answer.status_code == 401 and SIGNATURE_HEADER not in answer.headers:
            return answer  # a refusal: the caller turns it into an error, never into a result
        try:
            verify_response(
                self._token,
                answer.status_code,
                signature[NONCE_HEADER],
                answer.headers,
                answer.content,
            )
        except SignatureError as e:
            raise self._unauthenticated(path, e) from None
        return answer

    async def _post(self, path: str, content: bytes, timeout: float) -> Answer:
        return await self._send("POST", path, content, timeout)

    def _encode(self, value: Any) -> Any:
        return serialize_value(value, secret_env=self._secret_refs)

    async def _check_liveness(self) -> None:
        if self._liveness_check is None:
            return
        if self._liveness_check_blocks:
            await asyncio.to_thread(self._liveness_check)  # e.g. squeue: never on the loop
        else:
            self._liveness_check()

    # --- control endpoints ---

    @on_rpc_loop
    async def health(self, timeout: float = 5.0) -> dict[str, Any]:
        """``GET /health``; raises :class:`RPCConnectionError` when unreachable or unhealthy."""
        try:
            response = await self._send("GET", "/health", b"", timeout)
        except httpx.HTTPError as e:
            raise RPCConnectionError(f"worker {self.worker_id} at {self.address}: {e}") from e
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

    async def alloc_ports(self, count: int) -> list[int]:
        data = await self._control("/alloc_ports", {"count": count}, PortAllocationError)
        return [int(p) for p in data["ports"]]

    async def fork(
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
        return await self._control("/fork", body, SchedulerError)

    async def kill_forked_worker(self, role: str, worker_index: int) -> dict[str, Any]:
        body = {"role": role, "worker_index": worker_index}
        return await self._control("/kill_forked_worker", body, SchedulerError)

    async def set_env(self, env: dict[str, str]) -> None:
        body = {"env": _plain_env(env, "/set_env")}
        await self._control("/set_env", body, WorkerConfigurationError)

    async def configure(self, config: Any, role: str, rank: int) -> dict[str, Any]:
        """``POST /configure``; secrets in ``config`` go by reference."""
        body = {"config": self._encode(config), "role": role, "rank": rank}
        return await self._control("/configure", body, WorkerConfigurationError)

    @on_rpc_loop
    async def _control(
        self,
        path: str,
        body: dict[str, Any],
        error: type[SchedulerError],
        timeout: float = CONTROL_TIMEOUT,
    ) -> dict[str, Any]:
        try:
            response = await self._post(path, json_dumps(body), timeout)
        except httpx.HTTPError as e:
            raise RPCConnectionError(f"{path} on worker {self.worker_id}: {e}") from e
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

    @on_rpc_loop
    async def create_engine(
        self, engine: str, engine_name: str | None = None, *args: Any, **kwargs: Any
    ) -> str:
        """Build ``engine`` (``"<module>.<Class>"``) on the worker; returns the engine name."""
        name = engine_name or self.worker_id
        body = await asyncio.to_thread(
            lambda: json_dumps(
                {
                    "engine": engine,
                    "engine_name": name,
                    "init_args": self._encode(list(args)),
                    "init_kwargs": self._encode(kwargs),
                }
            )
        )
        try:
            response = await self._post("/create_engine", body, CREATE_ENGINE_TIMEOUT)
        except httpx.HTTPError as e:
            raise RPCConnectionError(f"/create_engine on worker {self.worker_id}: {e}") from e
        if response.status_code == 200:
            return json_loads(response.content)["engine_name"]
        text = _error_text(response)
        detail = f"{engine} on worker {self.worker_id}: {text}"
        not_importable = text.startswith("cannot import") or "is not a TrainEngine" in text
        if response.status_code == 400 and not_importable:
            raise EngineImportError(detail)
        raise EngineCreationError(f"HTTP {response.status_code}: {detail}")

    @on_rpc_loop
    async def call_engine(
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

        def encode() -> bytes:
            return json_dumps(
                {
                    "method": method,
                    "engine_name": engine_name or self.worker_id,
                    "args": self._encode(list(args)),
                    "kwargs": self._encode(kwargs),
                    "rpc_meta": rpc_meta,
                }
            )

        # a batch of tensors is encoded off the loop (it takes a while, and other calls go
        # on); small arguments inline, saving a thread hop on every control call
        heavy = _heavy(args) or _heavy(kwargs)
        body = await asyncio.to_thread(encode) if heavy else encode()
        attempts = 0

        async def attempt() -> Answer:
            nonlocal attempts
            attempts += 1
            await self._check_liveness()
            return await self._post("/call", body, http_timeout)

        policy = RetryPolicy(attempts=max(1, max_retries), first_delay=retry_delay)
        try:
            response = await policy.acall(
                attempt, retry_on_exception=_unanswered, retry_on_result=_retryable
            )
        except httpx.TransportError as e:
            await self._check_liveness()  # a dead worker explains the failure better
            detail = f"no answer from {self.address}: {type(e).__name__}: {e}"
            raise EngineCallError(self.worker_id, method, detail, attempts) from e
        if response.status_code != 200:
            detail = f"HTTP {response.status_code}: {_error_text(response)}"
            raise EngineCallError(self.worker_id, method, detail, attempts)
        if len(response.content) <= _DECODE_INLINE_BYTES:
            return deserialize_value(json_loads(response.content).get("result"))
        return await asyncio.to_thread(
            lambda: deserialize_value(json_loads(response.content).get("result"))
        )
