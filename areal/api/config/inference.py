"""Inference-side configs: sampling, the rollout engine, its proxy agent, SGLang."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json
from dataclasses import dataclass
from typing import Any

from areal.api.config.fields import MISSING, ConfigNode, FieldError, cfg_field
from areal.api.config.scheduling import RPC_SERVER_CMD, SchedulingSpec, SchedulingStrategy
from areal.api.config.train import parse_backend
from areal.proxy.parsers import check_parser_name
from areal.utils.command import get_py_cmd

__all__ = [
    "AgentConfig",
    "GenerationHyperparameters",
    "InferenceEngineConfig",
    "SGLangConfig",
    "vLLMConfig",
]

# The SGLang range the conformance tier (tests/conformance) passes; keep pyproject's extra equal.
MIN_SGLANG_VERSION = "0.5.10.post1"
MAX_SGLANG_VERSION = "0.5.23"
# SGLang 0.5.14 split the CUDA-graph batch-size flags by phase: --cuda-graph-max-bs and
# --cuda-graph-bs became deprecated aliases of the -decode flags (the only graphs older
# versions capture), and 0.5.20 removed them (argparse then calls them ambiguous prefixes).
_DECODE_CUDA_GRAPH_FLAGS_SINCE = "0.5.14"


@dataclass
class GenerationHyperparameters(ConfigNode):
    """Sampling settings for rollouts (``gconfig``) and evaluation (``eval_gconfig``)."""

    n_samples: int = cfg_field(1, help="Samples per prompt (the GRPO group size).")
    max_new_tokens: int = cfg_field(16384, help="Completion budget in tokens.")
    min_new_tokens: int = cfg_field(0, help="Minimum completion length in tokens.")
    max_tokens: int = cfg_field(32768, help="Prompt + completion cap in tokens.")
    greedy: bool = cfg_field(False, help="Greedy decoding (temperature 0).")
    top_p: float = cfg_field(1.0, help="Nucleus sampling mass.")
    top_k: int = cfg_field(100000000, help="Top-k sampling cutoff.")
    temperature: float = cfg_field(1.0, help="Sampling temperature.")
    stop_token_ids: list[int] = cfg_field(factory=list, help="Extra stop token ids.")
    ignore_eos: bool = cfg_field(False, help="Keep generating past EOS.")
    skip_special_tokens: bool = cfg_field(True, help="Drop special tokens when decoding.")
    stop: list[str] | None = cfg_field(None, help="Stop strings.")
    frequency_penalty: float = cfg_field(0.0, help="OpenAI-style frequency penalty.")
    seed: int | None = cfg_field(None, help="Fixed sampling seed.")
    lora_name: str = cfg_field("default_lora", help="LoRA adapter name.")
    use_beam_search: bool = cfg_field(False, help="Beam search (not used by rollouts).")
    reward_normalization: bool = cfg_field(
        False, help="Normalize rewards within each prompt's group at rollout time."
    )
    drop_incomplete_group: bool = cfg_field(
        False, help="Drop a whole group when any of its samples fails."
    )

    def validate(self) -> None:
        if self.n_samples < 1:
            raise FieldError("n_samples", f"must be >= 1 (got {self.n_samples})")
        if self.max_new_tokens < 1:
            raise FieldError("max_new_tokens", "must be >= 1")
        if self.max_tokens < 1:
            raise FieldError("max_tokens", "must be >= 1")
        if self.min_new_tokens < 0 or self.min_new_tokens > self.max_new_tokens:
            raise FieldError("min_new_tokens", "must be within [0, max_new_tokens]")
        if self.temperature < 0:
            raise FieldError("temperature", "must be >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise FieldError("top_p", f"must be within (0, 1] (got {self.top_p})")
        if self.top_k < 1:
            raise FieldError("top_k", "must be >= 1")

    def new(self, **kwargs: Any) -> GenerationHyperparameters:
        """A copy with some fields replaced."""
        return dataclasses.replace(self, **kwargs)

    def to_openai_args_dict(self, api_format: str = "completions") -> dict[str, Any]:
        """Sampling arguments for an OpenAI-style request.

        ``api_format`` picks the budget key: ``completions`` -> ``max_completion_tokens``,
        ``responses`` -> ``max_output_tokens``, ``openai-agents`` -> ``max_tokens``.
        Fields with no OpenAI meaning (and the two group flags) are dropped.
        """
        budget_keys = {
            "completions": "max_completion_tokens",
            "responses": "max_output_tokens",
            "openai-agents": "max_tokens",
        }
        if api_format not in budget_keys:
            raise ValueError(f"api_format must be one of {sorted(budget_keys)}, got {api_format!r}")
        args: dict[str, Any] = {
            "n": self.n_samples,
            "temperature": 0.0 if self.greedy else self.temperature,
            "top_p": self.top_p,
            budget_keys[api_format]: self.max_new_tokens,
        }
        if self.stop:
            args["stop"] = list(self.stop)
        if self.frequency_penalty:
            args["frequency_penalty"] = self.frequency_penalty
        if self.seed is not None:
            args["seed"] = self.seed
        return args


def _agent_worker_specs() -> tuple[SchedulingSpec, ...]:
    return (SchedulingSpec(gpu=0, cmd=RPC_SERVER_CMD),)


@dataclass
class AgentConfig(ConfigNode):
    """The rollout proxy that agents (and Arena harnesses) call as their LLM."""

    agent_cls_path: str = cfg_field(
        "", help="Agent class for mode 'online' (unused by inline agents)."
    )
    admin_api_key: str = cfg_field(
        "",
        help="Proxy admin key. Unset (or the reference's public default 'areal-admin-key'): "
        "the trainer generates a random key per run and hands it to its proxies and "
        "workflows through their environment.",
        secret=True,
    )
    scheduling_spec: tuple[SchedulingSpec, ...] = cfg_field(
        factory=_agent_worker_specs, help="Proxy worker resources (exactly one spec)."
    )
    mode: str = cfg_field(
        "inline", help="Where agents run.", choices=("inline", "subproc", "online")
    )
    tool_call_parser: str = cfg_field(
        "qwen",
        help="Parser for tool calls in completions: a native one (areal.proxy.parsers), "
        "another that SGLang registers (needs sglang beside the proxy), or 'none'.",
    )
    reasoning_parser: str = cfg_field(
        "qwen3",
        help="Parser splitting reasoning from content; names as for tool_call_parser.",
    )
    chat_template_type: str = cfg_field(
        "hf",
        help="Render every turn with the HF template, or concatenate turns.",
        choices=("hf", "concat"),
    )
    engine_max_tokens: int | None = cfg_field(
        None, help="Prompt + completion cap per request, in tokens."
    )
    turn_discount: float = cfg_field(1.0, help="Reward discount per earlier turn.")
    export_style: str = cfg_field(
        "individual",
        help="Export each interaction, or concatenated conversations.",
        choices=("individual", "concat"),
    )
    message_preprocessors: list[str] = cfg_field(
        factory=list, help="Dotted class paths; each is called as messages = p(messages)."
    )
    prefix_matcher: str | None = cfg_field(
        None, help="Dotted path of a parent/child message matcher."
    )
    subproc_max_workers: int = cfg_field(4, help="Worker processes for mode 'subproc'.")
    drop_retry_orphans: bool = cfg_field(
        False, help="Drop interactions superseded by a harness retry."
    )
    session_timeout_seconds: float = cfg_field(3600, help="Idle session expiry in seconds.")
    max_body_bytes: int = cfg_field(
        16 * 1024 * 1024,
        help="Largest request body the rollout proxy accepts, in bytes (default 16 MiB); "
        "larger ones get HTTP 413.",
    )
    export_timeout_seconds: float = cfg_field(
        300.0,
        help="Seconds an export waits for a session that was never ended before it fails "
        "with HTTP 409 (default 300).",
    )
    set_reward_finish_timeout: float = cfg_field(
        0.0, help="Seconds to wait for in-flight calls when a reward is set (>= 0)."
    )

    def validate(self) -> None:
        if self.mode == "online" and not self.agent_cls_path.strip():
            raise FieldError("agent_cls_path", "is required when mode is 'online'")
        for field, kind in (("tool_call_parser", "tool call"), ("reasoning_parser", "reasoning")):
            try:  # the proxy would refuse the name only when it starts, deep into the run
                check_parser_name(kind, getattr(self, field))
            except ValueError as error:
                raise FieldError(field, str(error)) from None
        if len(self.scheduling_spec) != 1:
            raise FieldError("scheduling_spec", "must have exactly one entry")
        if self.set_reward_finish_timeout < 0:
            raise FieldError("set_reward_finish_timeout", "must be >= 0")
        if self.session_timeout_seconds <= 0:
            raise FieldError("session_timeout_seconds", "must be > 0")
        if self.max_body_bytes < 1:
            raise FieldError("max_body_bytes", f"must be >= 1 byte (got {self.max_body_bytes})")
        if self.export_timeout_seconds <= 0:
            raise FieldError("export_timeout_seconds", "must be > 0 seconds")
        if self.engine_max_tokens is not None and self.engine_max_tokens < 1:
            raise FieldError("engine_max_tokens", "must be a positive token count or null")


def _rollout_worker_specs() -> tuple[SchedulingSpec, ...]:
    return (SchedulingSpec(cmd=RPC_SERVER_CMD),)


@dataclass
class InferenceEngineConfig(ConfigNode):
    """The rollout side: inference servers, concurrency and staleness control."""

    experiment_name: str | None = cfg_field(None, help="Experiment name (dumps, disk updates).")
    trial_name: str | None = cfg_field(None, help="Trial name (dumps, disk updates).")
    fileroot: str | None = cfg_field(None, help="Root for dumps and disk weight updates.")
    backend: str = cfg_field(MISSING, help="Allocation string, e.g. 'sglang:d4p1t2' or 'hf:d1'.")
    max_concurrent_rollouts: int | None = cfg_field(
        None,
        help="Rollout groups running at once, over all rollout workers (the rollout "
        "controller's limit); null means consumer_batch_size.",
    )
    queue_size: int | None = cfg_field(
        None,
        help="Rows an in-process WorkflowExecutor.prepare_batch keeps queued; null means 16 x "
        "max_concurrent_rollouts. The rollout controller does not use it: it draws a row only "
        "when the row can be dispatched.",
    )
    consumer_batch_size: int = cfg_field(1, help="Groups per training batch.")
    max_head_offpolicyness: int | None = cfg_field(
        0,
        help="Staleness bound: how many weight versions a sample may lag the trainer (0: "
        "synchronous); null: no bound, only max_concurrent_rollouts limits the rollouts (the "
        "evaluation controller's setting: its rollouts are never trained).",
    )
    enable_rollout_tracing: bool = cfg_field(False, help="Log every submit and accept.")
    deterministic_sampling: bool = cfg_field(False, help="Seeded, reproducible sampling.")
    serialize_group_samples: bool = cfg_field(False, help="Run a group's samples one by one.")
    check_trajectory_format: bool = cfg_field(False, help="Validate trajectories (debug).")
    tokenizer_path: str = cfg_field("", help="Tokenizer for the proxy and dump decoding.")
    dump_to_file: bool = cfg_field(False, help="Write rollout trajectories as JSONL.")
    setup_timeout: float = cfg_field(300.0, help="Seconds to wait for servers to be healthy.")
    workers_ready_timeout: float = cfg_field(30.0, help="Seconds to wait for rollout workers.")
    request_timeout: float = cfg_field(
        3600, help="Seconds per inference HTTP call, and per rollout task end to end."
    )
    weight_update_group_timeout: float = cfg_field(
        60.0,
        help="Seconds an inference server may take to join the trainer's weight-update group "
        "(xccl; default 60.0): the embedded server (hf) fails the join after it, while it "
        "keeps generating, and the client stops waiting for any server shortly after.",
    )
    request_retries: int = cfg_field(3, help="Total attempts per inference HTTP call.")
    pause_grace_period: float = cfg_field(0.0, help="Seconds to sleep after pausing servers.")
    health_check_interval: float = cfg_field(
        5.0,
        help="Seconds between health checks of every rollout worker, inference server and "
        "rollout proxy (default 5.0; 0 turns the checks off).",
    )
    health_check_timeout: float = cfg_field(
        5.0, help="Seconds one health check may take before it counts as failed (default 5.0)."
    )
    health_check_failures: int = cfg_field(
        3,
        help="Consecutive failed health checks that declare a worker, server or proxy dead "
        "and fail the run (default 3).",
    )
    max_consecutive_rejections: int = cfg_field(
        256,
        help="Rollouts rejected in a row (none accepted) after which the run fails instead "
        "of launching more (default 256; 0 turns the limit off).",
    )
    scheduling_spec: tuple[SchedulingSpec, ...] = cfg_field(
        factory=_rollout_worker_specs, help="Rollout worker resources (1 or 2 specs)."
    )
    scheduling_strategy: SchedulingStrategy = cfg_field(
        factory=SchedulingStrategy, help="Separation or colocation with the actor."
    )
    use_lora: bool = cfg_field(False, help="Serve LoRA adapters.")
    lora_name: str = cfg_field("", help="LoRA adapter name (defaults to gconfig.lora_name).")
    agent: AgentConfig = cfg_field(factory=AgentConfig, help="Rollout proxy settings.")
    return_routed_experts: bool = cfg_field(False, help="MoE router replay (not supported).")
    _version: str = cfg_field("v1", help="Controller API version.", choices=("v1", "v2"))
    model: str = cfg_field("default", help="Model name served to agents.")
    routing_strategy: str = cfg_field(
        "round_robin", help="How requests pick a server.", choices=("round_robin",)
    )
    poll_interval: float = cfg_field(5.0, help="v2 only: seconds between polls.")
    admin_api_key: str = cfg_field(
        "",
        help="v2 only: service admin key. Unset (or 'areal-admin-key'): a random key per run.",
        secret=True,
    )
    api_url: str | None = cfg_field(None, help="v2 only: external service URL.")
    provider_api_key: str | None = cfg_field(
        None, help="v2 only: external provider key.", secret=True
    )

    def validate(self) -> None:
        if self.backend != MISSING and not parse_backend(self.backend).is_inference:
            raise FieldError(
                "backend",
                f"{self.backend!r} is a training backend; rollout needs 'sglang:...' or 'hf:...'",
            )
        if len(self.scheduling_spec) not in (1, 2):
            raise FieldError(
                "scheduling_spec", f"needs 1 or 2 entries (got {len(self.scheduling_spec)})"
            )
        if self.max_head_offpolicyness is not None and self.max_head_offpolicyness < 0:
            raise FieldError("max_head_offpolicyness", "must be >= 0 or null")
        if self.consumer_batch_size < 1:
            raise FieldError("consumer_batch_size", "must be >= 1")
        if self.max_concurrent_rollouts is not None and self.max_concurrent_rollouts < 1:
            raise FieldError("max_concurrent_rollouts", "must be >= 1 or null")
        if self.request_retries < 1:
            raise FieldError("request_retries", "counts total attempts and must be >= 1")
        if self.request_timeout <= 0 or self.setup_timeout <= 0:
            raise FieldError("request_timeout", "timeouts must be > 0 seconds")
        if self.weight_update_group_timeout <= 0:
            raise FieldError("weight_update_group_timeout", "must be > 0 seconds")
        if self.health_check_interval < 0:
            raise FieldError("health_check_interval", "must be >= 0 seconds (0 turns checks off)")
        if self.health_check_timeout <= 0:
            raise FieldError("health_check_timeout", "must be > 0 seconds")
        if self.health_check_failures < 1:
            raise FieldError("health_check_failures", "must be >= 1")
        if self.max_consecutive_rejections < 0:
            raise FieldError("max_consecutive_rejections", "must be >= 0 (0 turns it off)")
        if self.deterministic_sampling and self.max_head_offpolicyness != 0:
            self.warn(
                "rollout.deterministic_sampling with max_head_offpolicyness > 0 (or null) is not "
                "reproducible: asynchronous rollouts interleave with weight updates"
            )


@dataclass
class SGLangConfig(ConfigNode):
    """Flags for ``python -m sglang.launch_server`` (backend ``sglang``)."""

    model_path: str = cfg_field("", help="Model served (usually ${actor.path}).")
    random_seed: int = cfg_field(1, help="Server sampling seed.")
    skip_tokenizer_init: bool = cfg_field(False, help="Serve token ids only (the proxy tokenizes).")
    disable_cuda_graph: bool = cfg_field(False, help="Disable CUDA graphs.")
    disable_radix_cache: bool = cfg_field(True, help="Disable prefix (radix) caching.")
    disable_cuda_graph_padding: bool = cfg_field(False, help="Disable CUDA-graph padding.")
    enable_nccl_nvls: bool = cfg_field(False, help="NCCL NVLink SHARP.")
    disable_outlines_disk_cache: bool = cfg_field(False, help="Disable outlines disk cache.")
    disable_custom_all_reduce: bool = cfg_field(False, help="Disable custom all-reduce.")
    disable_overlap_schedule: bool = cfg_field(False, help="Disable the overlap scheduler.")
    enable_mixed_chunk: bool = cfg_field(False, help="Mix prefill and decode chunks.")
    enable_dp_attention: bool = cfg_field(False, help="Data-parallel attention.")
    enable_ep_moe: bool = cfg_field(False, help="Expert-parallel MoE.")
    enable_torch_compile: bool = cfg_field(False, help="torch.compile the model.")
    torch_compile_max_bs: int = cfg_field(32, help="Max batch size for torch.compile.")
    cuda_graph_max_bs: int | None = cfg_field(None, help="Max batch size captured in graphs.")
    cuda_graph_bs: list[int] | None = cfg_field(None, help="Batch sizes captured in graphs.")
    torchao_config: str = cfg_field("", help="torchao quantization config.")
    enable_nan_detection: bool = cfg_field(False, help="Detect NaNs in sampling.")
    enable_p2p_check: bool = cfg_field(False, help="Check GPU peer access.")
    triton_attention_reduce_in_fp32: bool = cfg_field(False, help="Triton attention fp32 reduce.")
    triton_attention_num_kv_splits: int = cfg_field(8, help="Triton attention KV splits.")
    num_continuous_decode_steps: int = cfg_field(1, help="Decode steps per schedule.")
    load_format: str = cfg_field("auto", help="Weight load format.")
    enable_memory_saver: bool = cfg_field(False, help="Allow releasing GPU memory.")
    allow_auto_truncate: bool = cfg_field(False, help="Truncate over-long prompts.")
    attention_backend: str | None = cfg_field("fa3", help="Attention backend.")
    enable_deterministic_inference: bool = cfg_field(False, help="Deterministic kernels.")
    enable_multimodal: bool = cfg_field(False, help="Multimodal inputs.")
    sampling_backend: str | None = cfg_field(None, help="Sampling backend.")
    context_length: int | None = cfg_field(32768, help="Context window in tokens.")
    mem_fraction_static: float | None = cfg_field(0.9, help="GPU memory for weights and KV.")
    max_running_requests: int | None = cfg_field(None, help="Max concurrent requests.")
    chunked_prefill_size: int | None = cfg_field(-1, help="Prefill chunk size (-1 disables).")
    max_prefill_tokens: int = cfg_field(32768, help="Max tokens per prefill batch.")
    schedule_policy: str = cfg_field("lpm", help="Request scheduling policy.")
    schedule_conservativeness: float = cfg_field(1.0, help="Scheduling conservativeness.")
    cpu_offload_gb: int = cfg_field(0, help="GB of weights offloaded to CPU.")
    dtype: str = cfg_field("bfloat16", help="Model dtype.")
    kv_cache_dtype: str = cfg_field("auto", help="KV cache dtype.")
    dp_size: int = cfg_field(1, help="Server-internal data parallelism.")
    ep_size: int = cfg_field(1, help="Expert parallelism.")
    enable_lora: bool | None = cfg_field(None, help="Serve LoRA adapters.")
    max_lora_rank: int | None = cfg_field(None, help="Max LoRA rank.")
    max_loaded_loras: int = cfg_field(8, help="Max resident LoRA adapters.")
    lora_paths: list[str] | None = cfg_field(None, help="LoRA adapters to preload.")
    lora_backend: str = cfg_field("triton", help="LoRA kernel backend.")
    log_level: str = cfg_field("warning", help="Server log level.")
    log_level_http: str | None = cfg_field("warning", help="HTTP log level.")
    log_requests: bool = cfg_field(False, help="Log requests.")
    log_requests_level: int = cfg_field(0, help="Request log verbosity.")
    show_time_cost: bool = cfg_field(False, help="Show time costs.")
    enable_metrics: bool = cfg_field(True, help="Expose Prometheus metrics.")
    decode_log_interval: int = cfg_field(1, help="Decode log interval.")
    enable_multithread_load: bool = cfg_field(False, help="Load weights with threads.")
    enable_return_routed_experts: bool = cfg_field(False, help="Internal: MoE router replay.")

    def validate(self) -> None:
        if self.context_length is not None and self.context_length < 2:
            raise FieldError("context_length", "must be >= 2 tokens")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static <= 1:
            raise FieldError("mem_fraction_static", "must be within (0, 1]")

    @staticmethod
    def build_args(
        sglang_config: SGLangConfig,
        tp_size: int,
        base_gpu_id: int,
        host: str | None = None,
        port: int | None = None,
        dist_init_addr: str | None = None,
        n_nodes: int = 1,
        node_rank: int = 0,
        pp_size: int = 1,
        sglang_version: str | None = None,
    ) -> dict[str, Any]:
        """The ``launch_server`` flag dict for one server.

        ``sglang_version`` is the SGLang the server will run (default: the one installed
        here, else :data:`MIN_SGLANG_VERSION`); flags SGLang renamed are spelled its way.
        """
        version = sglang_version or target_sglang_version()
        _check_sglang_version(version)
        if sglang_config.enable_deterministic_inference and sglang_config.attention_backend not in (
            "flashinfer",
            "fa3",
            "triton",
        ):
            ConfigNode.warn(
                "sglang.enable_deterministic_inference needs attention_backend flashinfer, "
                f"fa3 or triton (got {sglang_config.attention_backend!r})"
            )
        args = {f.name: getattr(sglang_config, f.name) for f in dataclasses.fields(sglang_config)}
        if args.pop("enable_multithread_load"):
            args["model_loader_extra_config"] = json.dumps({"enable_multithread_load": True})
        args.update(
            tokenizer_path=sglang_config.model_path,
            tokenizer_mode="auto",
            trust_remote_code=True,
            is_embedding=False,
            tp_size=tp_size,
            base_gpu_id=base_gpu_id,
            nnodes=n_nodes,
            node_rank=node_rank,
            dist_init_addr=dist_init_addr,
        )
        if pp_size > 1:
            args["pp_size"] = pp_size
        args = spell_for_sglang(args, version)
        if host is not None:
            args["host"] = host
        if port is not None:
            args["port"] = port
        return args

    @staticmethod
    def build_cmd(sglang_config: SGLangConfig, python: str = "python3", **launch: Any) -> list[str]:
        """argv of ``python -m sglang.launch_server``; ``launch`` as for :meth:`build_args`."""
        args = SGLangConfig.build_args(sglang_config, **launch)
        return get_py_cmd("sglang.launch_server", args, python=python)


_CUDA_GRAPH_FLAGS = (
    ("cuda_graph_max_bs", "cuda_graph_max_bs_decode"),
    ("cuda_graph_bs", "cuda_graph_bs_decode"),
)


def spell_for_sglang(args: dict[str, Any], version: str) -> dict[str, Any]:
    """``args`` with renamed flags spelled as SGLang ``version`` accepts them.

    Either spelling goes in, so the launching worker can respell arguments a controller
    built for another version (the controller often has no SGLang installed).
    """
    from packaging.version import Version

    out = dict(args)
    new_names = Version(version) >= Version(_DECODE_CUDA_GRAPH_FLAGS_SINCE)
    for old, new in _CUDA_GRAPH_FLAGS:
        src, dst = (old, new) if new_names else (new, old)
        if src in out:
            value = out.pop(src)
            if value is not None or dst not in out:
                out[dst] = value
    return out


def target_sglang_version() -> str:
    """The SGLang version installed in this environment, else :data:`MIN_SGLANG_VERSION`."""
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        return MIN_SGLANG_VERSION


_warned_newer: set[str] = set()


def _check_sglang_version(version: str | None = None) -> None:
    """Refuse SGLang older than the tested range; warn (once) about a newer one.

    ``version`` defaults to the installed SGLang (absent SGLang is fine here). Older
    releases lack routes and fields the client sends, so they are refused. A newer release
    usually still works, and refusing it would block an upgrade the user may need, but its
    flags and routes were not checked: warn, naming the range the conformance tier passed.
    """
    if version is None:
        try:
            version = importlib.metadata.version("sglang")
        except importlib.metadata.PackageNotFoundError:
            return
    from packaging.version import Version

    if Version(version) < Version(MIN_SGLANG_VERSION):
        raise RuntimeError(
            f"sglang {version} is older than this port supports: it needs sglang >= "
            f"{MIN_SGLANG_VERSION} (tested up to {MAX_SGLANG_VERSION})"
        )
    if Version(version) > Version(MAX_SGLANG_VERSION) and version not in _warned_newer:
        _warned_newer.add(version)
        ConfigNode.warn(
            f"sglang {version} is newer than the newest release this port was tested with "
            f"({MAX_SGLANG_VERSION}; tested range {MIN_SGLANG_VERSION} to {MAX_SGLANG_VERSION}): "
            "its launch flags and HTTP API were not checked"
        )


@dataclass
class vLLMConfig(ConfigNode):  # noqa: N801 - the reference's name, kept for YAML users
    """Accepted for YAML compatibility; the vLLM backend is not supported in this port."""

    model: str = cfg_field("", help="Model path.")
    seed: int = cfg_field(1, help="Sampling seed.")
    skip_tokenizer_init: bool = cfg_field(False, help="Serve token ids only.")
    dtype: str = cfg_field("bfloat16", help="Model dtype.")
    max_model_len: int | None = cfg_field(32768, help="Context window in tokens.")
    gpu_memory_utilization: float = cfg_field(0.9, help="GPU memory fraction.")
