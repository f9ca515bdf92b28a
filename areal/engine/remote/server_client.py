"""HTTP client of a rollout worker's inference servers: auth, server choice, generation, fan-out."""

from __future__ import annotations

import collections
import concurrent.futures
import os
import random
import secrets
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from areal.api.cli_args import InferenceEngineConfig
from areal.api.io_struct import HttpRequest, ModelRequest, ModelResponse
from areal.engine.sglang_backend import SGLangBackend
from areal.engine.stop_strings import ClientStops, split_stop_strings
from areal.inference.auth import API_KEY_ENV
from areal.infra import workflow_context
from areal.infra.weight_barrier import BarrierState
from areal.utils import logging, name_resolve, names
from areal.utils.network import httpx_transport, wait_healthy
from areal.utils.retry import RetryPolicy
from areal.utils.secrets import SecretStr, refuse_printed_form, reveal

__all__ = ["AUTH_FAILURES", "InferenceServerClient", "discover_servers"]

logger = logging.getLogger("engine.remote")

DONE_REASONS = ("stop", "tool_calls", "length")
STICKY_RIDS = 128  # rids remembered for sticky routing
AUTH_FAILURES = (401, 403)  # retrying cannot help: the key is wrong or missing
RETRY_DELAY_S = 1.0  # between attempts of a request to a server (a fixed wait)


