"""The SWE/Arena experiment config: ``PPOConfig`` plus the ``econfig`` block."""

from __future__ import annotations

import math
from dataclasses import dataclass

from areal.api.cli_args import PPOConfig
from areal.api.config.fields import ConfigNode, FieldError, cfg_field
from areal.utils.secrets import redact_url
from examples.swe.arena_http import url_problem
from examples.swe.arena_types import ArenaRewardRefConfig, ArenaStreamConfig

__all__ = ["ArenaRewardRefConfig", "ArenaStreamConfig", "SWEEnvConfig", "SWEPPOConfig"]

LLM_PROTOCOLS = ("anthropic", "responses", "chat_completions")
ROUTE_MODES = ("gateway", "session_gateway", "direct")


@dataclass
class SWEEnvConfig(ConfigNode):
    """Where prompts come from and how Arena tasks are run (``econfig``)."""

    dataset_source: str = cfg_field(
        "arena",
        help="Where prompts come from: 'arena' (Arena Streams), the only supported source.",
    )
    dataset_path: str = cfg_field(
        "", help="Unused: the reference's JSONL dataset (dataset_source 'jsonl' is refused)."
    )
    stream_id: str = cfg_field(
        "", help="Legacy single Stream id; empty picks the first ACTIVE Stream."
    )
    arena_streams: list[ArenaStreamConfig] = cfg_field(
        factory=list, help="Inline Stream mixture (excludes the two sources below)."
    )
    arena_streams_yaml_b64: str = cfg_field(
        "",
        help="Base64 YAML with a top-level 'streams' list (redacted when saved).",
        secret=True,
    )
    arena_streams_file: str = cfg_field("", help="YAML/JSON file with a top-level 'streams' list.")
    arena_mixture_epoch_size: int = cfg_field(
        0, help="Rows per epoch drawn by weight; 0 uses every row of every Stream once."
    )
    arena_eval_streams: list[ArenaStreamConfig] = cfg_field(
        factory=list,
        help="Held-out Streams (other Streams than the training ones) whose rows, each once, "
        "form the validation set, evaluated at temperature 0 on the evaluator schedule; "
        "empty evaluates the training mixture's rows.",
    )
    arena_result_dump_dir: str = cfg_field(
        "",
        help="Directory of mode-0600 JSONL audit shards; empty disables them. Checked when "
        "the agent starts: a symlink on its path, or a directory it cannot write, is an error.",
    )
    arena_result_dump_max_bytes: int = cfg_field(
        1_000_000, help="Cap on each record's raw result payload, in bytes."
    )
    arena_base_url: str = cfg_field(
        "",
        help="Arena OpenAPI base (http(s), no credentials or query); empty uses "
        "ARENA_OPENAPI_BASE, 'local' serves a local Arena in this process.",
    )
    arena_request_timeout: float = cfg_field(
        60.0, help="Seconds per Stream/dataset request and reward-ref check."
    )
    arena_request_retries: int = cfg_field(3, help="Retries after the first Arena attempt.")
    arena_poll_interval: float = cfg_field(5.0, help="Seconds between task-result polls.")
    arena_registration_timeout: float = cfg_field(
        180.0, help="Seconds per LLM route registry call (and its outer bound)."
    )
    arena_registration_probe_interval: float = cfg_field(
        60.0, help="Seconds between session-gateway route liveness probes."
    )
    arena_llm_route_mode: str = cfg_field(
        "gateway",
        help="How harnesses reach the proxy: gateway, session_gateway or direct.",
        choices=("", *ROUTE_MODES),
    )
    arena_llm_protocol: str = cfg_field(
        "", help="Legacy: the harness LLM protocol ('' infers it).", choices=("", *LLM_PROTOCOLS)
    )
    arena_harness: str = cfg_field("", help="Default Harness 'key@version'.")
    arena_task_envs: dict[str, str] = cfg_field(
        factory=dict, help="Common task env; MODEL_NAME, BASE_URL and API_KEY are managed."
    )
    arena_reward_threshold: float | None = cfg_field(
        None, help="Legacy single-Stream reward threshold."
    )
    arena_reward_transform_fn: str = cfg_field(
        "", help="Legacy single-Stream reward transform (dotted path)."
    )
    # The reference's JSONL-mode settings: accepted so that its configs load, but unused.
    agent_type: str = cfg_field("swe", help="JSONL mode: agent kind.")
    agent_config: str = cfg_field("", help="JSONL mode: agent config.")
    swe_agent_config: str = cfg_field(
        "1_0_0/min-swe-agent-train-top1", help="JSONL mode: SWE agent config."
    )
    cc_agent_config: str = cfg_field("train_cc_time3600", help="JSONL mode: CC agent config.")
    agent_root: str = cfg_field("", help="JSONL mode: agent root directory.")
    swe_agent_root: str = cfg_field("", help="JSONL mode: SWE agent root directory.")
    llm_model: str = cfg_field("", help="JSONL mode: model name.")
    opencode_provider: str = cfg_field("", help="JSONL mode: opencode provider.")
    codex_provider: str = cfg_field("", help="JSONL mode: codex provider.")
    step_limit: int = cfg_field(100, help="JSONL mode: agent step limit.")
    max_completion_tokens: int = cfg_field(16384, help="JSONL mode: completion budget.")
    timeout: float = cfg_field(1800.0, help="Seconds one episode (one Arena task) may take.")

    def validate(self) -> None:
        if self.dataset_source != "arena":
            # checked here, not by choices, to say why the reference's 'jsonl' is gone
            why = (
                ": JSONL SWE datasets need the reference's SWE agent (examples.swe.agent), "
                "which this port does not ship"
                if self.dataset_source == "jsonl"
                else ""
            )
            raise FieldError(
                "dataset_source",
                f"{self.dataset_source!r} is not supported{why}; the supported value is "
                "'arena' (prompts from Arena Streams)",
            )
        positive = (
            "arena_request_timeout",
            "arena_poll_interval",
            "arena_registration_timeout",
            "arena_registration_probe_interval",
            "timeout",
        )
        for name in positive:
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise FieldError(name, f"must be a finite number of seconds > 0 (got {value})")
        if self.arena_result_dump_max_bytes <= 0:
            raise FieldError("arena_result_dump_max_bytes", "must be > 0")
        if self.arena_request_retries < 0:
            raise FieldError("arena_request_retries", "must be >= 0")
        if self.arena_mixture_epoch_size < 0:
            raise FieldError("arena_mixture_epoch_size", "must be >= 0 (0 uses every row once)")
        threshold = self.arena_reward_threshold
        if threshold is not None and not math.isfinite(threshold):
            raise FieldError("arena_reward_threshold", "must be finite or null")
        for key, value in self.arena_task_envs.items():
            if not key or not isinstance(value, str):
                raise FieldError("arena_task_envs", "must map non-empty names to strings")
        base = self.arena_base_url.strip().rstrip("/")
        if base and base != "local":
            problem = url_problem(base)
            if problem is not None:
                raise FieldError(
                    "arena_base_url",
                    f"invalid Arena base URL {redact_url(base)!r}: {problem} (the token goes "
                    "in ARENA_OPENAPI_TOKEN, never in the URL)",
                )


@dataclass
class SWEPPOConfig(PPOConfig):
    """A PPO experiment whose prompts and rewards come from Arena Streams."""

    econfig: SWEEnvConfig = cfg_field(factory=SWEEnvConfig, help="Dataset and Arena settings.")
    should_accept_fn: str | None = cfg_field(
        None, help="Dotted path of a group filter: fn(group) -> bool keeps the group."
    )
