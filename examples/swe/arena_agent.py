"""``ArenaStreamAgentWorkflow``: one Arena task per rollout, its top-level score as the reward.

The agent is hosted by the rollout proxy workflow (:mod:`areal.proxy.workflow`), which
opens a proxy session per sample and calls ``run(data, **AgentRunKwargs)``. ``run`` makes
the proxy reachable to Arena, launches one task for the row, waits for it within the
episode timeout and turns the task's top-level ``score`` into the RL reward.

Route modes (``econfig.arena_llm_route_mode``), i.e. how the Harness reaches the proxy:

* ``gateway``: one Arena LLM route per rollout, registered with the session's key and
  kept alive by a renewal loop (routes must outlive long generation pauses).
* ``session_gateway``: one route per rollout worker, registered with the generation-only
  gateway key; each task proves its session with ``X-Session-Id`` / ``X-Session-Token``
  headers. This avoids a control-plane registration per sample.
* ``direct``: no registration; the sandbox reaches the proxy over a private network.

Rewards come only from the envelope's top-level ``score`` (``raw`` belongs to the
grader), mapped by the Stream's transform and threshold. Failed tasks are classified by
``classify_proxy_failure``: a model failure trains as reward 0 on the recorded
interactions, anything else rejects the sample. Every task outcome can be appended to
private JSONL audit shards (``econfig.arena_result_dump_dir``).

This module keeps the run itself; the hooks the proxy workflow calls afterwards (and the
score-to-reward mapping) live in ``arena_agent_hooks``, failure attribution in
``arena_failures``, route registration and renewal in ``arena_routes``, audit shards in
``arena_audit`` and rollout metrics in ``arena_metrics`` (all under ``examples.swe``).
"""

from __future__ import annotations

import asyncio
import math
import re
import secrets
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from areal.utils import logging
from areal.utils.dynamic_import import import_from_string
from areal.utils.secrets import redact_url, reveal
from examples.swe.arena_agent_common import bounded, clean_text, scrub_secrets
from examples.swe.arena_agent_hooks import ArenaAgentHooks, ArenaEpisode
from examples.swe.arena_client import ArenaOpenAPIClient
from examples.swe.arena_config import load_arena_stream_configs
from examples.swe.arena_failures import harness_outcome_code
from examples.swe.arena_metrics import record_arena_scalars
from examples.swe.arena_protocols import LLM_PROTOCOLS
from examples.swe.arena_results import ArenaAPIError, ArenaTaskFailedError, ArenaTaskResult
from examples.swe.arena_routes import (
    SESSION_REGISTRY_ATTR,
    SESSION_REGISTRY_CALLBACK_KEY,
    SessionGatewayRegistry,
    delete_route,
    renew_gateway_route,
    worker_session_registry,
)
from examples.swe.arena_types import ArenaStreamConfig

# The session-registry names and the dotted-path importer are re-exported: callers import
# them from here, and the agent resolves dotted paths through this module's
# ``import_from_string``, so patching it here changes what the agent imports.
__all__ = [
    "SESSION_REGISTRY_ATTR",
    "SESSION_REGISTRY_CALLBACK_KEY",
    "ArenaStreamAgentWorkflow",
    "harness_outcome_code",
    "import_from_string",
]

logger = logging.getLogger("arena.agent")

ROUTE_MODES = ("gateway", "session_gateway", "direct")
SESSION_ID_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}")


def _setting(econfig: Any, key: str, default: Any) -> Any:
    """``econfig[key]`` (a mapping or an attribute object); missing or null gives default."""
    if isinstance(econfig, Mapping):
        value = econfig.get(key)
    else:
        value = getattr(econfig, key, None)
    return default if value is None else value


# --- the agent ---


@dataclass
class _Launch:
    """What one run needs to launch its task (filled in by the route mode)."""

    data: Mapping[str, Any]
    stream: ArenaStreamConfig
    stream_id: str
    data_id: str
    protocol: str
    proxy_url: str
    api_key: str
    session_id: str
    http: Any
    episode: ArenaEpisode
    model_name: str = ""
    deployment_id: str = ""
    url: str = ""
    key: str = ""
    envs: dict[str, str] = field(default_factory=dict)
    credentials: tuple[str, ...] = ()  # the session key, gateway key and session token

    def secrets(self) -> tuple[str, ...]:
        """Every secret this run knows, for masking log text."""
        return (*self.credentials, reveal(self.key))


