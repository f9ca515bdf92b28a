"""What this port's trainer can run: configs it cannot honour are refused before workers start."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from areal.api.alloc_mode import ModelAllocation
from areal.api.config.fields import MISSING, ConfigError, FieldError
from areal.api.config.train import parse_backend

if TYPE_CHECKING:
    from areal.api.config.ppo import PPOConfig
    from areal.api.config.train import TrainEngineConfig

__all__ = ["SUPPORTED_COLOCATION", "refuse_unsupported", "unsupported"]

SUPPORTED_COLOCATION = (
    "colocation runs as type: colocation, target: actor, fork: true, with N servers of TP t "
    "(p1) on the N*t actor workers, each server's TP ranks on t consecutive actor workers"
)
_SGLANG_VERSIONS = "SGLang 0.5.23 (inside the supported range sglang >= 0.5.10.post1)"


@dataclass(frozen=True)
class _Layout:
    """The parsed allocations of the actor and of the rollout servers."""

    actor: ModelAllocation
    rollout: ModelAllocation

    @property
    def sglang(self) -> bool:
        return self.rollout.backend == "sglang"


Check = Callable[["PPOConfig", _Layout], Iterator[FieldError]]


# --- the training engine ---


def _awex(cfg: PPOConfig, layout: _Layout) -> Iterator[FieldError]:
    if cfg.actor.weight_update_mode != "awex":
        return
    strategy = cfg.rollout.scheduling_strategy
    if strategy.type != "colocation" or strategy.target != "actor":
        yield FieldError(
            "actor.weight_update_mode",
            "awex hands tensors to the servers by handle (CUDA IPC, shared memory), which "
            "never leave the host: the rollout must be colocated with the actor; set "
            "rollout.scheduling_strategy: {type: colocation, target: actor, fork: true} or "
            "actor.weight_update_mode: xccl (NCCL broadcast to separate servers) or disk",
        )
    if cfg.actor.use_lora:
        yield FieldError(
            "actor.weight_update_mode",
            "awex sends full weights, not LoRA adapters; set actor.weight_update_mode: disk "
            "for LoRA",
        )
    megatron = getattr(cfg.actor, "megatron", None)
    if layout.actor.backend == "megatron" and megatron is not None and not megatron.wrap_with_ddp:
        yield FieldError(
            "actor.megatron.wrap_with_ddp",
            "awex exports weights from Megatron's DDP-wrapped model; set "
            "actor.megatron.wrap_with_ddp: true",
        )


def _fsdp_tensor_parallel(cfg: PPOConfig, layout: _Layout) -> Iterator[FieldError]:
    # p > 1 and e > 1 never get here: the allocation parser already refuses them for fsdp.
    p = layout.actor.parallel
    if layout.actor.backend == "fsdp" and p.tp_size > 1:
        c = f"c{p.cp_size}" if p.cp_size > 1 else ""
        yield FieldError(
            "actor.backend",
            f"the FSDP engine is data and context parallel only, but {cfg.actor.backend!r} "
            f"asks for t{p.tp_size}; use 'fsdp:d{p.dp_size * p.tp_size}{c}' (d and c only) "
            "or a megatron backend for tensor parallelism",
        )


def _context_parallel(cfg: PPOConfig, layout: _Layout) -> Iterator[FieldError]:
    engines = [("actor", cfg.actor, layout.actor)]
    ref = cfg.ref_config()
    if ref is not None and cfg.ref is not None:  # a ref without its own section copies actor
        with contextlib.suppress(FieldError):  # a bad ref.backend is _reference_model's
            engines.append(("ref", ref, parse_backend(ref.backend)))
    for section, engine, allocation in engines:
        if allocation.backend in ("fsdp", "megatron") and allocation.parallel.cp_size > 1:
            yield from _context_parallel_fits(cfg, section, engine, allocation)


def _context_parallel_fits(
    cfg: PPOConfig, section: str, engine: TrainEngineConfig, allocation: ModelAllocation
) -> Iterator[FieldError]:
    """What context parallelism needs of ``section``'s engine."""
    c = allocation.parallel.cp_size
    budget = engine.mb_spec.max_tokens_per_mb
    if budget is not None and budget < 2 * c:
        yield FieldError(
            f"{section}.mb_spec.max_tokens_per_mb",
            f"{budget} tokens cannot hold one sequence under c{c}: every sequence is padded to "
            f"a multiple of 2c = {2 * c} tokens; set {section}.mb_spec.max_tokens_per_mb to at "
            f"least {2 * c} (or null)",
        )
    gpus = cfg.cluster.n_gpus_per_node
    if gpus > 0 and gpus % c and c % gpus:
        yield FieldError(
            f"{section}.backend",
            f"c{c} in {engine.backend!r} does not fit cluster.n_gpus_per_node {gpus}: a "
            "context-parallel group (c consecutive ranks) would straddle nodes unevenly, "
            f"with keys and values gathered in every layer; use a c that divides {gpus}",
        )
    kind = _uncovered_attention(engine.path)
    if kind is not None:
        fix = (
            f"use 'fsdp:d{allocation.parallel.world_size}' (no c)"
            if allocation.backend == "fsdp"
            else f"drop c from {section}.backend (keep the GPU count with d, t or p)"
        )
        yield FieldError(
            f"{section}.backend",
            f"context parallelism c{c} in {engine.backend!r} covers full causal attention, but "
            f"the model at {section}.path {engine.path!r} has {kind}; {fix} for this model",
        )


