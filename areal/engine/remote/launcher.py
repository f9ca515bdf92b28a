"""Starts and stops a rollout worker's own inference servers and rollout proxies."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from typing import Any

from areal.api.cli_args import InferenceEngineConfig
from areal.api.io_struct import LocalInfServerInfo
from areal.engine.remote.server_client import InferenceServerClient
from areal.engine.sglang_backend import SGLangBackend
from areal.inference.auth import API_KEY_ENV
from areal.infra.rpc.secret_env import public_environ
from areal.utils import logging
from areal.utils.lifeline import child_env
from areal.utils.network import find_free_port, gethostip
from areal.utils.secrets import reveal

__all__ = ["ServerLauncher"]

logger = logging.getLogger("engine.remote")


class ServerLauncher:
    """The child processes of one rollout worker (servers, proxies) and what runs when
    the worker is destroyed.

    Children get their secrets through their environment, never their argv: a server its
    API key (the ``client``'s, generated on the first launch), a proxy its admin key.
    """

    def __init__(
        self, config: InferenceEngineConfig, backend: SGLangBackend, client: InferenceServerClient
    ):
        self.config = config
        self.backend = backend
        self.client = client
        self.local_servers: list[LocalInfServerInfo] = []
        self.local_proxies: list[LocalInfServerInfo] = []
        self._destroy_callbacks: dict[str, Callable[[], Any]] = {}

    # --- servers ---

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
        env[API_KEY_ENV] = self.client.ensure_api_key()
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
            self.client.wait_healthy(info.address, process)
        except BaseException:
            process.kill()
            process.wait()
            raise
        return info

    # --- proxies ---

    def launch_proxy(
        self, tokenizer_path: str, expected_temperature: float | None, barrier_path: str
    ) -> str:
        """Start a rollout proxy in front of the client's first server; ``http://host:port``.

        The proxy runs ``python -m areal.proxy.server`` as a child of this process, with
        the admin key of ``config.agent`` in its environment, and follows the barrier
        whose state file is ``barrier_path`` (:mod:`areal.infra.weight_barrier`).
        ``expected_temperature`` is ``actor.temperature``: requests sampled at another
        one are counted (``proxy/sampling_temperature_mismatch``) and warned about once.
        """
        from areal.proxy.plugins import load_message_preprocessors, load_prefix_matcher

        agent = self.config.agent
        admin = reveal(getattr(agent, "admin_api_key", "") or "")
        if not admin.strip():
            raise ValueError(
                "rollout.agent.admin_api_key is empty; agent workflows run through the "
                "rollout proxy, which needs an admin key: the trainer generates one per run "
                "(areal.proxy.keys.ensure_run_admin_keys); set it (e.g. "
                "${oc.env:SWE_RL_ADMIN_API_KEY}) when driving the engine directly"
            )
        if not self.client.addresses:
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
            self.client.addresses[0],
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
        cmd += ["--barrier-state", barrier_path]
        # the proxy's secrets: its admin key, and the key of the server it calls
        env = {**public_environ(), "SWE_RL_ADMIN_API_KEY": admin}
        if self.client.api_key:  # the proxy's own engine client reads it (RemoteSGLangEngine)
            env[API_KEY_ENV] = reveal(self.client.api_key)
        info = self._start_healthy(cmd, env, host, port)
        self.local_proxies.append(info)
        return f"http://{info.address}"

    # --- teardown ---

    def teardown(self) -> None:
        """Stop every proxy and server this worker started (killed after 30 s)."""
        children = [*self.local_proxies, *self.local_servers]
        for child in children:
            child.process.terminate()
        for child in children:
            try:
                child.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.process.kill()
        self.local_servers = []
        self.local_proxies = []

    def register_destroy_callback(self, key: str, fn: Callable[[], Any]) -> bool:
        """Run ``fn`` at :meth:`run_destroy_callbacks`; the first callback per ``key`` wins.
        Returns whether this one was registered."""
        if key in self._destroy_callbacks:
            return False
        self._destroy_callbacks[key] = fn
        return True

    def run_destroy_callbacks(self) -> None:
        """Each registered callback once (a failing one is logged, the others still run)."""
        callbacks, self._destroy_callbacks = self._destroy_callbacks, {}
        for key, fn in callbacks.items():
            try:
                fn()
            except Exception:
                logger.exception("destroy callback %s failed", key)
