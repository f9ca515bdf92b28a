"""``OpenAIProxyWorkflow``: runs an agent against the proxy and exports what it recorded.

Per sample: admit a session (grant capacity, start), run the agent with the session's
credentials, assign its reward, end the session, then export the recorded interactions.
Failures are classified (see :mod:`areal.proxy.hooks`): a proxy system error always
rejects; otherwise the agent's ``classify_proxy_failure`` decides. A rejected sample raises
(or, when the agent's ``should_reject_failed_sample`` says so, is dropped alone); a model
failure, or any episode in which the proxy saw a context overflow, trains with reward 0 on
the interactions it has. An empty export yields no trajectory. After a usable export the
last interaction's reward and the episode's turn count are recorded, and then
:meth:`OpenAIProxyWorkflow.record_episode_metrics` runs (a subclass may override it).
Metrics go to the tracker named by the workflow context's stats scope (``rollout`` or
``eval-rollout``), whose name prefixes their keys.

The workflow is built without a proxy address where the address is only known later
(a rollout worker fills it in); running an episode without one is an error.

A failing agent hook that decides the sample's reward, disposition or export rejects the
sample (:class:`~areal.proxy.hooks.AgentHookError`), counted as
``<scope>/rejected/hook_failed/<hook>``: it never trains on a default. A failing audit or
metrics hook is logged and the sample goes on.
"""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from areal.api.workflow_api import RolloutWorkflow
from areal.infra import workflow_context
from areal.proxy.client import OpenAIProxyClient
from areal.proxy.hooks import DECISION_HOOKS, OBSERVER_HOOKS, AgentHookError, FailureDisposition
from areal.proxy.keys import derive_gateway_key, derive_session_token
from areal.utils import logging, stats_tracker
from areal.utils.secrets import SecretStr, reveal

__all__ = [
    "HARNESS_OUTCOME_METRIC_CODES",
    "OpenAIProxyWorkflow",
    "harness_flags",
    "record_interaction_stats",
]

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
SYNC_METRICS_HOOKS = ("record_episode_metrics", "record_group_metrics")
"""Agent hooks the workflow calls synchronously (``def``, not ``async def``)."""
DISPOSITIONS: tuple[FailureDisposition, ...] = (
    "model_failure_zero",
    "system_failure_reject",
    "unknown_failure_reject",
)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _mapping_or_none(answer: Any) -> str | None:
    """The objection to a metadata hook's answer, or ``None`` when it is usable."""
    return None if answer is None or isinstance(answer, Mapping) else "not a dict or None"


def _reward_or_none(answer: Any) -> str | None:
    """The objection to an export-reward hook's answer, or ``None`` when it is usable."""
    if answer is None:
        return None
    if isinstance(answer, bool) or not isinstance(answer, (int, float)):
        return "not a number or None"
    return None if math.isfinite(answer) else "not a finite number"


def _num_turns(interaction: Any) -> int | None:
    """Distinct turn ids >= 0 of ``interaction`` (negative ids pad); ``None`` without them."""
    try:
        tensors = interaction.to_tensor_dict()
        turn_ids = tensors.get("turn_ids") if tensors else None
        if turn_ids is None:
            return None
        turn_ids = torch.as_tensor(turn_ids)
        return int(torch.unique(turn_ids[turn_ids >= 0]).numel())
    except Exception as e:  # a broken export must not fail the episode over a metric
        logger.warning("no turn count for interaction %s: %s", getattr(interaction, "id", "?"), e)
        return None


def harness_flags(exported: Mapping[str, Any]) -> tuple[bool, str | None]:
    """``(harness_error, harness_outcome_code)`` of an episode, from its last exported
    interaction's metadata: a harness error is an ``arena_status`` of ``HARNESS_FAILED``."""
    if not exported:
        return False, None
    metadata = getattr(list(exported.values())[-1], "metadata", None) or {}
    code = metadata.get("harness_outcome_code")
    return (
        metadata.get("arena_status") == "HARNESS_FAILED",
        code if isinstance(code, str) else None,
    )