def _uncovered_attention(path: str) -> str | None:
    """The attention kind of the HF model at ``path`` that the context-parallel path does
    not compute (sliding windows, logit soft-capping), or None (also for no local config)."""
    config_file = Path(path) / "config.json" if path else None
    if config_file is None or not config_file.is_file():
        return None
    try:
        hf = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    window = hf.get("sliding_window")
    if window and hf.get("use_sliding_window", True):
        return f"sliding-window layers (sliding_window: {window})"
    if "sliding_attention" in (hf.get("layer_types") or []):
        return "sliding-window layers (layer_types: sliding_attention)"
    softcap = hf.get("attn_logit_softcapping")
    if softcap:
        return f"attention logit soft-capping (attn_logit_softcapping: {softcap})"
    return None


def _lora(cfg: PPOConfig, layout: _Layout) -> Iterator[FieldError]:
    for field in ("actor.use_lora", "rollout.use_lora"):
        section, name = field.split(".")
        if getattr(getattr(cfg, section), name):
            yield FieldError(
                field,
                "nothing loads LoRA adapters into the inference servers (/load_lora_adapter "
                "is never called), so every generation request would get HTTP 400; "
                f"set {field}: false",
            )


def _reference_model(cfg: PPOConfig, layout: _Layout) -> Iterator[FieldError]:
    # kl_ctl > 0 without reference log-probs would score every token against 0, turning
    # the penalty -kl_ctl x logp into a bonus; so a ref is built, or the config refused.
    ref = cfg.ref_config()
    if ref is None:
        return
    where = "ref" if cfg.ref is not None else "actor"  # where the ref's settings come from
    off = "or set actor.kl_ctl: 0 to train without a KL penalty"
    if ref.init_from_scratch:
        yield FieldError(
            "actor.kl_ctl",
            f"{cfg.actor.kl_ctl} needs a reference model that holds the initial policy, but "
            f"{where}.init_from_scratch is true (a second random model is another policy); "
            f"load weights ({where}.init_from_scratch: false), {off}",
        )
    try:
        ref_layout = parse_backend(ref.backend)
    except FieldError as e:
        yield e.with_prefix("ref")
        return
    if ref_layout.backend not in ("fsdp", "megatron"):
        yield FieldError(
            "ref.backend", f"{ref.backend!r}: the reference model runs on fsdp or megatron, {off}"
        )
    strategy = ref.scheduling_strategy
    if strategy.type != "colocation":
        return
    if strategy.target != "actor":
        yield FieldError(
            "ref.scheduling_strategy.target",
            f"colocating the ref with {strategy.target!r} is not implemented; set "
            f"ref.scheduling_strategy.target: actor or type: separation (own workers), {off}",
        )
    elif not strategy.fork and ref_layout.parallel.world_size == layout.actor.parallel.world_size:
        yield FieldError(
            "ref.scheduling_strategy.fork",
            "false would put a second engine, with its own process group, inside each actor "
            "worker process; set ref.scheduling_strategy.fork: true (a process beside each "
            f"actor worker) or type: separation, {off}",
        )


# --- rollout placement ---


def _colocation(cfg: PPOConfig, layout: _Layout) -> Iterator[FieldError]:
    strategy = cfg.rollout.scheduling_strategy
    if strategy.type != "colocation":
        return
    field = "rollout.scheduling_strategy"
    if strategy.target != "actor":
        yield FieldError(
            f"{field}.target",
            f"colocation with {strategy.target!r} is not implemented; set {field}.target: "
            f"actor or {field}.type: separation ({SUPPORTED_COLOCATION})",
        )
    if not strategy.fork:
        yield FieldError(
            f"{field}.fork",
            "colocation without fork (servers inside the actor's own worker processes) is "
            f"not implemented; set {field}.fork: true or {field}.type: separation "
            f"({SUPPORTED_COLOCATION})",
        )
    actor_workers = layout.actor.parallel.world_size
    r = layout.rollout.parallel
    wrong = []
    if r.pp_size > 1:
        wrong.append(f"servers of p{r.pp_size} (pipeline stages are not colocated)")
    if r.dp_size * r.tp_size != actor_workers:
        wrong.append(
            f"{r.dp_size} server(s) of TP {r.tp_size} on {r.dp_size * r.tp_size} device(s) "
            f"for {actor_workers} actor worker(s)"
        )
    if wrong:
        t = r.tp_size if actor_workers % r.tp_size == 0 else 1
        yield FieldError(
            "rollout.backend",
            f"colocated rollout {cfg.rollout.backend!r} has {' and '.join(wrong)}; set "
            f"rollout.backend: '{layout.rollout.backend}:d{actor_workers // t}p1t{t}' or "
            f"{field}.type: separation ({SUPPORTED_COLOCATION})",
        )


