"""Data carried between the trainer, the rollout side and inference servers."""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from areal.api.cli_args import GenerationHyperparameters

__all__ = [
    "FinetuneSpec",
    "HttpGenerationResult",
    "HttpRequest",
    "LocalInfServerInfo",
    "ModelRequest",
    "ModelResponse",
    "ParamSpec",
    "RolloutStat",
    "SaveLoadMeta",
    "StepInfo",
    "WeightUpdateMeta",
    "WeightUpdateRequests",
]


@dataclass
class ModelRequest:
    """One generation request in token space (``gconfig.n_samples`` must be 1)."""

    input_ids: list[int] = field(default_factory=list)
    gconfig: GenerationHyperparameters = field(default_factory=GenerationHyperparameters)
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    metadata: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None
    image_data: list[Any] | None = None

    def copy(self) -> ModelRequest:
        return ModelRequest(
            input_ids=list(self.input_ids),
            gconfig=self.gconfig.new(),
            rid=self.rid,
            metadata=dict(self.metadata),
            tokenizer=self.tokenizer,
            image_data=None if self.image_data is None else list(self.image_data),
        )


StopReason = Literal["stop", "length", "tool_calls", "abort", "interrupt"]


@dataclass
class ModelResponse:
    """A finished generation: tokens, their log-probs, and the weight version of each."""

    input_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    stop_reason: StopReason = "stop"
    latency: float = float("inf")
    ttft: float = float("inf")
    tokenizer: Any = None
    stop_token_ids: list[int] = field(default_factory=list)

    @property
    def input_len(self) -> int:
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        return len(self.output_tokens)

    def _stop_ids(self) -> set[int]:
        ids = set(self.stop_token_ids)
        for attr in ("eos_token_id", "pad_token_id"):
            value = getattr(self.tokenizer, attr, None)
            if isinstance(value, int):
                ids.add(value)
        return ids

    @property
    def output_tokens_without_stop(self) -> list[int]:
        """Output tokens minus the trailing EOS/PAD tokens of a stopped generation.

        Truncated (``length``) and aborted outputs are returned as they are. A stopped
        output must end with a stop token and must not consist of stop tokens only.
        """
        if self.stop_reason in ("length", "abort"):
            return list(self.output_tokens)
        stops = self._stop_ids()
        tokens = list(self.output_tokens)
        if not tokens or tokens[-1] not in stops:
            raise ValueError(
                f"generation stopped ({self.stop_reason}) but does not end with a stop token"
            )
        while tokens and tokens[-1] in stops:
            tokens.pop()
        if not tokens:
            raise ValueError("generation consists of stop tokens only")
        return tokens


@dataclass
class HttpRequest:
    """An HTTP call to an inference server, built by a backend."""

    endpoint: str
    payload: dict[str, Any]
    method: str = "POST"


@dataclass
class HttpGenerationResult:
    output_tokens: list[int]
    output_logprobs: list[float]
    stop_reason: str


@dataclass
class WeightUpdateRequests:
    """Requests that together apply one weight update on one server."""

    requests: list[HttpRequest]


@dataclass
class ParamSpec:
    """Name, shape and dtype of one tensor in a weight-sync bucket."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        return math.prod(self.shape)


@dataclass
class WeightUpdateMeta:
    """How new weights travel from the trainer to the inference servers.

    For ``xccl`` the servers' layout comes from the rollout allocation: ``gen_n_servers``
    servers of TP size ``gen_tp_size``. The weight-update group follows SGLang's rank rule:
    the trainer is rank 0 and server ``i``'s TP rank ``r`` is ``1 + i * t + r``, so the
    group has ``1 + N * t`` ranks (pipeline stages repeat TP ranks, so ``gen_pp_size``
    does not widen the group; xccl with ``gen_pp_size > 1`` is refused at config load).
    ``comm_backend`` is chosen by the trainer rank that hosts the group: ``nccl`` on GPUs,
    ``gloo`` on CPU.
    """

    type: Literal["disk", "xccl", "awex"] = "disk"
    path: str | None = None
    version: int | None = None
    nccl_master_address: str = "127.0.0.1"
    nccl_master_port: int = 29500
    nccl_group_name: str = "update_weight_group"
    comm_backend: Literal["nccl", "gloo"] = "nccl"
    gen_tp_size: int = 1
    gen_pp_size: int = 1
    gen_n_servers: int = 1
    weight_chunked_mem_mb: int = 1024
    use_lora: bool = False
    lora_name: str = ""

    @property
    def gen_world_size(self) -> int:
        """Devices of the rollout side (``N * t * p``)."""
        return self.gen_tp_size * self.gen_pp_size * self.gen_n_servers

    @property
    def group_world_size(self) -> int:
        """Ranks of the weight-update group: the trainer plus every server's TP ranks."""
        return 1 + self.gen_n_servers * self.gen_tp_size

    def rank_offset(self, server_index: int) -> int:
        """Group rank of TP rank 0 of server ``server_index`` (0-based)."""
        if not 0 <= server_index < self.gen_n_servers:
            raise ValueError(
                f"server index {server_index} outside the {self.gen_n_servers} rollout servers"
            )
        return 1 + server_index * self.gen_tp_size


@dataclass
class LocalInfServerInfo:
    host: str
    port: int
    process: Any

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass
class FinetuneSpec:
    """Dataset size and batch size, from which step counts follow."""

    total_train_epochs: int
    dataset_size: int
    train_batch_size: int

    @property
    def steps_per_epoch(self) -> int:
        return self.dataset_size // self.train_batch_size

    @property
    def total_train_steps(self) -> int:
        return self.total_train_epochs * self.steps_per_epoch


@dataclass
class StepInfo:
    epoch: int
    epoch_step: int
    global_step: int
    steps_per_epoch: int


@dataclass
class SaveLoadMeta:
    path: str
    weight_format: Literal["hf", "dcp"] = "hf"
    with_optim: bool = False
    tokenizer: Any = None
    base_model_path: str | None = None


@dataclass
class RolloutStat:
    """Counts kept by the staleness manager."""

    enqueued: int = 0
    running: int = 0
    accepted: int = 0
    rejected: int = 0
    timestamp: float = field(default_factory=time.time)
