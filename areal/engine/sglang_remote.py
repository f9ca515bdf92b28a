"""Client of inference servers that speak SGLang's native HTTP API.

``RemoteSGLangEngine`` drives SGLang servers (backend ``sglang``) and this port's embedded
server (backend ``hf``) with the same requests: ``/generate`` with token ids and
log-probs, pause and continue, abort, weight updates from disk or over NCCL, memory
release. ``agenerate`` is *interruptible*: when a weight update aborts a request, the
partial output is kept and generation continues from it on the new weights, each token
tagged with the version that produced it.

Every call to a server carries ``Authorization: Bearer <key>`` (SGLang's ``--api-key``
check; the embedded server applies the same). The key is ``AREAL_INFERENCE_API_KEY`` when
that is set (one key per run, for servers this process did not start); otherwise the
engine makes one when it first launches a server, so each rollout worker's servers have
their own. It reaches servers and proxies through their environment, never their argv.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import random
import secrets
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import orjson

from areal.api.cli_args import InferenceEngineConfig
from areal.api.engine_api import InferenceEngine
from areal.api.io_struct import (
    HttpRequest,
    LocalInfServerInfo,
    ModelRequest,
    ModelResponse,
    ParamSpec,
    WeightUpdateMeta,
)
from areal.engine.sglang_backend import HFBackend, SGLangBackend
from areal.engine.stop_strings import ClientStops, split_stop_strings
from areal.inference.auth import API_KEY_ENV
from areal.infra import workflow_context
from areal.infra.rpc.secret_env import public_environ
from areal.infra.weight_barrier import BarrierState
from areal.infra.workflow_executor import WorkflowExecutor
from areal.utils import logging, name_resolve, names
from areal.utils.lifeline import child_env
from areal.utils.network import find_free_port, gethostip, httpx_transport, wait_healthy
from areal.utils.secrets import SecretStr, refuse_printed_form, reveal

__all__ = ["HFBackend", "RemoteInfEngine", "RemoteSGLangEngine", "SGLangBackend"]

logger = logging.getLogger("engine.remote")

DONE_REASONS = ("stop", "tool_calls", "length")
STICKY_RIDS = 128
AUTH_FAILURES = (401, 403)  # retrying cannot help: the key is wrong or missing
# how much longer than rollout.weight_update_group_timeout a join's answer may take
JOIN_ANSWER_SLACK_S = 10.0


def _auth_error(address: str, endpoint: str, status: int) -> RuntimeError:
    return RuntimeError(
        f"{endpoint} on {address}: HTTP {status}: the inference server refused this "
        f"client's API key; set {API_KEY_ENV} to the key the server was started with"
    )


class RemoteInfEngine(InferenceEngine):
    """An inference engine over HTTP servers (see the module docstring)."""

    def __init__(self, config: InferenceEngineConfig, backend: SGLangBackend):
        self.config = config
        self.backend = backend
        self.addresses: list[str] = []
        self.local_servers: list[LocalInfServerInfo] = []
        self.local_proxies: list[LocalInfServerInfo] = []
        self._destroy_callbacks: dict[str, Callable[[], Any]] = {}
        # the one pause and version source of this worker, read by its proxies too
        self.barrier = BarrierState()
        self._servers_held = False  # paused by this engine's begin_weight_update
        self._warned_weight_version = False
        self._server_index = 0
        self._sticky: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=8, thread_name_prefix="infer-ops"
        )
        self.workflow_executor: WorkflowExecutor | None = None
        self._control_client: httpx.Client | None = None
        self._control_lock = threading.Lock()
        self._initialized = False
        given = refuse_printed_form(os.environ.get(API_KEY_ENV), f"${API_KEY_ENV}")
        self._api_key = SecretStr(given.strip())
        self._tokenizerless: set[str] = set()  # servers run with skip_tokenizer_init
        logging.register_secret(self._api_key)

    # --- authentication ---

    @property
    def api_key(self) -> SecretStr:
        """The key sent to every server (empty until one is set or generated)."""
        return self._api_key

    def _ensure_api_key(self) -> str:
        """The key, generated on first need (one per engine, i.e. per rollout worker)."""
        if not self._api_key:
            self._api_key = SecretStr(secrets.token_urlsafe(32))
            logging.register_secret(self._api_key)
        return reveal(self._api_key)

    def _http(self) -> httpx.Client:
        """One keep-alive client for the control requests to servers and proxies (pause,
        weight updates, versions, stats): a client per request costs a TLS context and a
        connection each time."""
        with self._control_lock:
            if self._control_client is None:
                self._control_client = httpx.Client(transport=httpx_transport(), trust_env=False)
            return self._control_client

    def _auth_headers(self) -> dict[str, str]:
        key = reveal(self._api_key)
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _check_api_key(self, address: str) -> None:
        """Fail now, not at the first generation, if ``address`` refuses this client.

        ``/health`` stays open on SGLang and the embedded server, so a protected route is
        asked: ``/get_model_info``, which both serve.
        """
        try:
            status = (
                self._http()
                .get(f"http://{address}/get_model_info", headers=self._auth_headers(), timeout=30)
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
            response = self._http().get(
                f"http://{address}/get_server_info", headers=self._auth_headers(), timeout=30
            )
            info = response.json() if response.status_code == 200 else {}
        except (httpx.HTTPError, ValueError) as e:
            logger.warning("could not read the server info of %s: %s", address, e)
            return
        if isinstance(info, dict) and info.get("skip_tokenizer_init"):
            self._tokenizerless.add(address)

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

    # --- lifecycle ---

    def initialize(
        self,
        engine_id: str | None = None,
        addr: str | list[str] | None = None,
        train_data_parallel_size: int | None = None,
    ) -> None:
        self.addresses = self._discover(addr)
        for address in self.addresses:
            self._wait_healthy(address)
            self._check_api_key(address)
            self._learn_tokenizer(address)
        self._server_index = random.randrange(len(self.addresses))
        self.workflow_executor = WorkflowExecutor(self.config, self)
        self.workflow_executor.initialize()
        self._initialized = True
        logger.info(
            "inference engine ready on %d server(s): %s", len(self.addresses), self.addresses
        )

    def _discover(self, addr: str | list[str] | None) -> list[str]:
        if addr:
            return [addr] if isinstance(addr, str) else list(addr)
        if self.local_servers:
            return [s.address for s in self.local_servers]
        if self.config.experiment_name and self.config.trial_name:
            try:
                key = names.gen_servers(self.config.experiment_name, self.config.trial_name)
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

    def _wait_healthy(self, address: str, process: subprocess.Popen | None = None) -> None:
        last_log = [time.monotonic()]

        def progress() -> None:
            if time.monotonic() - last_log[0] > 60:
                logger.info("waiting for inference server %s", address)
                last_log[0] = time.monotonic()

        wait_healthy(address, process, self.config.setup_timeout, "inference server", progress)

    def register_destroy_callback(self, key: str, fn: Callable[[], Any]) -> bool:
        """Run ``fn`` at :meth:`destroy` (agents release per-worker resources with it).

        The first callback per ``key`` wins; returns whether this one was registered.
        """
        if key in self._destroy_callbacks:
            return False
        self._destroy_callbacks[key] = fn
        return True

    def _run_destroy_callbacks(self) -> None:
        callbacks, self._destroy_callbacks = self._destroy_callbacks, {}
        for key, fn in callbacks.items():
            try:
                fn()
            except Exception:
                logger.exception("destroy callback %s failed", key)

    def destroy(self) -> None:
        # rollouts first: cancelled ones release what they hold (Arena routes) before the
        # callbacks delete it
        if self.workflow_executor is not None:
            self.workflow_executor.destroy()
            self.workflow_executor = None
        self._run_destroy_callbacks()
        self.teardown_server()
        self.barrier.close()  # its proxies are gone
        with self._control_lock:
            if self._control_client is not None:
                self._control_client.close()
                self._control_client = None
        self._pool.shutdown(wait=False)
        self._initialized = False

    @property
    def initialized(self) -> bool:
        return self._initialized

    def launch_server(self, server_args: dict[str, Any]) -> LocalInfServerInfo:
        """Start one local server; ``host``/``port`` are filled in when absent."""
        args = dict(server_args)
        if "api_key" in args:
            raise ValueError(
                f"server_args must not hold api_key: the key goes through {API_KEY_ENV}, "
                "never the server's command line"
            )
        if self.backend.name == "hf":  # the embedded server bounds its joins itself
            args.setdefault("weight_update_group_timeout", self.config.weight_update_group_timeout)
        args.setdefault("host", gethostip())
        args["port"] = args.get("port") or find_free_port()
        env = public_environ()  # none of this worker's secrets but the server's own key
        env["TRITON_CACHE_PATH"] = os.path.join(
            os.environ.get("AREAL_CACHE_DIR", f"/tmp/areal-{os.getuid()}"),
            f"triton-{uuid.uuid4().hex[:8]}",
        )
        env[API_KEY_ENV] = self._ensure_api_key()
        command = self.backend.launch_command(args, api_key_from_env=True)
        info = self._start_healthy(command, env, args["host"], int(args["port"]))
        self.local_servers.append(info)
        return info

    def _start_healthy(
        self, command: list[str], env: dict[str, str], host: str, port: int
    ) -> LocalInfServerInfo:
        """Start a child HTTP service and wait for its ``/health`` (killed on failure)."""
        process = subprocess.Popen(command, env=child_env(env))
        info = LocalInfServerInfo(host=host, port=port, process=process)
        try:
            self._wait_healthy(info.address, process)
        except BaseException:
            process.kill()
            process.wait()
            raise
        return info

    def launch_local_server(self, server_args: dict[str, Any]) -> str:
        """:meth:`launch_server`, returning only the ``host:port`` (for remote callers)."""
        return self.launch_server(server_args).address

    def launch_proxy(self, tokenizer_path: str, expected_temperature: float | None = None) -> str:
        """Start a rollout proxy in front of this engine's first server (§5.1).

        The proxy runs ``python -m areal.proxy.server`` as a child of this process, with
        the admin key of ``config.agent`` in its environment (never on argv), and follows
        this engine's weight-update barrier (it reads the barrier's state file, see
        :mod:`areal.infra.weight_barrier`). ``expected_temperature`` is
        ``actor.temperature``: requests sampled at another one are counted
        (``proxy/sampling_temperature_mismatch``) and warned about once. Returns
        ``http://host:port``.
        """
        import sys

        from areal.proxy.plugins import load_message_preprocessors, load_prefix_matcher
        from areal.utils.secrets import reveal

        agent = self.config.agent
        admin = reveal(getattr(agent, "admin_api_key", "") or "")
        if not admin.strip():
            raise ValueError(
                "rollout.agent.admin_api_key is empty; agent workflows run through the "
                "rollout proxy, which needs an admin key: the trainer generates one per run "
                "(areal.proxy.keys.ensure_run_admin_keys); set it (e.g. "
                "${oc.env:SWE_RL_ADMIN_API_KEY}) when driving the engine directly"
            )
        if not self.addresses:
            raise RuntimeError("initialize() the inference engine before launch_proxy()")
        host, port = gethostip(), find_free_port()
        cmd = [
            sys.executable,
            "-m",
            "areal.proxy.server",
            "--host",
            host,
            "--port",
            str(port),
            "--engine-addr",
            self.addresses[0],
            "--tokenizer-path",
            tokenizer_path,
            "--tool-call-parser",
            agent.tool_call_parser,
            "--reasoning-parser",
            agent.reasoning_parser,
            "--chat-template-type",
            agent.chat_template_type,
            "--request-timeout",
            str(self.config.request_timeout),
            "--session-timeout",
            str(getattr(agent, "session_timeout_seconds", 3600)),
            "--max-body-bytes",
            str(agent.max_body_bytes),
            "--export-timeout",
            str(agent.export_timeout_seconds),
        ]
        if agent.engine_max_tokens is not None:  # caps prompt + completion of every call
            cmd += ["--engine-max-tokens", str(agent.engine_max_tokens)]
        if expected_temperature is not None:
            cmd += ["--expected-temperature", str(float(expected_temperature))]
        if self.config.deterministic_sampling:
            cmd += ["--deterministic-sampling"]
        # Plugins are imported here first, so a bad path fails naming its config field.
        load_message_preprocessors(agent.message_preprocessors or [])
        load_prefix_matcher(agent.prefix_matcher)
        for path in agent.message_preprocessors or []:
            cmd += ["--message-preprocessor", path]
        if agent.prefix_matcher:
            cmd += ["--prefix-matcher", agent.prefix_matcher]
        cmd += ["--barrier-state", self.barrier.path]
        # the proxy's secrets: its admin key, and the key of the server it calls
        env = {**public_environ(), "SWE_RL_ADMIN_API_KEY": admin}
        if self._api_key:  # the proxy's own engine client reads it (RemoteSGLangEngine)
            env[API_KEY_ENV] = reveal(self._api_key)
        info = self._start_healthy(cmd, env, host, port)
        self.local_proxies.append(info)
        return f"http://{info.address}"

    def attach_barrier(self, path: str) -> None:
        """Follow another process's barrier (a proxy follows its rollout worker's); call
        before :meth:`initialize`."""
        if self.workflow_executor is not None:
            raise RuntimeError("attach_barrier() before initialize()")
        self.barrier.close()
        self.barrier = BarrierState.attach(path)

    def teardown_server(self) -> None:
        servers = [*self.local_proxies, *self.local_servers]
        for server in servers:
            server.process.terminate()
        for server in servers:
            try:
                server.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.process.kill()
        self.local_servers = []
        self.local_proxies = []

    # --- the weight-update barrier (the one pause path) and versions ---

    def begin_weight_update(self, version: int) -> None:
        """Close the barrier: no rollout starts and no generation request is sent here or
        by this worker's proxies; then the servers pause, aborting what is in flight (an
        interrupted ``agenerate`` keeps its partial output and goes on after
        :meth:`end_weight_update`). Closing again is a no-op."""
        if self.barrier.closed:
            return
        self.barrier.begin()
        self._servers_held = True
        self._pause_servers()

    def resume_serving(self) -> None:
        """The servers hold the new weights: they serve direct requests again (probes,
        the weight-sync check). Rollouts stay held until :meth:`end_weight_update`."""
        if self._servers_held:
            self._continue_servers()
            self._servers_held = False

    def end_weight_update(self, version: int) -> None:
        """Set ``version`` on the servers (their weight version) and here (read by the
        executor, ``agenerate`` and the proxies), let the servers serve, open the barrier.

        Servers this engine did not pause (shared with another rollout controller) only
        get the version."""
        self._set_server_weight_version(version)
        self.resume_serving()
        self.barrier.end(version)
        if self.workflow_executor is not None:
            self.workflow_executor.notify()

    def set_version(self, version: int) -> None:
        """Set the version without opening or closing the barrier."""
        self.barrier.set_version(version)
        if self.workflow_executor is not None:
            self.workflow_executor.notify()

    def get_version(self) -> int:
        return self.barrier.version

    def _executor(self) -> WorkflowExecutor:
        if self.workflow_executor is None:
            raise RuntimeError("initialize() the inference engine first")
        return self.workflow_executor

    # --- generation ---

    def _choose_server(self, rid: str) -> str:
        if rid in self._sticky:
            self._sticky.move_to_end(rid)
            return self._sticky[rid]
        address = self.addresses[self._server_index % len(self.addresses)]
        self._server_index += 1
        self._sticky[rid] = address
        if len(self._sticky) > STICKY_RIDS:
            self._sticky.popitem(last=False)
        return address

    async def _post_json(
        self, address: str, request: HttpRequest, retries: int, timeout: float
    ) -> Any:
        pool = workflow_context.get_http_pool()
        body = orjson.dumps(request.payload)
        headers = self._auth_headers()
        last: Exception | None = None
        for attempt in range(retries):
            try:
                status, raw = await pool.request(
                    request.method, address, request.endpoint, body, timeout, headers=headers
                )
            except (ConnectionError, TimeoutError) as e:
                last = e
            else:
                if status in AUTH_FAILURES:
                    raise _auth_error(address, request.endpoint, status)
                if status < 300:
                    try:
                        return orjson.loads(raw)
                    except orjson.JSONDecodeError as e:
                        last = e
                else:
                    text = raw[:500].decode(errors="replace")
                    last = RuntimeError(f"{request.endpoint} on {address}: HTTP {status}: {text}")
            if attempt < retries - 1:
                await asyncio.sleep(1)
        raise RuntimeError(
            f"{request.endpoint} on {address} failed after {retries} attempts: {last}"
        )

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
        address = self._choose_server(req.rid)
        sent, stops = self._server_sampling(address, g, req.tokenizer)
        input_ids = list(req.input_ids)
        tokens: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        reason = "abort"
        while reason not in DONE_REASONS and len(tokens) < budget:
            version = await self.barrier.wait_open()  # held while weights are updated
            request = self.backend.build_generation_request(
                ModelRequest(
                    input_ids=input_ids, gconfig=sent, rid=req.rid, image_data=req.image_data
                ),
                max_new_tokens=budget - len(tokens),
                version=version,
                with_lora=self.config.use_lora,
            )
            response = await self._post_json(
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

    def _fan_out(self, requests: list[HttpRequest], retries: int) -> None:
        """Send each request (in order) to every server concurrently."""

        def send(address: str) -> None:
            for request in requests:
                last: Exception | None = None
                for attempt in range(retries):
                    try:
                        response = self._http().post(
                            f"http://{address}{request.endpoint}",
                            json=request.payload,
                            headers=self._auth_headers(),
                            timeout=self.config.request_timeout,
                        )
                        if response.status_code in AUTH_FAILURES:
                            raise _auth_error(address, request.endpoint, response.status_code)
                        if response.status_code < 300:
                            break
                        last = RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
                    except httpx.HTTPError as e:
                        last = e
                    if attempt < retries - 1:
                        time.sleep(1)
                else:
                    raise RuntimeError(f"{request.endpoint} on {address} failed: {last}")

        futures = [self._pool.submit(send, address) for address in self.addresses]
        for future in futures:
            future.result()

    def _pause_servers(self) -> None:
        """Abort in-flight requests on every server and hold new ones."""
        self._fan_out(self.backend.pause_requests(), self.config.request_retries)
        if self.config.pause_grace_period:
            time.sleep(self.config.pause_grace_period)

    def _continue_servers(self) -> None:
        self._fan_out([self.backend.continue_request()], self.config.request_retries)

    def _set_server_weight_version(self, version: int) -> None:
        """Every server's weight version (SGLang ``/update_weight_version``); a server
        without the route is warned about once: tokens are tagged from the barrier."""
        try:
            self._fan_out([self.backend.weight_version_request(version)], retries=1)
        except RuntimeError as e:
            if not self._warned_weight_version:
                self._warned_weight_version = True
                logger.warning("could not set the servers' weight version: %s", e)

    def abort_all(self) -> None:
        self._fan_out([self.backend.abort_all_request()], self.config.request_retries)

    def offload(self, tags: list[str] | None = None) -> None:
        self._fan_out([self.backend.offload_request(tags)], self.config.request_retries)

    def onload(self, tags: list[str] | None = None) -> None:
        self._fan_out([self.backend.onload_request(tags)], self.config.request_retries)

    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> concurrent.futures.Future:
        """Load ``meta.path`` on every server once the trainer has published it."""

        def run() -> None:
            exp, trial = self.config.experiment_name, self.config.trial_name
            if exp and trial and meta.version is not None:
                # first polls every few milliseconds: a small model's save takes tens of
                # them, and the gap between the save and the look is paid every update
                name_resolve.wait(
                    names.update_weights_from_disk(exp, trial, meta.version),
                    timeout=120,
                    first_interval=0.005,
                )
            self._fan_out(
                self.backend.build_disk_weight_update_requests(meta).requests,
                self.config.request_retries,
            )

        return self._pool.submit(run)

    def init_weights_update_group(
        self, meta: WeightUpdateMeta, first_server_index: int = 0
    ) -> concurrent.futures.Future:
        """Every server joins the trainer's weight-update group (one try each, concurrently).

        This engine's servers are numbered ``first_server_index, first_server_index + 1,
        ...`` among all ``meta.gen_n_servers`` rollout servers (a controller with several
        rollout workers gives each worker its own start), which fixes their group ranks.
        """

        def run() -> None:
            requests = {
                address: self.backend.build_init_weights_group_request(first_server_index + i, meta)
                for i, address in enumerate(self.addresses)
            }
            # an embedded server answers by its own bound (the same setting); SGLang has none
            self._send_once(
                requests, timeout=self.config.weight_update_group_timeout + JOIN_ANSWER_SLACK_S
            )

        return self._pool.submit(run)

    def update_weights_from_distributed(
        self, meta: WeightUpdateMeta, param_specs: list[ParamSpec]
    ) -> concurrent.futures.Future:
        """Every server receives one bucket of broadcast tensors (one try)."""

        def run() -> None:
            request = self.backend.build_distributed_weight_update_requests(
                meta, param_specs
            ).requests[0]
            self._send_once({address: request for address in self.addresses})

        return self._pool.submit(run)

    def _send_once(self, requests: dict[str, HttpRequest], timeout: float | None = None) -> None:
        """One attempt each: a retry could not rejoin a collective operation. ``timeout``
        defaults to ``config.request_timeout``."""

        def send(address: str, request: HttpRequest) -> None:
            response = self._http().post(
                f"http://{address}{request.endpoint}",
                json=request.payload,
                headers=self._auth_headers(),
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

    # --- rollouts (delegated to the workflow executor) ---

    def submit(
        self, data: Any, workflow: Any, workflow_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> int:
        return self._executor().submit(data, workflow, workflow_kwargs, **kwargs)

    def wait(
        self, count: int, timeout: float | None = None, raise_timeout: bool = True
    ) -> list[Any]:
        return self._executor().wait(count, timeout=timeout, raise_timeout=raise_timeout)

    def wait_for_task(
        self, task_id: int, timeout: float | None = None, raise_timeout: bool = True
    ) -> Any:
        return self._executor().wait_for_task(task_id, timeout=timeout, raise_timeout=raise_timeout)

    def collect_finished(
        self, ack: list[int] | None = None, timeout: float = 1.0
    ) -> concurrent.futures.Future:
        """Finished rollouts, long-polled by the rollout controller (see
        :meth:`WorkflowExecutor.collect_finished`). A future, so the RPC server waits for
        it off its engine thread and other calls to this worker go on meanwhile."""
        executor = self._executor()
        return self._pool.submit(executor.collect_finished, list(ack or ()), timeout)

    def rollout_batch(
        self,
        data: list[Any],
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        return self._executor().rollout_batch(data, workflow, workflow_kwargs, **kwargs)

    def prepare_batch(
        self,
        dataloader: Any,
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        return self._executor().prepare_batch(dataloader, workflow, workflow_kwargs, **kwargs)

    def export_stats(self) -> dict[str, float]:
        """This worker's ``rollout`` stats and its proxies' (``proxy/*``), mergeable."""
        from areal.utils import stats_tracker

        exports = [stats_tracker.get("rollout").export(mergeable=True)]
        exports += self._proxy_stats()
        return exports[0] if len(exports) == 1 else combine_mergeable(exports)

    def _proxy_stats(self) -> list[dict[str, float]]:
        """What each launched proxy recorded since the last call; a proxy that cannot
        answer costs its metrics of this step, never the step."""
        if not self.local_proxies:
            return []
        headers = {"Authorization": f"Bearer {reveal(self.config.agent.admin_api_key)}"}
        out = []
        for proxy in self.local_proxies:
            try:
                response = self._http().post(
                    f"http://{proxy.address}/rl/stats", headers=headers, timeout=30
                )
                response.raise_for_status()
                out.append(dict(response.json()["stats"]))
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
                logger.warning("no stats from the proxy on %s this step: %s", proxy.address, e)
        return out


class RemoteSGLangEngine(RemoteInfEngine):
    """The engine the YAMLs name: SGLang servers, or the embedded server for ``hf``."""

    def __init__(self, config: InferenceEngineConfig, backend: SGLangBackend | None = None):
        if backend is None:
            backend = HFBackend() if _backend_kind(config.backend) == "hf" else SGLangBackend()
        super().__init__(config, backend)


def combine_mergeable(exports: list[dict[str, float]]) -> dict[str, float]:
    """Several ``export(mergeable=True)`` results as one, still mergeable: the values of
    ``stats_tracker.merge_exports`` with each key's tag (counts summed) kept."""
    from areal.utils import stats_tracker

    merged = stats_tracker.merge_exports(exports)
    out = dict(merged)
    for key in merged:
        for tag in ("__count", "__sum", "__min", "__max"):
            weights = [e[key + tag] for e in exports if key + tag in e]
            if weights:
                out[key + tag] = sum(weights) if tag == "__count" else 1.0
                break
    return out


def _backend_kind(backend: str) -> str:
    """``hf`` or ``sglang`` from an allocation string (``sglang`` when it is not set)."""
    from areal.api.alloc_mode import ModelAllocation

    if not isinstance(backend, str) or ":" not in backend:
        return "sglang"
    return ModelAllocation.from_str(backend).backend
