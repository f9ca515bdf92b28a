"""The Arena agent's answers to the proxy workflow: failures, audit, metrics, export rewards.

A run of :class:`examples.swe.arena_agent.ArenaStreamAgentWorkflow` leaves its task's
result in a task-local :class:`ArenaEpisode`; the proxy workflow then calls the hooks of
:class:`ArenaAgentHooks` (see :class:`areal.proxy.hooks.AgentHooks`) to classify a failure,
write the audit record, record metrics and pick the reward each exported interaction gets.
The mapping from an Arena score to a training reward (the Stream's transform, else its
threshold) lives here too, since pass@k needs to know when a reward counts as solved.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from areal.proxy.hooks import FailureDisposition
from areal.utils import logging
from examples.swe.arena_agent_common import clean_text
from examples.swe.arena_audit import AuditShardWriter, audit_record
from examples.swe.arena_failures import classify_proxy_failure as classify_task_failure
from examples.swe.arena_failures import harness_outcome_bucket
from examples.swe.arena_failures import should_reject_failed_sample as rejects_failed_sample
from examples.swe.arena_metrics import (
    record_arena_scalars,
    record_episode_scores,
    record_group_pass_rates,
)
from examples.swe.arena_results import SUCCESS_TASK_STATUSES, ArenaTaskResult
from examples.swe.arena_types import ArenaStreamConfig

__all__ = ["ArenaAgentHooks", "ArenaEpisode"]

logger = logging.getLogger("arena.agent")


@dataclass
class ArenaEpisode:
    """Task-local state a run leaves for the proxy's hooks (export, audit, metrics)."""

    session_id: str | None = None
    result: ArenaTaskResult | None = None
    dumped: bool = False