# --- SGLang launch flags and request budgets ---


def _sglang_flags(cfg: PPOConfig, layout: _Layout) -> Iterator[FieldError]:
    if not layout.sglang:
        return
    s = cfg.sglang
    if s.enable_ep_moe:
        yield FieldError(
            "sglang.enable_ep_moe",
            "--enable-ep-moe is not a flag of SGLang 0.5.9, 0.5.10.post1 or 0.5.23 (the "
            "server exits at argument parsing); set sglang.enable_ep_moe: false and use "
            "sglang.ep_size for expert parallelism",
        )
    if s.torchao_config:
        yield FieldError(
            "sglang.torchao_config",
            f"--torchao-config is not a flag of {_SGLANG_VERSIONS}, whose server exits at "
            "argument parsing; set sglang.torchao_config: ''",
        )
    if s.enable_nan_detection:
        yield FieldError(
            "sglang.enable_nan_detection",
            f"--enable-nan-detection is not a flag of {_SGLANG_VERSIONS}, whose server exits "
            "at argument parsing; set sglang.enable_nan_detection: false",
        )
    if s.skip_tokenizer_init:
        for name in ("gconfig", "eval_gconfig"):
            g = getattr(cfg, name)
            if g is not None and g.min_new_tokens > 0:
                yield FieldError(
                    f"{name}.min_new_tokens",
                    f"{g.min_new_tokens} needs a server with a tokenizer (SGLang penalizes "
                    "its EOS id), but sglang.skip_tokenizer_init is true; set "
                    f"{name}.min_new_tokens: 0 or sglang.skip_tokenizer_init: false",
                )


def _context_budget(cfg: PPOConfig, layout: _Layout) -> Iterator[FieldError]:
    context = cfg.sglang.context_length
    if context is None:
        return  # the server takes the model's own window, unknown here
    budgets = [("gconfig.max_tokens", cfg.gconfig.max_tokens)]
    if cfg.eval_gconfig is not None:
        budgets.append(("eval_gconfig.max_tokens", cfg.eval_gconfig.max_tokens))
    if cfg.rollout.agent.engine_max_tokens is not None:
        budgets.append(("rollout.agent.engine_max_tokens", cfg.rollout.agent.engine_max_tokens))
    for field, tokens in budgets:
        if tokens >= context:
            yield FieldError(
                field,
                f"{tokens} is not below sglang.context_length {context}: the "
                f"{layout.rollout.backend} server answers 400 when prompt + max_new_tokens "
                f">= context_length; set {field}: {context - 1} (context_length - 1)",
            )


# --- the rollout / trainer hand-off ---


def _consumer_batch(cfg: PPOConfig, layout: _Layout) -> Iterator[FieldError]:
    # The gate admits (eta + v + 1) x consumer_batch_size groups by version v while the
    # trainer consumes batch_size per version: smaller, and it soon waits forever. Larger
    # does not hang but is not harmless either: the surplus piles up and is trained on
    # later, so samples lag more than max_head_offpolicyness versions.
    consumer, batch = cfg.rollout.consumer_batch_size, cfg.train_dataset.batch_size
    if consumer < batch:
        yield FieldError(
            "rollout.consumer_batch_size",
            f"{consumer} is smaller than train_dataset.batch_size {batch}: the staleness "
            f"gate admits {consumer} group(s) per weight version while the trainer waits for "
            f"{batch}, so the run hangs without an error; set rollout.consumer_batch_size: "
            f"{batch} (e.g. ${{train_dataset.batch_size}})",
        )