def record_interaction_stats(
    exported: Mapping[str, Any],
    scope: str,
    harness_error: bool | None = None,
    harness_outcome_code: str | None = None,
) -> None:
    """The last exported interaction's ``reward`` (when set) and the episode's turn counts,
    in the tracker ``scope`` (``rollout``/``eval-rollout``).

    ``num_turns`` counts the turns of the last interaction (a ``concat`` export holds the
    whole episode, an ``individual`` one its final sequence). Each metric ``M`` records one
    sample with a boolean denominator ``M_count``: ``num_turns`` always counts,
    ``num_turns_no_harness_err`` only when the episode is no harness error (its value is
    recorded masked out otherwise), ``num_turns_harness_err`` and
    ``num_turns_harness_err/<bucket>`` are recorded only for harness-error episodes, the
    bucket being the outcome code when it is one of :data:`HARNESS_OUTCOME_METRIC_CODES`,
    else ``OTHER``. With ``harness_error`` left ``None`` both flags are read from the
    export (:func:`harness_flags`).
    """
    if not exported:
        return
    if harness_error is None:
        harness_error, harness_outcome_code = harness_flags(exported)
    tracker = stats_tracker.get(scope)
    last = list(exported.values())[-1]
    if last.reward is not None:
        tracker.scalar(reward=float(last.reward))
    num_turns = _num_turns(last)
    if num_turns is None:
        return
    code = harness_outcome_code
    bucket = code if code in HARNESS_OUTCOME_METRIC_CODES else "OTHER"
    metrics = {"num_turns": True, "num_turns_no_harness_err": not harness_error}
    if harness_error:
        metrics.update({"num_turns_harness_err": True, f"num_turns_harness_err/{bucket}": True})
    value = torch.tensor([float(num_turns)])
    for name, counted in metrics.items():
        denominator = f"{name}_count"
        tracker.denominator(**{denominator: torch.tensor([counted])})
        tracker.stat(denominator=denominator, **{name: value})


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
        for name in SYNC_METRICS_HOOKS:
            if inspect.iscoroutinefunction(getattr(agent, name, None)):
                raise TypeError(
                    f"{type(agent).__name__}.{name} must be a plain 'def' method: the "
                    "workflow calls it synchronously"
                )
        self.agent = agent
        self.proxy_addr = proxy_addr.rstrip("/") if proxy_addr else None
        self.admin_api_key = SecretStr(reveal(admin_api_key))
        self.discount = discount
        self.export_style = export_style
        self.drop_retry_orphans = drop_retry_orphans

    def _hook(self, name: str) -> Any:
        return getattr(self.agent, name, None)

    async def _observe(self, name: str, *args: Any, **kwargs: Any) -> None:
        """An audit or metrics hook: a failure is logged, and the sample goes on."""
        assert name in OBSERVER_HOOKS, name
        hook = self._hook(name)
        if hook is None:
            return
        try:
            await _maybe_await(hook(*args, **kwargs))
        except Exception:
            logger.exception("agent hook %s failed (it only observes; the sample goes on)", name)

    async def _decide(
        self,
        name: str,
        *args: Any,
        check: Callable[[Any], str | None] | None = None,
        **kwargs: Any,
    ) -> Any:
        """A hook whose answer decides the sample's reward, disposition or export.

        Its exception, or an answer ``check`` objects to, raises :class:`AgentHookError`,
        which rejects the sample. ``None`` when the agent has no such hook.
        """
        assert name in DECISION_HOOKS, name
        hook = self._hook(name)
        if hook is None:
            return None
        try:
            answer = await _maybe_await(hook(*args, **kwargs))
        except Exception as e:
            raise AgentHookError(name, e) from e
        problem = check(answer) if check is not None else None
        if problem is not None:
            raise AgentHookError(name, ValueError(f"it returned {answer!r}, {problem}"))
        return answer

    def _observe_sync(self, name: str, *args: Any) -> None:
        """A synchronous metrics hook: a failure is logged, and the sample goes on."""
        hook = self._hook(name)
        if hook is None:
            return
        try:
            hook(*args)
        except Exception:
            logger.exception("agent hook %s failed (it only observes; the sample goes on)", name)

    def record_episode_metrics(self, data: dict[str, Any], reward: float | None) -> None:
        """The agent's ``record_episode_metrics(data, reward)`` hook, after a usable export.

        Nothing when ``reward`` is None. The workflow calls this method itself, so a
        subclass overriding it changes what every episode records.
        """
        if reward is None:
            return
        self._observe_sync("record_episode_metrics", data, reward)

    def record_group_metrics(
        self, data: dict[str, Any], rewards: list[float | None], group_size: int
    ) -> None:
        """The agent's ``record_group_metrics`` hook (e.g. pass@k), called once per group
        with every sample's reward (``None`` for a failed one)."""
        self._observe_sync("record_group_metrics", data, rewards, group_size)

    def _record_interaction_stats(
        self,
        exported: Mapping[str, Any],
        harness_error: bool,
        harness_outcome_code: str | None,
    ) -> None:
        """The episode's reward and turn counts (:func:`record_interaction_stats`) in the
        current stats scope; the harness flags say which turn-count buckets it joins."""
        record_interaction_stats(
            exported, workflow_context.stat_scope(), harness_error, harness_outcome_code
        )

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

    async def _disposition(
        self, error: BaseException, *, system_error: bool, overflow: bool, interaction_count: int
    ) -> FailureDisposition:
        if system_error:
            return "system_failure_reject"
        if self._hook("classify_proxy_failure") is None:
            return "model_failure_zero" if overflow else "unknown_failure_reject"
        return await self._decide(
            "classify_proxy_failure",
            error,
            context_overflow=overflow,
            interaction_count=interaction_count,
            check=lambda d: None if d in DISPOSITIONS else f"not one of {', '.join(DISPOSITIONS)}",
        )

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        """One sample; ``None`` when dropped, raises when rejected (see the module doc)."""
        try:
            return await self._run_episode(engine, data)
        except AgentHookError as e:
            # counted by reason; the raise rejects the sample as any other failure does
            stats_tracker.get(workflow_context.stat_scope()).denominator(
                **{f"rejected/hook_failed/{e.hook}": torch.tensor([True])}
            )
            await self._observe("persist_episode_result", data, None)
            raise

    async def _run_episode(self, engine: Any, data: dict[str, Any]) -> Any:
        if not self.proxy_addr:
            raise ValueError(
                "the agent workflow has no proxy address: set proxy_addr (a rollout worker "
                "sets it to its proxy's address) before running episodes"
            )
        context = workflow_context.get()
        task_id = (
            str(context.task_id)
            if context.sample_idx is None
            else f"{context.task_id}:{context.sample_idx}"
        )
        # asked before capacity is granted, so that a failing hook leaves no slot behind
        metadata = await self._decide("get_session_metadata", data, check=_mapping_or_none)
        http = await workflow_context.get_httpx_client()
        client = OpenAIProxyClient(self.proxy_addr, self.admin_api_key, http)
        await client.grant_capacity()
        session_id, key = await client.start_session(task_id, metadata=dict(metadata or {}))
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
        reward: Any = None
        try:
            reward = await self.agent.run(data, **kwargs)
            await self._assign_reward(client, key, reward)
        except asyncio.CancelledError:
            await asyncio.shield(self._end_quietly(client, key))
            raise
        except Exception as e:
            error = e
        diagnostics = await client.end_session(key)
        overflow = bool(diagnostics.get("context_overflow"))
        system_error = bool(diagnostics.get("system_error"))
        interaction_count = int(diagnostics.get("interaction_count", 0))
        stats_tracker.get(workflow_context.stat_scope()).scalar(
            context_overflow=float(overflow), proxy_system_error=float(system_error)
        )

        # --- failure disposition ---
        if error is None and overflow and system_error:
            # an overflow next to a backend failure may be the backend's doing: never train it
            error = RuntimeError(
                f"session {session_id} saw a context overflow and a proxy system failure; "
                "the episode is rejected as a system failure"
            )
        disposition: FailureDisposition | None = None
        if error is not None:
            try:
                disposition = await self._disposition(
                    error,
                    system_error=system_error,
                    overflow=overflow,
                    interaction_count=interaction_count,
                )
                await self._decide("record_failure_disposition", data, error, disposition)
                drop = not system_error and await self._decide(
                    "should_reject_failed_sample", error, disposition
                )
            except AgentHookError as hook_error:
                # the hook's error replaces the episode's own one: keep that in the log
                logger.warning(
                    "session %s failed (%s: %s) and %s",
                    session_id,
                    type(error).__name__,
                    error,
                    hook_error,
                )
                raise
            if drop:
                await self._observe("persist_episode_result", data, None)
                return None  # only this sample is dropped; its group siblings are kept
            if disposition != "model_failure_zero":
                await self._observe("persist_episode_result", data, None)
                raise error

        # --- recovery with a zero reward, or the agent's reward ---
        recovering = overflow or disposition == "model_failure_zero"
        last_reward = None
        if recovering:
            if interaction_count == 0:
                await self._observe("persist_episode_result", data, None)
                return None
            last_reward = 0.0  # overrides a successful agent's reward after an overflow
            episode_reward = await self._decide(
                "get_failure_reward_for_export",
                data,
                export_style=self.export_style,
                check=_reward_or_none,
            )
        elif isinstance(reward, (int, float)) and not isinstance(reward, bool):
            episode_reward = await self._decide(
                "get_episode_reward_for_export",
                data,
                float(reward),
                export_style=self.export_style,
                check=_reward_or_none,
            )
        else:
            episode_reward = None

        # --- export ---
        exported = await client.export(
            session_id, self.discount, self.export_style, self.drop_retry_orphans, last_reward
        )
        if not exported:
            await self._observe("persist_episode_result", data, None)
            return None
        episode_metadata = await self._decide("get_episode_metadata", check=_mapping_or_none)
        if episode_reward is not None:
            for interaction in exported.values():
                interaction.set_reward_value(float(episode_reward))
        for interaction in exported.values():
            interaction.metadata.update(episode_metadata or {})
        final_reward = list(exported.values())[-1].reward
        final_reward = None if final_reward is None else float(final_reward)
        await self._observe("persist_episode_result", data, final_reward)
        try:
            self._record_interaction_stats(exported, *harness_flags(exported))
            self.record_episode_metrics(data, final_reward)
        except Exception:  # metrics only observe: the trained sample stands
            logger.exception("recording the metrics of session %s failed", session_id)
        return exported

    async def _end_quietly(self, client: OpenAIProxyClient, key: str) -> None:
        try:
            await client.end_session(key)
        except Exception as e:  # the task is being cancelled; do not mask that
            logger.warning("could not end the session of a cancelled rollout: %s", e)