class ArenaAgentHooks:
    """The optional proxy-workflow hooks of the Arena agent, and the episode state they read.

    Args:
        streams: the configured Streams (a row names one, or the only one is used); kept
            by name in ``stream_configs``.
        transforms: the reward transform of each Stream that has one, by Stream name.
        gen_args: sampling arguments, attached to each proxy session as metadata.
        reject_terminal_task_failures: see :meth:`should_reject_failed_sample`.
        result_dump_dir: where audit shards go (empty: no audit records).
        result_dump_max_bytes: the cap on each audit record's raw result payload, in bytes.
    """

    def __init__(
        self,
        streams: list[ArenaStreamConfig],
        transforms: Mapping[str, Callable[..., float]],
        gen_args: Mapping[str, Any],
        reject_terminal_task_failures: bool,
        result_dump_dir: str,
        result_dump_max_bytes: int,
    ):
        self.gen_args = dict(gen_args)
        self.reject_terminal_task_failures = bool(reject_terminal_task_failures)
        self.stream_configs = {stream.name: stream for stream in streams}
        self.default_stream_name = streams[0].name if len(streams) == 1 else None
        self._transforms = dict(transforms)
        self.result_dump_dir = result_dump_dir
        self.result_dump_max_bytes = result_dump_max_bytes
        self._audit = AuditShardWriter(result_dump_dir, result_dump_max_bytes)
        self._episode: contextvars.ContextVar[ArenaEpisode | None] = contextvars.ContextVar(
            f"arena_episode_{id(self)}", default=None
        )

    # --- Streams and rewards ---

    def _stream_for(self, data: Mapping[str, Any]) -> ArenaStreamConfig:
        name = clean_text(data.get("arena_stream_name")) or self.default_stream_name
        if not name:
            raise ValueError("arena_stream_name is required for a multi-Stream run")
        stream = self.stream_configs.get(name)
        if stream is None:
            configured = ", ".join(sorted(self.stream_configs))
            raise ValueError(f"unknown Arena Stream {name!r}; configured: {configured}")
        return stream

    def _transform_reward(
        self,
        reward: float,
        data: Mapping[str, Any],
        stream_config: ArenaStreamConfig | None = None,
    ) -> float:
        """The training reward of a score: the Stream's transform, else its threshold."""
        stream = stream_config or self._stream_for(data)
        transform = self._transforms.get(stream.name)
        if transform is not None:
            extra = {}
            if stream.reward_threshold is not None:
                extra["reward_threshold"] = stream.reward_threshold
            value = float(transform(reward, data, **extra))
            if not math.isfinite(value):
                raise ValueError(
                    f"reward transform {stream.reward_transform_fn} returned a non-finite "
                    f"reward {value!r}"
                )
            return value
        if stream.reward_threshold is not None:
            return 1.0 if reward >= stream.reward_threshold else 0.0
        return float(reward)

    def _is_solved_reward(self, reward: float | None, stream: ArenaStreamConfig | None) -> bool:
        """Whether a training reward counts as solved for pass@k (``None`` never does)."""
        if reward is None:
            return False
        threshold = stream.reward_threshold if stream is not None else None
        if stream is not None and stream.name in self._transforms and threshold is not None:
            return reward >= threshold
        return reward > 0

    def _stream_or_none(self, data: Mapping[str, Any]) -> ArenaStreamConfig | None:
        name = clean_text(data.get("arena_stream_name")) or self.default_stream_name
        return self.stream_configs.get(name) if name else None

    # --- hooks called by the proxy workflow ---

    @staticmethod
    def classify_proxy_failure(
        error: BaseException, *, context_overflow: bool, interaction_count: int
    ) -> FailureDisposition:
        """``model_failure_zero`` (train with reward 0) or a reject disposition.

        Only a ``HARNESS_FAILED`` result that proves a model failure trains as zero (see
        :mod:`examples.swe.arena_failures`); class-level, it reads no instance state.
        """
        return classify_task_failure(
            error, context_overflow=context_overflow, interaction_count=interaction_count
        )

    def should_reject_failed_sample(
        self, error: BaseException, disposition: FailureDisposition
    ) -> bool:
        """With ``reject_terminal_task_failures``: drop only this failed group member."""
        return self.reject_terminal_task_failures and rejects_failed_sample(error, disposition)

    async def record_failure_disposition(
        self, data: Mapping[str, Any], error: BaseException, disposition: FailureDisposition
    ) -> None:
        episode = self._current_episode()
        result = getattr(error, "result", None)
        if isinstance(result, ArenaTaskResult):
            episode.result = result
        if disposition == "model_failure_zero":
            return  # the final reward (0.0) is audited by persist_episode_result
        if episode.result is not None and not episode.dumped:
            await self._dump(data, episode, episode.result, training_score=None)

    async def persist_episode_result(self, data: Mapping[str, Any], reward: float | None) -> None:
        episode = self._current_episode()
        if episode.result is not None and not episode.dumped:
            await self._dump(data, episode, episode.result, training_score=reward)

    def record_episode_metrics(self, data: Mapping[str, Any], reward: float | None) -> None:
        """Per-episode metrics after a successful export (``run`` records no reward)."""
        episode = self._current_episode()
        try:
            record_episode_scores(data, reward, episode.result, self._stream_or_none(data))
        finally:
            episode.result, episode.dumped = None, False

    def record_group_metrics(
        self, data: Mapping[str, Any], rewards: list[float | None], group_size: int
    ) -> None:
        """pass@k and the group's pass-count distribution, globally, per domain and Stream."""
        if len(rewards) != group_size:
            raise ValueError(f"got {len(rewards)} rewards for a group of {group_size}")
        stream = self._stream_or_none(data)
        passed = sum(1 for reward in rewards if self._is_solved_reward(reward, stream))
        record_group_pass_rates(data, stream, passed, group_size)

    def get_session_metadata(self, data: Mapping[str, Any]) -> dict[str, Any]:
        return {"generation_args": dict(self.gen_args)} if self.gen_args else {}

    def get_episode_metadata(self) -> dict[str, Any]:
        """Identity of the episode's Arena task, attached to every exported interaction."""
        episode = self._episode.get()
        if episode is None:
            return {}
        identity = self._identity(episode, episode.result)
        metadata = {}
        if episode.session_id is not None:
            metadata["session_id"] = episode.session_id
        if episode.result is not None:
            metadata["arena_task_id"] = identity["arena_task_id"]
            metadata["arena_status"] = episode.result.status
            if episode.result.status == "HARNESS_FAILED":
                metadata["harness_outcome_code"] = identity["harness_outcome_code"]
        return metadata

    def get_episode_reward_for_export(
        self, data: Mapping[str, Any], reward: float | None, *, export_style: str
    ) -> float | None:
        """The terminal reward for every concat segment of a successful episode, else None."""
        result = self._current_episode().result
        if export_style != "concat" or result is None:
            return None
        if result.status not in SUCCESS_TASK_STATUSES:
            return None
        if reward is None or not math.isfinite(reward):
            return None
        return float(reward)

    def get_failure_reward_for_export(
        self, data: Mapping[str, Any], *, export_style: str
    ) -> float | None:
        return 0.0 if export_style == "concat" else None

    def _current_episode(self) -> ArenaEpisode:
        episode = self._episode.get()
        if episode is None:
            episode = ArenaEpisode()
            self._episode.set(episode)
        return episode

    # --- audit ---

    @staticmethod
    def _identity(episode: ArenaEpisode, result: ArenaTaskResult | None) -> dict[str, Any]:
        """The identity fields shared by audit records and episode metadata."""
        failed = result is not None and result.status == "HARNESS_FAILED"
        return {
            "arena_task_id": result.task_id if result is not None else None,
            "session_id": episode.session_id,
            "harness_outcome_code": harness_outcome_bucket(result.raw) if failed else None,
        }

    async def _dump(
        self,
        data: Mapping[str, Any],
        episode: ArenaEpisode,
        result: ArenaTaskResult,
        *,
        training_score: float | None,
    ) -> None:
        """Audit one task outcome (at most once per episode) through
        :meth:`_dump_task_result`; never raises."""
        episode.dumped = True
        try:
            await self._dump_task_result(
                data, self._stream_for(data), result, training_score=training_score
            )
        except Exception as e:
            record_arena_scalars(result_dump_success=0.0)
            logger.warning("could not write the Arena audit record of %s: %s", result.task_id, e)

    async def _dump_task_result(
        self,
        data: Mapping[str, Any],
        stream_config: ArenaStreamConfig,
        result: ArenaTaskResult,
        *,
        training_score: float | None,
    ) -> None:
        """Append the audit record of one task result to this process's shard.

        Every audit write of the agent goes through here (called with the episode's context
        set), so a subclass or a patch can send results elsewhere. Without
        ``result_dump_dir`` nothing is written.
        """
        if not self.result_dump_dir:
            return
        identity = self._identity(self._current_episode(), result)
        record = audit_record(stream_config, data, result, training_score, identity)
        await self._audit.append(record, result.raw)
        record_arena_scalars(result_dump_success=1.0)
