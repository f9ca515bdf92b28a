"""Allocation strings: which backend runs an engine and how it is parallelized.

Grammar (whitespace ignored, dimension letters in any order, a missing letter means 1,
a repeated letter keeps its last value)::

    spec     := INFER ["[" NAME "]"] ":" (d|t|p)N+
              | TRAIN ["[" NAME "]"] ":" ((d|t|p|c|e)N+ | hybrid)
    hybrid   := ["("] "attn" ":" (d|t|p|c)N+ "|" "ffn" ":" (d|t|p|e)N+ [")"]
    INFER    := sglang | hf          TRAIN := fsdp | megatron
    N        := [1-9][0-9]*

``sglang:d4p1t2`` is four SGLang servers of TP 2; ``fsdp:d8`` is eight FSDP ranks;
``megatron:(attn:d2p2t2c8|ffn:d4p2e8)`` is a 64-GPU MoE layout whose attention layers
use DP2 x PP2 x TP2 x CP8 and whose expert layers use EDP4 x PP2 x EP8. Backend ``hf`` is
this port's embedded inference server; ``vllm`` and ``archon`` are not supported.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from areal.api.config.scheduling import SchedulingStrategy

__all__ = [
    "AllocationValidationError",
    "InvalidAllocationModeError",
    "MegatronParallelStrategy",
    "ModelAllocation",
    "ParallelStrategy",
]

INFERENCE_BACKENDS = ("sglang", "hf")
TRAIN_BACKENDS = ("fsdp", "megatron")
UNSUPPORTED_BACKENDS = {
    "vllm": "vllm is not supported in this port; use 'sglang:...' on GPUs or 'hf:...' "
    "(the embedded inference server)",
    "archon": "archon is not supported in this port; use 'fsdp:...' or 'megatron:...'",
}
_NAME = r"[A-Za-z_][A-Za-z0-9_]*"
_DIMS = re.compile(r"(?:[a-z][0-9]+)+")
_DIM = re.compile(r"([a-z])([0-9]+)")
_DIM_FIELDS = {
    "d": "data_parallel_size",
    "t": "tensor_parallel_size",
    "p": "pipeline_parallel_size",
    "c": "context_parallel_size",
    "e": "expert_parallel_size",
}


class AllocationValidationError(ValueError):
    """A well-formed allocation string that describes an invalid layout."""


class InvalidAllocationModeError(AllocationValidationError):
    """Attention and FFN layouts of a hybrid MoE string that do not fit together."""


@dataclass
class ParallelStrategy:
    """Parallel degrees of one engine; experts never add GPUs."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_parallel_size: int = 1
    expert_tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in (
            "tensor_parallel_size",
            "pipeline_parallel_size",
            "data_parallel_size",
            "context_parallel_size",
            "expert_parallel_size",
            "expert_tensor_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise AllocationValidationError(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.ep_size > 1 and self.world_size % self.expert_model_parallel_size:
            raise AllocationValidationError(
                f"pp x etp x ep = {self.expert_model_parallel_size} must divide the world "
                f"size {self.world_size}"
            )

    @property
    def tp_size(self) -> int:
        return self.tensor_parallel_size

    @property
    def pp_size(self) -> int:
        return self.pipeline_parallel_size

    @property
    def dp_size(self) -> int:
        return self.data_parallel_size

    @property
    def cp_size(self) -> int:
        return self.context_parallel_size

    @property
    def ep_size(self) -> int:
        return self.expert_parallel_size

    @property
    def etp_size(self) -> int:
        return self.expert_tensor_parallel_size

    @property
    def world_size(self) -> int:
        """GPUs used: ``dp x cp x tp x pp``."""
        return self.dp_size * self.cp_size * self.tp_size * self.pp_size

    @property
    def expert_model_parallel_size(self) -> int:
        """``pp x etp x ep``: ranks one expert-data-parallel replica spans."""
        return self.pp_size * self.etp_size * self.ep_size

    @property
    def edp_size(self) -> int:
        """Expert data parallelism: ``world / (pp x etp x ep)`` with experts, else ``dp``."""
        if self.ep_size > 1:
            return self.world_size // self.expert_model_parallel_size
        return self.dp_size


@dataclass
class MegatronParallelStrategy(ParallelStrategy):
    """A ParallelStrategy with Megatron's virtual pipeline and sequence parallelism."""

    virtual_pipeline_parallel_size: int = 1
    use_sequence_parallel: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.virtual_pipeline_parallel_size >= 2 and self.pp_size <= 1:
            raise AllocationValidationError("virtual pipeline stages >= 2 need pp > 1")


@dataclass
class ModelAllocation:
    """One engine's backend, optional name, parallel layout and placement strategy."""

    backend: str
    name: str | None
    parallel: ParallelStrategy
    scheduling_strategy: SchedulingStrategy

    @property
    def is_inference(self) -> bool:
        return self.backend in INFERENCE_BACKENDS

    @property
    def n_instances(self) -> int:
        """Inference: number of servers (``dp``); training: number of ranks."""
        return self.parallel.dp_size if self.is_inference else self.parallel.world_size

    @property
    def instance_size(self) -> int:
        """GPUs per inference server (``tp x pp``); 1 per training rank."""
        return self.parallel.tp_size * self.parallel.pp_size if self.is_inference else 1

    @classmethod
    def from_str(
        cls,
        spec: str,
        name: str | None = None,
        scheduling_strategy: SchedulingStrategy | None = None,
    ) -> ModelAllocation:
        """Parse one engine's allocation string (see the module docstring)."""
        backend, bracket_name, parallel = _parse(spec)
        return cls(
            backend=backend,
            name=name if name is not None else bracket_name,
            parallel=parallel,
            scheduling_strategy=scheduling_strategy or SchedulingStrategy(),
        )

    def __str__(self) -> str:
        p = self.parallel
        name = f"[{self.name}]" if self.name else ""
        if self.is_inference:
            return f"{self.backend}{name}:d{p.dp_size}t{p.tp_size}p{p.pp_size}"
        dims = f"d{p.dp_size}t{p.tp_size}p{p.pp_size}c{p.cp_size}"
        if p.ep_size > 1 or p.etp_size > 1:
            return (
                f"{self.backend}{name}:(attn:{dims}|ffn:d{p.edp_size}t{p.etp_size}"
                f"p{p.pp_size}e{p.ep_size})"
            )
        return f"{self.backend}{name}:{dims}"


def _parse(spec: str) -> tuple[str, str | None, ParallelStrategy]:
    if not isinstance(spec, str):
        raise ValueError(f"allocation must be a string, got {type(spec).__name__}")
    text = re.sub(r"\s+", "", spec)
    if not text:
        raise ValueError("empty allocation string; expected e.g. 'sglang:d4t2' or 'fsdp:d8'")
    if "+" in text:
        raise ValueError(
            f"{spec!r} has several components joined by '+'; give each engine its own "
            "backend string (rollout.backend: 'sglang:d4t2', actor.backend: 'fsdp:d8')"
        )
    head = re.match(rf"({_NAME})(?:\[({_NAME})\])?(.*)$", text)
    if head is None:
        raise ValueError(
            f"{spec!r} does not start with a backend; write '<backend>:<dims>', "
            "e.g. 'sglang:d4t2' or 'fsdp:d8'"
        )
    backend, bracket_name, rest = head.group(1), head.group(2), head.group(3)
    if not rest.startswith(":"):
        if _DIMS.fullmatch(backend) and not rest:
            raise ValueError(
                f"{spec!r} has no backend prefix; write e.g. 'sglang:{text}' or 'fsdp:{text}'"
            )
        if rest.startswith("."):
            raise ValueError(
                f"{spec!r}: use ':' not '.' after the backend, e.g. '{backend}:{rest[1:]}'"
            )
        if rest.startswith("["):
            raise ValueError(f"{spec!r}: a name in brackets must match {_NAME}")
        raise ValueError(f"{spec!r}: expected ':' after the backend name {backend!r}")
    body = rest[1:]
    if backend in UNSUPPORTED_BACKENDS:
        raise ValueError(UNSUPPORTED_BACKENDS[backend])
    if backend not in INFERENCE_BACKENDS + TRAIN_BACKENDS:
        known = ", ".join(INFERENCE_BACKENDS + TRAIN_BACKENDS)
        raise ValueError(f"{spec!r}: unknown backend {backend!r}; expected one of {known}")
    if backend in INFERENCE_BACKENDS:
        dims = _parse_dims(body, "dtp", spec)
        return backend, bracket_name, ParallelStrategy(**_dims_to_fields(dims))
    strategy_cls = MegatronParallelStrategy if backend == "megatron" else ParallelStrategy
    if body.startswith("(") or body.startswith("attn:"):
        parallel = _parse_hybrid(body, spec, strategy_cls)
    else:
        parallel = strategy_cls(**_dims_to_fields(_parse_dims(body, "dtpce", spec)))
    if backend == "fsdp":
        if parallel.pp_size > 1:
            raise AllocationValidationError(
                f"{spec!r}: FSDP does not support pipeline parallelism (p{parallel.pp_size}); "
                "use megatron for pp > 1"
            )
        if parallel.ep_size > 1:
            raise AllocationValidationError(
                f"{spec!r}: FSDP does not support expert parallelism (e{parallel.ep_size}); "
                "use megatron for ep > 1"
            )
    return backend, bracket_name, parallel


def _parse_dims(body: str, allowed: str, spec: str) -> dict[str, int]:
    if not body:
        raise ValueError(f"{spec!r}: no parallel dimensions after ':' (e.g. 'd4t2')")
    if not _DIMS.fullmatch(body):
        raise ValueError(
            f"{spec!r}: cannot parse dimensions {body!r}; expected letters from "
            f"{', '.join(allowed)} each followed by a positive integer, e.g. 'd4t2'"
        )
    dims: dict[str, int] = {}
    for letter, number in _DIM.findall(body):
        if letter not in allowed:
            raise ValueError(
                f"{spec!r}: dimension '{letter}' is not allowed here; use {', '.join(allowed)}"
            )
        if number.startswith("0"):
            raise ValueError(
                f"{spec!r}: '{letter}{number}' must be a positive integer without leading zeros"
            )
        dims[letter] = int(number)  # a repeated letter keeps its last value
    return dims


def _dims_to_fields(dims: dict[str, int]) -> dict[str, int]:
    return {_DIM_FIELDS[k]: v for k, v in dims.items()}


def _parse_hybrid(body: str, spec: str, strategy_cls: type[ParallelStrategy]) -> ParallelStrategy:
    if body.startswith("(") != body.endswith(")"):
        raise ValueError(f"{spec!r}: unbalanced parentheses around 'attn:...|ffn:...'")
    inner = body[1:-1] if body.startswith("(") else body
    parts = inner.split("|")
    if len(parts) != 2 or not parts[0].startswith("attn:") or not parts[1].startswith("ffn:"):
        raise ValueError(f"{spec!r}: a hybrid layout is '(attn:<dims>|ffn:<dims>)'")
    attn = _parse_dims(parts[0][len("attn:") :], "dtpc", spec)
    ffn = _parse_dims(parts[1][len("ffn:") :], "dtpe", spec)
    dp, tp, pp, cp = (attn.get(k, 1) for k in "dtpc")
    if "p" in ffn and ffn["p"] != pp:
        raise InvalidAllocationModeError(
            f"{spec!r}: ffn pipeline size p{ffn['p']} must equal the attention one p{pp}"
        )
    etp, ep = ffn.get("t", 1), ffn.get("e", 1)
    attn_world = dp * tp * pp * cp
    if "d" in ffn:
        ffn_world = ffn["d"] * pp * etp * ep
        if ffn_world != attn_world:
            raise InvalidAllocationModeError(
                f"{spec!r}: attention uses {attn_world} GPUs (d{dp} x t{tp} x p{pp} x c{cp}) but "
                f"ffn uses {ffn_world} (d{ffn['d']} x p{pp} x t{etp} x e{ep}); they must match"
            )
    elif attn_world % (ep * etp * pp):
        raise InvalidAllocationModeError(
            f"{spec!r}: ep x etp x pp = {ep * etp * pp} does not divide the attention world "
            f"size {attn_world}"
        )
    try:
        return strategy_cls(
            tensor_parallel_size=tp,
            pipeline_parallel_size=pp,
            data_parallel_size=dp,
            context_parallel_size=cp,
            expert_parallel_size=ep,
            expert_tensor_parallel_size=etp,
        )
    except AllocationValidationError as e:
        raise InvalidAllocationModeError(f"{spec!r}: {e}") from e
