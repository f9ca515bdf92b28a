"""``OpenAIProxyWorkflow``: runs an agent against the proxy and exports what it recorded.

Per sample: admit a session (grant capacity, start), run the agent with the session's
credentials, assign its reward, end the session, then export the recorded interactions.
Failures are classified (see :mod:`areal.proxy.hooks`): a rejected sample raises, a
model failure trains with reward 0 on the interactions it has. An empty export is a
rejected sample.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from typing import Any

from areal.api.workflow_api import RolloutWorkflow
from areal.infra import workflow_context
from areal.proxy.client import OpenAIProxyClient
from areal.proxy.hooks import FailureDisposition
from areal.proxy.keys import derive_gateway_key, derive_session_token
from areal.utils import logging, stats_tracker
from areal.utils.secrets import SecretStr, reveal

__all__ = ["HARNESS_OUTCOME_METRIC_CODES", "OpenAIProxyWorkflow"]

logger = logging.getLogger("proxy.workflow")

HARNESS_OUTCOME_METRIC_CODES = frozenset(
    {
        "AGENT_MAX_TURNS_EXCEEDED",
        "AGENT_RUN_TIMEOUT",
        "AUTONOMOUS_INCOMPLETE_NO_SHIP",
        "GAMEAGENT_RUN_FAILED",
        "LLM_RESPONSE_FAILED",
        "LLM_RESPONSE_TIMEOUT",
    }
)
DISPOSITIONS: tuple[FailureDisposition, ...] = (
    "model_failure_zero",
    "system_failure_reject",
    "unknown_failure_reject",
)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


class OpenAIProxyWorkflow(RolloutWorkflow):
    """Wraps an agent (``async def run(data, **kwargs)``) as a rollout workflow."""

    def __init__(
        self,
        mode: str = "inline",
        agent: Any = None,
        proxy_addr: str | None = None,
        admin_api_key: str = "",
        discount: float = 1.0,
        export_style: str = "individual",
        subproc_max_workers: int = 4,
        proxy_gateway_addr: str | None = None,
        drop_retry_orphans: bool = False,
    ):
        if mode != "inline":
            raise ValueError(f"agent mode {mode!r} is not supported by this port; use 'inline'")
        run = getattr(agent, "run", None)
        if run is None or not inspect.iscoroutinefunction(run):
            raise TypeError(f"{type(agent).__name__}.run must be an 'async def' method")
        if not proxy_addr:
            raise ValueError("an agent workflow needs the proxy address (proxy_addr)")
        self.agent = agent
        self.proxy_addr = proxy_addr.rstrip("/")
        self.admin_api_key = SecretStr(reveal(admin_api_key))
        self.discount = discount
        self.export_style = export_style
        self.drop_retry_orphans = drop_retry_orphans

    def _hook(self, name: str) -> Any:
        return getattr(self.agent, name, None)

    async def _call_hook(self, name: str, *args: Any, **kwargs: Any) -> Any:
        hook = self._hook(name)
        if hook is None:
            return None
        try:
            return await _maybe_await(hook(*args, **kwargs))
        except Exception:
            logger.exception("agent hook %s failed", name)
            return None

    async def _assign_reward(self, client: OpenAIProxyClient, key: str, reward: Any) -> None:
        from areal.proxy.client import ProxyError

        if isinstance(reward, dict):
            items = list(reward.items())
        elif isinstance(reward, (int, float)) and not isinstance(reward, bool):
            if not math.isfinite(reward):
                raise ValueError(f"agent returned a non-finite reward {reward!r}")
            items = [(None, float(reward))]
        else:
            raise ValueError(f"agent.run must return a number or a dict of rewards, got {reward!r}")
        for interaction_id, value in items:
            try:
                await client.set_reward(key, float(value), interaction_id)
            except ProxyError as e:
                if e.status != 400:
                    raise
                logger.warning("reward not recorded: %s", e)

    def _disposition(self, error: BaseException, diagnostics: dict[str, Any]) -> FailureDisposition:
        if diagnostics.get("system_error"):
            return "system_failure_reject"
        classify = self._hook("classify_proxy_failure")
        if classify is not None:
            disposition = classify(
                error,
                context_overflow=bool(diagnostics.get("context_overflow")),
                interaction_count=int(diagnostics.get("interaction_count", 0)),
            )
            if disposition not in DISPOSITIONS:
                raise ValueError(f"classify_proxy_failure returned {disposition!r}")
            return disposition
        return (
            "model_failure_zero"
            if diagnostics.get("context_overflow")
            else "unknown_failure_reject"
        )

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        context = workflow_context.get()
        task_id = (
            str(context.task_id)
            if context.sample_idx is None
            else f"{context.task_id}:{context.sample_idx}"
        )
        http = await workflow_context.get_httpx_client()
        client = OpenAIProxyClient(self.proxy_addr, self.admin_api_key, http)
        await client.grant_capacity()
        metadata = await self._call_hook("get_session_metadata", data) or {}
        session_id, key = await client.start_session(task_id, metadata=metadata)
        admin = self.admin_api_key.reveal()
        kwargs = {
            "base_url": self.proxy_addr,
            "api_key": key,
            "http_client": http,
            "session_id": session_id,
            "proxy_gateway_api_key": derive_gateway_key(admin),
            "proxy_session_token": derive_session_token(admin, session_id),
            "worker_runtime": engine,
        }
        error: BaseException | None = None
        try:
            reward = await self.agent.run(data, **kwargs)
            await self._assign_reward(client, key, reward)
        except asyncio.CancelledError:
            await asyncio.shield(self._end_quietly(client, key))
            raise
        except Exception as e:
            error = e
        diagnostics = await client.end_session(key)
        scope = workflow_context.stat_scope()
        tracker = stats_tracker.get("rollout")

        disposition = None
        if error is not None:
            disposition = self._disposition(error, diagnostics)
            await self._call_hook("record_failure_disposition", data, error, disposition)
            if disposition.endswith("_reject"):
                tracker.scalar(
                    **{
                        f"{scope}/context_overflow": float(
                            bool(diagnostics.get("context_overflow"))
                        ),
                        f"{scope}/proxy_system_error": float(bool(diagnostics.get("system_error"))),
                    }
                )
                raise error
        forced_reward = None
        if diagnostics.get("context_overflow") or disposition == "model_failure_zero":
            if int(diagnostics.get("interaction_count", 0)) == 0:
                await self._call_hook("persist_episode_result", data, None)
                return None
            forced_reward = 0.0  # a model failure trains as a zero reward (set at export)

        exported = await client.export(
            session_id, self.discount, self.export_style, self.drop_retry_orphans, forced_reward
        )
        if not exported:
            await self._call_hook("persist_episode_result", data, None)
            return None
        episode_metadata = await self._call_hook("get_episode_metadata") or {}
        for interaction in exported.values():
            interaction.metadata.update(episode_metadata)
        last_reward = list(exported.values())[-1].reward
        last_reward = 0.0 if last_reward is None else float(last_reward)
        await self._call_hook("persist_episode_result", data, last_reward)
        tracker.scalar(
            **{f"{scope}/reward": last_reward, f"{scope}/num_interactions": float(len(exported))}
        )
        record = self._hook("record_episode_metrics")
        if record is not None:
            try:
                record(data, last_reward)
            except Exception:
                logger.exception("agent hook record_episode_metrics failed")
        return exported

    async def _end_quietly(self, client: OpenAIProxyClient, key: str) -> None:
        try:
            await client.end_session(key)
        except Exception as e:  # the task is being cancelled; do not mask that
            logger.warning("could not end the session of a cancelled rollout: %s", e)