class _RetryableError(Exception):
    """A failed attempt worth another: a transport error, a bad status, an unreadable body."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def _worth_retrying(error: BaseException) -> bool:
    return isinstance(error, _RetryableError)


def _retry_policy(attempts: int) -> RetryPolicy:
    return RetryPolicy(attempts=attempts, first_delay=RETRY_DELAY_S, multiplier=1.0)


def _auth_error(address: str, endpoint: str, status: int) -> RuntimeError:
    return RuntimeError(
        f"{endpoint} on {address}: HTTP {status}: the inference server refused this "
        f"client's API key; set {API_KEY_ENV} to the key the server was started with"
    )


def discover_servers(
    config: InferenceEngineConfig, addr: str | list[str] | None, launched: list[str]
) -> list[str]:
    """The servers to use: ``addr``, else those this worker launched, else the ones
    registered under the experiment and trial, else ``$AREAL_LLM_SERVER_ADDRS``."""
    if addr:
        return [addr] if isinstance(addr, str) else list(addr)
    if launched:
        return list(launched)
    if config.experiment_name and config.trial_name:
        try:
            key = names.gen_servers(config.experiment_name, config.trial_name)
            name_resolve.wait(key + "/0", timeout=1)
            found = name_resolve.get_subtree(key)
            if found:
                return found
        except (TimeoutError, KeyError, OSError):
            pass
    env = os.environ.get("AREAL_LLM_SERVER_ADDRS", "")
    if env.strip():
        return [a.strip() for a in env.split(",") if a.strip()]
    raise RuntimeError(
        "no inference server address: pass addr=, launch servers, or set AREAL_LLM_SERVER_ADDRS"
    )


class InferenceServerClient:
    """Requests to one rollout worker's servers (``addresses``), each with the API key.

    ``barrier`` returns the worker's weight-update barrier: generation waits while it is
    closed. ``pool`` runs the fan-out of a request to every server.
    """

    def __init__(
        self,
        config: InferenceEngineConfig,
        backend: SGLangBackend,
        barrier: Callable[[], BarrierState],
        pool: concurrent.futures.ThreadPoolExecutor,
    ):
        self.config = config
        self.backend = backend
        self.addresses: list[str] = []
        self._barrier = barrier
        self._pool = pool
        self._server_index = 0
        self._sticky: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._tokenizerless: set[str] = set()  # servers run with skip_tokenizer_init
        self._warned_weight_version = False
        self._control_client: httpx.Client | None = None
        self._control_lock = threading.Lock()
        given = refuse_printed_form(os.environ.get(API_KEY_ENV), f"${API_KEY_ENV}")
        self._api_key = SecretStr(given.strip())
        logging.register_secret(self._api_key)

    # --- authentication and the control connection ---

    @property
    def api_key(self) -> SecretStr:
        """The key sent to every server (empty until one is set or generated)."""
        return self._api_key

    def ensure_api_key(self) -> str:
        """The key, generated on first need (one per client, i.e. per rollout worker)."""
        if not self._api_key:
            self._api_key = SecretStr(secrets.token_urlsafe(32))
            logging.register_secret(self._api_key)
        return reveal(self._api_key)

    def auth_headers(self) -> dict[str, str]:
        key = reveal(self._api_key)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def http(self) -> httpx.Client:
        """One keep-alive client for the control requests to servers and proxies (pause,
        weight updates, versions, stats): a client per request costs a TLS context and a
        connection each time."""
        with self._control_lock:
            if self._control_client is None:
                self._control_client = httpx.Client(transport=httpx_transport(), trust_env=False)
            return self._control_client

    def close(self) -> None:
        with self._control_lock:
            if self._control_client is not None:
                self._control_client.close()
                self._control_client = None

    # --- connecting ---

    def connect(self, addresses: list[str]) -> None:
        """Use ``addresses``: each must be healthy and accept the key."""
        self.addresses = list(addresses)
        for address in self.addresses:
            self.wait_healthy(address)
            self._check_api_key(address)
            self._learn_tokenizer(address)
        self._server_index = random.randrange(len(self.addresses))

    def wait_healthy(self, address: str, process: subprocess.Popen | None = None) -> None:
        """Wait for ``address``'s ``/health`` (``rollout.setup_timeout``), logging each minute."""
        last_log = [time.monotonic()]

        def progress() -> None:
            if time.monotonic() - last_log[0] > 60:
                logger.info("waiting for inference server %s", address)
                last_log[0] = time.monotonic()

        wait_healthy(address, process, self.config.setup_timeout, "inference server", progress)

    def _check_api_key(self, address: str) -> None:
        """Fail now, not at the first generation, if ``address`` refuses this client.

        ``/health`` stays open on SGLang and the embedded server, so a protected route is
        asked: ``/get_model_info``, which both serve.
        """
        try:
            status = (
                self.http()
                .get(f"http://{address}/get_model_info", headers=self.auth_headers(), timeout=30)
                .status_code
            )
        except httpx.HTTPError as e:
            logger.warning("could not check the API key on %s: %s", address, e)
            return
        if status in AUTH_FAILURES:
            raise _auth_error(address, "/get_model_info", status)

    def _learn_tokenizer(self, address: str) -> None:
        """Whether ``address`` runs without a tokenizer (SGLang ``skip_tokenizer_init``)."""
        try:
            response = self.http().get(
                f"http://{address}/get_server_info", headers=self.auth_headers(), timeout=30
            )
            info = response.json() if response.status_code == 200 else {}
        except (httpx.HTTPError, ValueError) as e:
            logger.warning("could not read the server info of %s: %s", address, e)
            return
        if isinstance(info, dict) and info.get("skip_tokenizer_init"):
            self._tokenizerless.add(address)

    # --- generation ---

    def choose_server(self, rid: str) -> str:
        """The server of request ``rid``: the one it went to before (among the last
        :data:`STICKY_RIDS`), else the next one round robin."""
        if rid in self._sticky:
            self._sticky.move_to_end(rid)
            return self._sticky[rid]
        address = self.addresses[self._server_index % len(self.addresses)]
        self._server_index += 1
        self._sticky[rid] = address
        if len(self._sticky) > STICKY_RIDS:
            self._sticky.popitem(last=False)
        return address

    def _server_sampling(
        self, address: str, g: Any, tokenizer: Any
    ) -> tuple[Any, ClientStops | None]:
        """What to send to ``address`` for ``g``, and the stops the client must apply.

        A server without a tokenizer refuses stop strings and ``min_new_tokens``; stop
        strings are split between it (one-token ones, as ids) and this client.
        """
        if address not in self._tokenizerless or not (g.stop or g.min_new_tokens):
            return g, None
        if g.min_new_tokens:
            raise ValueError(
                f"min_new_tokens={g.min_new_tokens} needs a server that tokenizes; {address} "
                "runs with sglang.skip_tokenizer_init (SGLang needs the tokenizer's EOS id)"
            )
        stops = split_stop_strings(list(g.stop), tokenizer)
        sent = g.new(stop=None, stop_token_ids=[*g.stop_token_ids, *stops.token_ids])
        return sent, stops

    async def post_json(
        self, address: str, request: HttpRequest, retries: int, timeout: float
    ) -> Any:
        """``request`` to ``address``, its JSON answer; ``retries`` attempts in all, a
        refused key (401/403) is never retried."""
        pool = workflow_context.get_http_pool()
        body = orjson.dumps(request.payload)
        headers = self.auth_headers()

        async def attempt() -> Any:
            try:
                status, raw = await pool.request(
                    request.method, address, request.endpoint, body, timeout, headers=headers
                )
            except (ConnectionError, TimeoutError) as e:
                raise _RetryableError(e) from e
            if status in AUTH_FAILURES:
                raise _auth_error(address, request.endpoint, status)
            if status >= 300:
                text = raw[:500].decode(errors="replace")
                raise _RetryableError(
                    RuntimeError(f"{request.endpoint} on {address}: HTTP {status}: {text}")
                )
            try:
                return orjson.loads(raw)
            except orjson.JSONDecodeError as e:
                raise _RetryableError(e) from e

        try:
            return await _retry_policy(retries).acall(attempt, retry_on_exception=_worth_retrying)
        except _RetryableError as failed:
            raise RuntimeError(
                f"{request.endpoint} on {address} failed after {retries} attempts: {failed}"
            ) from failed.error

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate for one request, surviving aborts caused by weight updates."""
        if req.gconfig.n_samples != 1:
            raise ValueError("agenerate takes one sample per request (gconfig.n_samples == 1)")
        g = req.gconfig
        budget = min(g.max_tokens - len(req.input_ids), g.max_new_tokens)
        if budget <= 0:
            raise RuntimeError(
                f"no token budget left: prompt of {len(req.input_ids)} tokens with max_tokens "
                f"{g.max_tokens}"
            )
        start = time.perf_counter()
        address = self.choose_server(req.rid)
        sent, stops = self._server_sampling(address, g, req.tokenizer)
        input_ids = list(req.input_ids)
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        reason = "abort"
        while reason not in DONE_REASONS and len(tokens) < budget:
            version = await self._barrier().wait_open()  # held while weights are updated
            request = self.backend.build_generation_request(
                ModelRequest(
                    input_ids=input_ids, gconfig=sent, rid=req.rid, image_data=req.image_data
                ),
                max_new_tokens=budget - len(tokens),
                version=version,
                with_lora=self.config.use_lora,
            )
            response = await self.post_json(
                address, request, self.config.request_retries, self.config.request_timeout
            )
            result = self.backend.parse_generation_response(response)
            reason = result.stop_reason
            tokens += result.output_tokens
            logprobs += result.output_logprobs
            versions += [version] * len(result.output_tokens)
            input_ids += result.output_tokens
            keep = stops.cut(tokens, req.tokenizer) if stops is not None else None
            if keep is not None:  # a stop string the server could not match
                del tokens[keep:], logprobs[keep:], versions[keep:]
                reason = "stop"
        if reason == "abort":
            reason = "length"
        latency = time.perf_counter() - start
        return ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=tokens,
            output_logprobs=logprobs,
            output_versions=versions,
            stop_reason=reason,
            latency=latency,
            ttft=latency,
            tokenizer=req.tokenizer,
            stop_token_ids=list(g.stop_token_ids),
        )

    # --- operations on every server ---

    def fan_out(self, requests: list[HttpRequest], retries: int) -> None:
        """Send each request (in order) to every server concurrently, ``retries`` attempts
        each; a refused key (401/403) is never retried."""

        def post(address: str, request: HttpRequest) -> None:
            try:
                response = self.http().post(
                    f"http://{address}{request.endpoint}",
                    json=request.payload,
                    headers=self.auth_headers(),
                    timeout=self.config.request_timeout,
                )
            except httpx.HTTPError as e:
                raise _RetryableError(e) from e
            if response.status_code in AUTH_FAILURES:
                raise _auth_error(address, request.endpoint, response.status_code)
            if response.status_code >= 300:
                text = response.text[:300]
                raise _RetryableError(RuntimeError(f"HTTP {response.status_code}: {text}"))

        def send(address: str) -> None:
            for request in requests:
                try:
                    _retry_policy(retries).call(
                        lambda r=request: post(address, r), retry_on_exception=_worth_retrying
                    )
                except _RetryableError as failed:
                    raise RuntimeError(
                        f"{request.endpoint} on {address} failed: {failed}"
                    ) from failed.error

        futures = [self._pool.submit(send, address) for address in self.addresses]
        for future in futures:
            future.result()

    def send_once(self, requests: dict[str, HttpRequest], timeout: float | None = None) -> None:
        """One attempt each (a retry could not rejoin a collective operation), concurrently.
        ``timeout`` defaults to ``config.request_timeout``."""

        def send(address: str, request: HttpRequest) -> None:
            response = self.http().post(
                f"http://{address}{request.endpoint}",
                json=request.payload,
                headers=self.auth_headers(),
                timeout=timeout or self.config.request_timeout,
            )
            if response.status_code >= 300:
                raise RuntimeError(
                    f"{request.endpoint} on {address}: HTTP {response.status_code}: "
                    f"{response.text[:300]}"
                )

        futures = [self._pool.submit(send, a, r) for a, r in requests.items()]
        for future in futures:
            future.result()

    def open_weight_session(self, begin: bool) -> None:
        """``/begin_weight_update`` (``begin``) or ``/end_weight_update`` on every server, one
        try each. A server without the route (404: SGLang before 0.5.23, which loads
        weights without a session) is skipped."""
        request = (
            self.backend.begin_weight_update_request()
            if begin
            else self.backend.end_weight_update_request()
        )

        def send(address: str) -> None:
            response = self.http().post(
                f"http://{address}{request.endpoint}",
                json=request.payload,
                headers=self.auth_headers(),
                timeout=self.config.request_timeout,
            )
            if response.status_code == 404:
                return
            if response.status_code >= 300:
                raise RuntimeError(
                    f"{request.endpoint} on {address}: HTTP {response.status_code}: "
                    f"{response.text[:300]}"
                )

        for future in [self._pool.submit(send, address) for address in self.addresses]:
            future.result()

    def pause_servers(self) -> None:
        """Abort in-flight requests on every server and hold new ones."""
        self.fan_out(self.backend.pause_requests(), self.config.request_retries)
        if self.config.pause_grace_period:
            time.sleep(self.config.pause_grace_period)

    def continue_servers(self) -> None:
        self.fan_out([self.backend.continue_request()], self.config.request_retries)

    def set_weight_version(self, version: int) -> None:
        """Every server's weight version (SGLang ``/update_weight_version``); a server
        without the route is warned about once: tokens are tagged from the barrier."""
        try:
            self.fan_out([self.backend.weight_version_request(version)], retries=1)
        except RuntimeError as e:
            if not self._warned_weight_version:
                self._warned_weight_version = True
                logger.warning("could not set the servers' weight version: %s", e)

    def abort_all(self) -> None:
        self.fan_out([self.backend.abort_all_request()], self.config.request_retries)

    def offload(self, tags: list[str] | None = None) -> None:
        self.fan_out([self.backend.offload_request(tags)], self.config.request_retries)

    def onload(self, tags: list[str] | None = None) -> None:
        self.fan_out([self.backend.onload_request(tags)], self.config.request_retries)