def _xccl_layout(cfg: PPOConfig, layout: _Layout) -> Iterator[FieldError]:
    if cfg.actor.weight_update_mode != "xccl":
        return
    pp = layout.rollout.parallel.pp_size
    if pp > 1:
        yield FieldError(
            "actor.weight_update_mode",
            f"xccl cannot reach pipeline-parallel servers (p{pp} in rollout.backend "
            f"{cfg.rollout.backend!r}): a server joins the weight-update group with rank "
            "rank_offset + tp_rank in every pipeline stage, so the stages collide; set "
            "actor.weight_update_mode: disk, or p1 in rollout.backend",
        )
    s = cfg.sglang
    if layout.sglang and s.dp_size > 1 and not s.enable_dp_attention:
        yield FieldError(
            "sglang.dp_size",
            f"xccl with sglang.dp_size {s.dp_size} and no DP attention fails an assert in "
            "SGLang's /init_weights_update_group (HTTP 500); set sglang.dp_size: 1, "
            "sglang.enable_dp_attention: true, or actor.weight_update_mode: disk",
        )
    strategy = cfg.rollout.scheduling_strategy
    colocated = strategy is not None and strategy.type == "colocation"
    if colocated and cfg.cluster.n_gpus_per_node > 0:
        yield FieldError(
            "actor.weight_update_mode",
            "xccl between colocated roles would put the trainer rank and a server rank of "
            "the weight-update group on the same GPU, which NCCL refuses; set "
            "actor.weight_update_mode: disk (or cluster.n_gpus_per_node: 0 on CPU, where "
            "the group runs on gloo)",
        )


def _batch_per_rank(cfg: PPOConfig, layout: _Layout) -> Iterator[FieldError]:
    # For the hybrid megatron form dp_size is the attention d.
    dp, batch = layout.actor.parallel.dp_size, cfg.train_dataset.batch_size
    if batch < dp:
        yield FieldError(
            "train_dataset.batch_size",
            f"{batch} group(s) per step is fewer than the actor's {dp} data-parallel ranks "
            f"(d{dp} in actor.backend {cfg.actor.backend!r}), so a rank would get no group; "
            f"set train_dataset.batch_size to at least {dp} (a multiple of {dp} balances them)",
        )


# --- the cluster ---


def _ray_scheduler(cfg: PPOConfig, layout: _Layout) -> Iterator[FieldError]:
    scheduler = cfg.scheduler
    if scheduler.type != "ray":
        return
    address = (scheduler.ray_address or os.environ.get("RAY_ADDRESS") or "").strip()
    if not address:
        yield FieldError(
            "scheduler.ray_address",
            "is unset and so is $RAY_ADDRESS; scheduler.type 'ray' uses a running Ray cluster "
            "and never starts one: set scheduler.ray_address (or $RAY_ADDRESS) to the "
            "cluster's address (its GCS as host:port, or 'auto' on one of its nodes)",
        )
    elif address == "local":
        yield FieldError(
            "scheduler.ray_address",
            "'local' (here or in $RAY_ADDRESS) would start a new Ray cluster inside the "
            "controller; give the address of a running cluster (GCS host:port or 'auto')",
        )
    if cfg.cluster.name_resolve.type != "nfs":
        yield FieldError(
            "cluster.name_resolve.type",
            f"{cfg.cluster.name_resolve.type!r}: Ray workers register in 'nfs' records, as on "
            "Slurm; set cluster.name_resolve.type: nfs with nfs_record_root on storage every "
            "Ray node shares",
        )


CHECKS: tuple[Check, ...] = (
    _awex,
    _fsdp_tensor_parallel,
    _context_parallel,
    _colocation,
    _lora,
    _reference_model,
    _sglang_flags,
    _context_budget,
    _consumer_batch,
    _xccl_layout,
    _batch_per_rank,
    _ray_scheduler,
)


def _allocation(cfg: PPOConfig, section: str) -> ModelAllocation | FieldError:
    backend = getattr(cfg, section).backend
    if backend == MISSING:
        example = "'fsdp:d8'" if section == "actor" else "'sglang:d4t2'"
        return FieldError(f"{section}.backend", f"is not set; set an allocation, e.g. {example}")
    try:
        return parse_backend(backend)
    except FieldError as e:
        return e.with_prefix(section)


def unsupported(config: PPOConfig) -> list[FieldError]:
    """Every setting of ``config`` the trainer cannot honour, each naming its dotted field."""
    actor, rollout = _allocation(config, "actor"), _allocation(config, "rollout")
    broken = [a for a in (actor, rollout) if isinstance(a, FieldError)]
    if broken:
        return broken
    assert isinstance(actor, ModelAllocation) and isinstance(rollout, ModelAllocation)
    layout = _Layout(actor=actor, rollout=rollout)
    return [error for check in CHECKS for error in check(config, layout)]


def refuse_unsupported(config: PPOConfig) -> None:
    """Raise one :class:`ConfigError` listing every unsupported setting (one line each)."""
    errors = unsupported(config)
    if errors:
        lines = "\n".join(f"  {e}" for e in errors)
        raise ConfigError(
            f"this port's trainer cannot run this config ({len(errors)} problem(s)):\n{lines}"
        )