class ArenaStreamAgentWorkflow(ArenaAgentHooks):
    """Runs one Arena task per rollout and returns its (transformed) score.

    Hosted by :class:`areal.proxy.workflow.OpenAIProxyWorkflow`; ``run`` takes the keyword
    arguments of :class:`areal.proxy.hooks.AgentRunKwargs`. The optional
    :class:`areal.proxy.hooks.AgentHooks` come from :class:`ArenaAgentHooks`.

    Args:
        econfig: the ``econfig`` block (a mapping or ``SWEEnvConfig``).
        gen_args: sampling arguments, attached to each proxy session as metadata.
        timeout: seconds one episode may take, used when ``econfig`` has no ``timeout``.
        reject_terminal_task_failures: drop a rejected ``HARNESS_FAILED``, ``NO_OUTPUT``,
            ``TIMEOUT`` or ``EVAL_FAILED`` sample on its own (its group siblings are kept)
            instead of failing the rollout; it changes no disposition.
        arena_client: a ready client (tests inject fake transports through it); by
            default one is built from ``econfig`` and the environment.
    """

    def __init__(
        self,
        econfig: Any = None,
        gen_args: Mapping[str, Any] | None = None,
        timeout: float = 3600.0,
        reject_terminal_task_failures: bool = False,
        *,
        arena_client: ArenaOpenAPIClient | None = None,
    ):
        self.timeout = self._positive("timeout", _setting(econfig, "timeout", timeout))
        self.registration_timeout = self._positive(
            "arena_registration_timeout", _setting(econfig, "arena_registration_timeout", 180.0)
        )
        self.registration_probe_interval = self._positive(
            "arena_registration_probe_interval",
            _setting(econfig, "arena_registration_probe_interval", 60.0),
        )
        self.request_timeout = self._positive(
            "arena_request_timeout", _setting(econfig, "arena_request_timeout", 60.0)
        )
        mode = _setting(econfig, "arena_llm_route_mode", "") or "gateway"
        self.route_mode = str(mode).strip()
        if self.route_mode not in ROUTE_MODES:
            raise ValueError(
                f"econfig.arena_llm_route_mode must be one of {', '.join(ROUTE_MODES)}, "
                f"got {mode!r}"
            )
        streams = load_arena_stream_configs(econfig)
        transforms = {  # resolved eagerly: a bad path fails at construction, not mid-run
            s.name: import_from_string(s.reward_transform_fn)
            for s in streams
            if s.reward_transform_fn
        }
        max_bytes = _setting(econfig, "arena_result_dump_max_bytes", 1_000_000)
        if isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(
                f"econfig.arena_result_dump_max_bytes must be an integer > 0, got {max_bytes!r}"
            )
        super().__init__(
            streams=streams,
            transforms=transforms,
            gen_args=gen_args or {},
            reject_terminal_task_failures=reject_terminal_task_failures,
            result_dump_dir=clean_text(_setting(econfig, "arena_result_dump_dir", "")),
            result_dump_max_bytes=max_bytes,
        )
        self._session_registry = SessionGatewayRegistry(persistent=False)
        self.client = arena_client or ArenaOpenAPIClient(
            base_url=clean_text(_setting(econfig, "arena_base_url", "")),
            timeout=self.timeout,
            poll_interval=float(_setting(econfig, "arena_poll_interval", 5.0)),
            request_retries=int(_setting(econfig, "arena_request_retries", 3)),
        )

    @staticmethod
    def _positive(name: str, value: Any) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ValueError(f"econfig.{name} must be a number of seconds, got {value!r}") from None
        if not (math.isfinite(number) and number > 0):
            raise ValueError(f"econfig.{name} must be finite and positive, got {value!r}")
        return number

    # --- run ---

    async def run(self, data: Mapping[str, Any], **kwargs: Any) -> float:
        """Launch one Arena task for ``data`` and return its reward (see the module doc)."""
        session_id = clean_text(kwargs.get("session_id"))
        episode = ArenaEpisode(session_id=session_id or None)
        self._episode.set(episode)
        credentials = tuple(
            reveal(kwargs.get(name))
            for name in ("api_key", "proxy_gateway_api_key", "proxy_session_token")
        )
        try:
            return await self._run(data, kwargs, session_id, episode, credentials)
        except BaseException as error:
            scrub_secrets(error, *credentials)
            raise

    async def _run(
        self,
        data: Mapping[str, Any],
        kwargs: dict[str, Any],
        session_id: str,
        episode: ArenaEpisode,
        credentials: tuple[str, ...],
    ) -> float:
        stream = self._stream_for(data)
        row_stream_id = clean_text(data.get("stream_id"))
        if row_stream_id and stream.stream_id and row_stream_id != stream.stream_id:
            raise ValueError(
                f"row Stream mismatch: the row names stream_id {row_stream_id!r} but Stream "
                f"{stream.name!r} is {stream.stream_id!r}"
            )
        if "llm_protocol" in data:
            protocol = clean_text(data.get("llm_protocol"))
        else:
            protocol = stream.llm_protocol or "chat_completions"
        api_key, gateway_key, session_token = credentials
        launch = _Launch(
            data=data,
            stream=stream,
            stream_id=row_stream_id or stream.stream_id,
            data_id=clean_text(data.get("data_id")),
            protocol=protocol,
            proxy_url=clean_text(kwargs.get("base_url")).rstrip("/"),
            api_key=api_key,
            session_id=session_id,
            http=kwargs.get("arena_http_client") or kwargs.get("http_client"),
            episode=episode,
            credentials=credentials,
        )
        for name, value in (
            ("stream_id", launch.stream_id),
            ("data_id", launch.data_id),
            ("base_url", launch.proxy_url),
            ("api_key", launch.api_key),
        ):
            if not value:
                raise ValueError(f"{name} is required for ArenaStreamAgentWorkflow")
        if self.route_mode in ("direct", "session_gateway") and not SESSION_ID_RE.fullmatch(
            session_id
        ):
            raise ValueError(
                f"a valid session_id is required for route mode {self.route_mode!r} (1-200 "
                "characters: a letter or digit, then letters, digits, '_', '.', ':' or '-')"
            )
        if self.route_mode == "session_gateway" and not (gateway_key and session_token):
            raise ValueError(
                "route mode 'session_gateway' requires proxy_gateway_api_key and "
                "proxy_session_token from the proxy workflow"
            )
        self._check_row(data, stream, protocol)
        if stream.expected_reward_ref.key:
            await self._check_live_reward_ref(launch)

        launch.model_name = f"stream-areal-{secrets.token_hex(6)}"
        launch.deployment_id = str(uuid.uuid4())
        launch.url, launch.key = launch.proxy_url, launch.api_key
        launch.envs = dict(stream.task_envs)
        if self.route_mode == "gateway":
            return await self._run_gateway(launch)
        if self.route_mode == "session_gateway":
            return await self._run_session_gateway(
                launch, kwargs.get("worker_runtime"), gateway_key, session_token
            )
        return await self._run_direct(launch)

    @staticmethod
    def _check_row(data: Mapping[str, Any], stream: ArenaStreamConfig, protocol: str) -> None:
        pin = stream.expected_reward_ref
        if pin.key:
            row_ref = (
                clean_text(data.get("reward_ref_key")),
                clean_text(data.get("reward_ref_version")),
            )
            if row_ref != (pin.key, pin.version):
                raise ValueError(
                    f"reward_ref mismatch for Stream {stream.name!r}: the row has "
                    f"{row_ref[0]}@{row_ref[1]}, the Stream pins {pin.key}@{pin.version}"
                )
        if protocol not in LLM_PROTOCOLS:
            raise ValueError(
                f"unsupported Arena LLM protocol {protocol!r} in the row; use one of "
                f"{', '.join(LLM_PROTOCOLS)}"
            )
        if stream.llm_protocol and protocol != stream.llm_protocol:
            raise ValueError(
                f"LLM protocol mismatch: the row has {protocol!r}, Stream {stream.name!r} is "
                f"configured with {stream.llm_protocol!r}"
            )

    async def _check_live_reward_ref(self, launch: _Launch) -> None:
        """Refuse to launch when the Stream's live grader differs from the pinned one."""
        pin = launch.stream.expected_reward_ref
        try:
            live = await bounded(
                self.client.resolve_stream_async(
                    launch.stream_id, client=launch.http, timeout=self.request_timeout
                ),
                self.request_timeout,
            )
            ref = live.get("default_reward_ref")
            if not isinstance(ref, Mapping):
                raise ArenaAPIError(f"Arena Stream {launch.stream_id} has no default_reward_ref")
            actual = (ref.get("key"), ref.get("version"))
            if actual != (pin.key, pin.version):
                raise ArenaAPIError(
                    f"Arena Stream {launch.stream_id} reward_ref drifted before launch: "
                    f"expected {pin.key}@{pin.version}, got {actual[0]}@{actual[1]}"
                )
        except BaseException:
            record_arena_scalars(reward_ref_validation_success=0.0)
            raise
        record_arena_scalars(reward_ref_validation_success=1.0)

    # --- route modes ---

    async def _run_gateway(self, launch: _Launch) -> float:
        renewal = None
        try:  # from the first attempt on: a POST may land although its response is lost
            try:
                gateway_url, model_name = await self._register_gateway_route(launch)
            except BaseException:
                record_arena_scalars(registration_success=0.0, call_success=0.0)
                raise
            record_arena_scalars(registration_success=1.0)
            launch.url, launch.model_name = gateway_url, model_name
            launch.key = self.client.llm_gateway_api_key
            renewal = asyncio.create_task(
                renew_gateway_route(
                    launch.model_name,
                    client=self.client,
                    http=launch.http,
                    reregister=lambda: self._register_gateway_route(launch),
                    interval=self.registration_probe_interval,
                    timeout=self.registration_timeout,
                    secret_values=launch.secrets(),
                )
            )
            return await self._launch_and_score(launch)
        finally:
            if renewal is not None:  # stopped first, so it cannot resurrect a deleted route
                renewal.cancel()
                await asyncio.gather(renewal, return_exceptions=True)
            await delete_route(
                self.client,
                launch.http,
                launch.model_name,
                self.registration_timeout,
                *launch.secrets(),
            )

    async def _register_gateway_route(self, launch: _Launch) -> tuple[str, str]:
        return await bounded(
            self.client.register_llm_proxy_async(
                model_name=launch.model_name,
                upstream_base_url=launch.proxy_url,
                upstream_api_key=launch.api_key,
                deployment_id=launch.deployment_id,
                protocol=launch.protocol,
                client=launch.http,
                timeout=self.registration_timeout,
            ),
            self.registration_timeout,
        )

    async def _run_session_gateway(
        self, launch: _Launch, runtime: Any, gateway_key: str, session_token: str
    ) -> float:
        launch.key = self.client.llm_gateway_api_key
        registry = self._session_registry if runtime is None else worker_session_registry(runtime)
        route = await registry.acquire(
            self.client,
            launch.http,
            launch.proxy_url,
            gateway_key,
            self.registration_timeout,
            self.registration_probe_interval,
        )
        try:
            launch.url, launch.model_name = route.gateway_url, route.model_name
            headers = [f"X-Session-Id: {launch.session_id}", f"X-Session-Token: {session_token}"]
            existing = launch.envs.get("ANTHROPIC_CUSTOM_HEADERS", "").strip()
            launch.envs["ANTHROPIC_CUSTOM_HEADERS"] = "\n".join(
                [existing, *headers] if existing else headers
            )
            record_arena_scalars(session_gateway_route=1.0)
            return await self._launch_and_score(launch)
        finally:
            await registry.release(route)

    async def _run_direct(self, launch: _Launch) -> float:
        host = urlsplit(launch.proxy_url).hostname
        if not host:
            raise ValueError(
                f"the proxy base_url {redact_url(launch.proxy_url)!r} has no host name"
            )
        configured = launch.envs.get("NO_PROXY") or launch.envs.get("no_proxy") or ""
        hosts = [h.strip() for h in configured.split(",") if h.strip()]
        if host not in hosts:
            hosts.append(host)
        no_proxy = ",".join(hosts)
        launch.envs.update(
            ANTHROPIC_BASE_URL=launch.proxy_url,
            OPENAI_BASE_URL=launch.proxy_url,
            ANTHROPIC_API_KEY=launch.api_key,
            OPENAI_API_KEY=launch.api_key,
            NO_PROXY=no_proxy,
            no_proxy=no_proxy,
        )
        record_arena_scalars(direct_route=1.0)
        return await self._launch_and_score(launch)

    # --- launch, wait, score ---

    async def _launch_and_score(self, launch: _Launch) -> float:
        accepted: list[str | None] = []  # the Arena task id, once Arena accepted the task

        def on_launch_success(task_id: str | None) -> None:
            if not accepted:
                accepted.append(task_id)
                record_arena_scalars(launch_success=1.0)

        def record_unfinished() -> None:
            record_arena_scalars(
                **({"terminal_success": 0.0} if accepted else {"launch_success": 0.0})
            )
            record_arena_scalars(call_success=0.0)

        try:
            async with asyncio.timeout(self.timeout) as deadline:
                outcome = await self.client.launch_one_task_result(
                    stream_id=launch.stream_id,
                    data_id=launch.data_id,
                    model_name=launch.model_name,
                    proxy_base_url=launch.url,
                    proxy_api_key=launch.key,
                    session_id=launch.session_id,
                    harness=launch.stream.harness,
                    task_envs=launch.envs,
                    client=launch.http,
                    on_launch_success=on_launch_success,
                )
        except ArenaTaskFailedError as error:
            record_arena_scalars(terminal_success=0.0, call_success=0.0)
            launch.episode.result = error.result
            raise
        except asyncio.CancelledError:
            if accepted:
                record_arena_scalars(terminal_success=0.0)
            record_arena_scalars(call_success=0.0)
            task_id = accepted[0] if accepted else None
            if task_id:
                await self._dump_local_status(launch, task_id, "LOCAL_WAIT_CANCELLED")
            logger.warning(
                "rollout cancelled while waiting for Arena task %s (data %s); the task keeps "
                "running in Arena",
                task_id or "unknown",
                launch.data_id,
            )
            raise
        except TimeoutError as error:
            record_unfinished()
            if not deadline.expired():
                raise
            task_id = accepted[0] if accepted else None
            if task_id:
                await self._dump_local_status(launch, task_id, "LOCAL_WAIT_TIMEOUT")
            logger.warning(  # key=value, one line: log searches match on the fields
                "arena task timed out: task_id=%s data_id=%s timeout_s=%s",
                task_id or "unknown",
                launch.data_id,
                self.timeout,
            )
            raise TimeoutError(
                f"Arena task {task_id or 'unknown'} for data {launch.data_id} did not finish "
                f"within the episode timeout of {self.timeout:g}s"
            ) from error
        except Exception:
            record_unfinished()
            raise

        result = self._as_task_result(outcome, accepted)
        record_arena_scalars(terminal_success=1.0)
        launch.episode.result = result
        try:
            score = result.score
            if score is None or not math.isfinite(score):
                raise ArenaAPIError(
                    f"Arena task {result.task_id} is {result.status} without a finite "
                    "top-level 'score'"
                )
            reward = self._transform_reward(score, launch.data, launch.stream)
        except Exception:
            record_arena_scalars(result_processing_success=0.0, call_success=0.0)
            await self._dump(launch.data, launch.episode, result, training_score=None)
            raise
        record_arena_scalars(result_processing_success=1.0, call_success=1.0)
        return reward

    @staticmethod
    def _as_task_result(outcome: Any, accepted: list[str | None]) -> ArenaTaskResult:
        if isinstance(outcome, ArenaTaskResult):
            return outcome
        if isinstance(outcome, (int, float)) and not isinstance(outcome, bool):
            task_id = (accepted[0] if accepted else None) or "legacy-result"
            return ArenaTaskResult(task_id=task_id, status="DONE", score=float(outcome))
        raise ArenaAPIError(
            f"Arena launch returned {type(outcome).__name__}, not a task result or a number"
        )

    # --- audit ---

    async def _dump_local_status(self, launch: _Launch, task_id: str, status: str) -> None:
        result = ArenaTaskResult(task_id=task_id, status=status)
        await self._dump(launch.data, launch.episode, result, training_score=None)
