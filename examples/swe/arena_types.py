"""Arena Stream configuration types (plain dataclasses; validated by ``arena_config``)."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["ArenaRewardRefConfig", "ArenaStreamConfig"]


@dataclass
class ArenaRewardRefConfig:
    """A pinned grader: reward implementation ``key`` at ``version`` (both or neither)."""

    key: str = field(default="", metadata={"help": "Reward implementation key."})
    version: str = field(default="", metadata={"help": "Reward implementation version."})


@dataclass
class ArenaStreamConfig:
    """One Arena Stream in the training mixture. Field order is the serialization order."""

    name: str = field(
        default="", metadata={"help": "Local identifier ([A-Za-z0-9_.-]+), used in metric keys."}
    )
    stream_id: str = field(default="", metadata={"help": "Arena Stream id."})
    sampling_weight: float = field(
        default=1.0, metadata={"help": "Relative weight in the mixture (finite, > 0)."}
    )
    harness: str = field(
        default="", metadata={"help": "Harness 'key@version'; empty uses the Stream default."}
    )
    llm_protocol: str = field(
        default="",
        metadata={"help": "'', anthropic, responses or chat_completions ('' infers it)."},
    )
    task_envs: dict[str, str] = field(
        default_factory=dict, metadata={"help": "Extra environment variables of each task."}
    )
    expected_reward_ref: ArenaRewardRefConfig = field(
        default_factory=ArenaRewardRefConfig,
        metadata={"help": "Pinned grader key/version; preflight fails on drift."},
    )
    reward_threshold: float | None = field(
        default=None, metadata={"help": "Threshold passed to the reward transform."}
    )
    reward_transform_fn: str = field(
        default="", metadata={"help": "Dotted path 'package.module.fn' transforming the score."}
    )
