"""``FSDPEngine``: a Hugging Face causal LM trained with torch FSDP2 on packed micro-batches.

* Process groups: NCCL on GPU, gloo on CPU; world size ``d x c`` (``fsdp:dXcY``): data
  parallel over ``d``, context parallel over ``c`` (tensor and pipeline parallelism belong
  to the Megatron engine). FSDP shards the parameters over all ``d x c`` ranks.
* Model: ``AutoModelForCausalLM`` from ``config.path``, master weights in fp32, each
  decoder layer and the root sharded with ``fully_shard``; compute in ``config.dtype``,
  gradient reduction in ``grad_reduce_dtype``; optional activation checkpointing. Model
  families transformers cannot tell sequence boundaries (Ling 3's KDA layers) get a
  packed-sequence forward from :mod:`areal.models`.
* Micro-batches: a padded batch is split by token budget (``mb_spec``) into packed
  streams; attention runs per sequence (:mod:`areal.engine.attention`) and next-token
  log-probs come from the final hidden states in chunks (:mod:`areal.engine.logprobs`),
  so full-vocabulary logits never exist for a whole micro-batch.
* ``use_kernels``: decoder layers and the log-prob chunk maths run as ``torch.compile``
  kernels (same numbers to float rounding; on one H200 it took a 0.5B model from 22.5 % to
  32.6 % MFU, see docs/training.md).
* Context parallelism (``c > 1``): the ``c`` ranks of a group take the same batch and the
  same micro-batches; each holds a load-balanced share of every sequence
  (:mod:`areal.engine.context_parallel`), runs the model and the LM head on it, and gathers
  its log-probs and entropies back into the micro-batch's stream, so the loss function
  sees exactly what it sees at ``c = 1``.
* ``train_batch``: the loss of each micro-batch is weighted by ``loss_weight_fn(mb) / W``
  (``W`` summed over micro-batches and ranks) and multiplied by the world size (FSDP
  averages gradients), so one step optimizes the token mean of the global batch; the
  gradient norm is clipped and a non-finite norm skips the step.
* Checkpoints: HF safetensors (gathered on rank 0, with the tokenizer) and torch DCP
  (sharded model, optimizer, LR schedule and RNG state). HF saves and weight updates use
  the names of the checkpoint the model came from (Ling 3's official names); both live in
  :mod:`areal.engine.fsdp_state`.
* Weight sync to inference: over disk (every backend) or NCCL broadcast in buckets from
  rank 0 (GPU).
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from areal.api.cli_args import TrainEngineConfig
from areal.api.engine_api import InferenceEngine, TrainEngine
from areal.api.io_struct import FinetuneSpec, WeightUpdateMeta
from areal.engine.attention import packed_forward_kwargs, register_varlen_attention
from areal.engine.checkpoint import CheckpointFormats
from areal.engine.context_parallel import ContextShard
from areal.engine.fsdp_state import FSDPStateIO
from areal.engine.logprobs import gather_logprobs, next_token_labels
from areal.engine.optim import build_lr_scheduler, build_optimizer
from areal.engine.train_common import (
    PROCESS_GROUP_TIMEOUT,
    LossFn,
    WeightFn,
    context_parallel_stream,
    flat_micro_batch,
    init_default_process_group,
    mask_last_tokens,
    to_dtype,
)
from areal.engine.weight_sync import RolloutWeightSync
from areal.models import (
    enable_packed_sequences,
)
from areal.utils import logging
from areal.utils.packing import split_padded_tensor_dict_into_mb_list

__all__ = ["FSDPEngine", "PolicyModule"]

logger = logging.getLogger("engine.fsdp")


class PolicyModule(nn.Module):
    """The causal LM plus chunked next-token log-probs, as one FSDP root module.

    Calling the LM head weight inside this module's forward means FSDP has it unsharded
    there (tied embeddings included), and the chunked log-prob function recomputes
    logits in backward instead of keeping ``[T, vocab]`` activations.
    """

    def __init__(self, model: nn.Module, logprobs_chunk_size: int, fused_logprobs: bool = False):
        super().__init__()
        self.model = model
        self.chunk_size = logprobs_chunk_size
        self.fused_logprobs = fused_logprobs

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int,
        temperature: float,
        shard: ContextShard | None = None,
        labels: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token ``(logp, entropy)`` ``[T]`` of ``input_ids`` ``[1, T]``.

        Under context parallelism ``input_ids`` are the ``shard``'s tokens, ``cu_seqlens``
        its local chunks and ``labels`` ``[T]`` their next tokens (a chunk's last token is
        followed by a token of another rank).
        """
        base = getattr(self.model, self.model.base_model_prefix)
        out = base(
            input_ids=input_ids,
            position_ids=position_ids,
            **packed_forward_kwargs(cu_seqlens, max_seqlen, shard),  # includes use_cache=False
        )
        hidden = out.last_hidden_state[0]
        if labels is None:
            labels = next_token_labels(input_ids[0], cu_seqlens)
        weight = self.model.get_output_embeddings().weight
        logp, entropy = gather_logprobs(
            hidden,
            weight,
            labels,
            temperature=temperature,
            chunk_size=self.chunk_size,
            fused=self.fused_logprobs,
        )
        return logp, entropy


def compile_decoder_layers(layers: list[nn.Module]) -> None:
    """``torch.compile`` each decoder layer's ``forward`` (``use_kernels``).

    The norms, rotary embedding, activation and residual adds fuse into a few kernels;
    attention stays an opaque call (a graph break). All layers share one code object, so
    they share the compiled graphs; shapes are dynamic, so packed streams of any length
    reuse them. FSDP's hooks run around ``forward``, outside the compiled region.
    """
    import torch._dynamo

    # train/eval and grad/no-grad variants per layer class, with room to spare
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 32)
    for layer in layers:
        layer.forward = torch.compile(layer.forward, dynamic=True)


class FSDPEngine(FSDPStateIO, CheckpointFormats, RolloutWeightSync, TrainEngine):
    def __init__(self, config: TrainEngineConfig):
        self.config = config
        self.module: PolicyModule | None = None
        self.model: nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.lr_scheduler: torch.optim.lr_scheduler.LambdaLR | None = None
        self.tokenizer: Any = None
        self.device = torch.device("cpu")
        self._mesh = None
        self._dp_group: dist.ProcessGroup | None = None
        self._cp_group: dist.ProcessGroup | None = None
        self._cp_size = 1
        self._cpu_group: dist.ProcessGroup | None = None
        self._reporter_group: dist.ProcessGroup | None = None  # CP rank 0 of each group
        self._own_process_group = False
        self._version = 0
        self.rollout_engine: InferenceEngine | None = None
        self._weight_group: dist.ProcessGroup | None = None
        self._weight_meta: WeightUpdateMeta | None = None

    # --- process groups ---

    def _context_parallel_size(self, parallel_strategy: Any) -> int:
        """``c`` of ``parallel_strategy``, else of ``config.backend``; refuses t and p."""
        if parallel_strategy is None:
            backend = getattr(self.config, "backend", None)
            if not (isinstance(backend, str) and backend.startswith("fsdp")):
                return 1
            from areal.api.alloc_mode import ModelAllocation

            parallel_strategy = ModelAllocation.from_str(backend).parallel
        extra = {
            k: getattr(parallel_strategy, k, 1)
            for k in ("tensor_parallel_size", "pipeline_parallel_size")
        }
        if any(v not in (None, 1) for v in extra.values()):
            raise ValueError(
                f"the FSDP engine is data and context parallel only (got {extra}); use the "
                "Megatron backend for tensor or pipeline parallelism"
            )
        return getattr(parallel_strategy, "context_parallel_size", 1) or 1

    def create_process_group(self, parallel_strategy: Any = None) -> None:
        cp = self._context_parallel_size(parallel_strategy)
        device, created = init_default_process_group()
        if device is not None:
            self.device = device
        self._own_process_group = self._own_process_group or created
        from torch.distributed.device_mesh import init_device_mesh

        world = dist.get_world_size()
        if world % cp:
            raise ValueError(
                f"actor.backend: context parallelism c{cp} does not divide the {world} ranks; "
                f"launch a multiple of {cp} ranks (world size = d x c)"
            )
        self._cpu_group = (
            dist.new_group(backend="gloo", timeout=PROCESS_GROUP_TIMEOUT)
            if dist.get_backend() != "gloo"
            else dist.group.WORLD
        )
        self._cp_size = cp
        if cp == 1:
            self._mesh = init_device_mesh(self.device.type, (world,), mesh_dim_names=("dp",))
            self._dp_group = self._mesh.get_group("dp")
            return
        # FSDP shards over every rank; a CP group is c consecutive ranks (one node's NVLink)
        self._mesh = init_device_mesh(self.device.type, (world,), mesh_dim_names=("fsdp",))
        rank = dist.get_rank()
        for start in range(0, world, cp):
            group = dist.new_group(list(range(start, start + cp)), timeout=PROCESS_GROUP_TIMEOUT)
            if start <= rank < start + cp:
                self._cp_group = group
        for offset in range(cp):
            group = dist.new_group(list(range(offset, world, cp)), timeout=PROCESS_GROUP_TIMEOUT)
            if rank % cp == offset:
                self._dp_group = group
        reporters = list(range(0, world, cp))
        group = dist.new_group(reporters, backend="gloo", timeout=PROCESS_GROUP_TIMEOUT)
        self._reporter_group = group if rank in reporters else None

    @property
    def data_parallel_group(self) -> dist.ProcessGroup:
        return self._dp_group

    @property
    def data_parallel_rank(self) -> int:
        return dist.get_rank(self._dp_group)

    @property
    def data_parallel_world_size(self) -> int:
        return dist.get_world_size(self._dp_group)

    @property
    def context_parallel_world_size(self) -> int:
        return self._cp_size

    @property
    def context_and_model_parallel_group(self) -> dist.ProcessGroup | None:
        """The ranks that share one batch (the context-parallel group); None at ``c = 1``."""
        return self._cp_group

    def current_data_parallel_head(self) -> int:
        if self._cp_group is None:
            return super().current_data_parallel_head()
        return min(dist.get_process_group_ranks(self._cp_group))

    @property
    def cpu_group(self) -> dist.ProcessGroup:
        return self._cpu_group

    # --- model ---

    def initialize(
        self, addr: str | None = None, ft_spec: FinetuneSpec | None = None, **kwargs: Any
    ) -> None:
        if addr is not None:
            raise ValueError("FSDPEngine.initialize takes no address (addr must be None)")
        if self._mesh is None:
            self.create_process_group(kwargs.get("parallel_strategy"))
        from transformers import AutoConfig, AutoModelForCausalLM

        cfg = self.config
        if not cfg.path:
            raise ValueError("actor.path must name an HF model directory")
        attn = register_varlen_attention()
        hf_config = AutoConfig.from_pretrained(cfg.path)
        if cfg.disable_dropout:
            for key in ("attention_dropout", "hidden_dropout", "dropout", "resid_pdrop"):
                if hasattr(hf_config, key):
                    setattr(hf_config, key, 0.0)
        # use_kernels=False: transformers >= 5.25 otherwise fetches hub kernels at load, which
        # an offline cluster cannot; flash-linear-attention is still used where installed
        load = dict(dtype=torch.float32, attn_implementation=attn)
        if not cfg.init_from_scratch:
            load["use_kernels"] = False
        if cfg.init_from_scratch:
            model = AutoModelForCausalLM.from_config(hf_config, **load)
        else:
            model = AutoModelForCausalLM.from_pretrained(cfg.path, config=hf_config, **load)
        if cfg.disable_dropout:
            for module in model.modules():
                if isinstance(module, nn.Dropout):
                    module.p = 0.0
        enable_packed_sequences(model)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False}
            )
        model.to(self.device)
        self.model = model
        self.module = PolicyModule(model, cfg.logprobs_chunk_size, fused_logprobs=cfg.use_kernels)
        layers = self._shard(self.module)
        if cfg.use_kernels:
            compile_decoder_layers(layers)
        if cfg.optimizer is not None:
            self.optimizer = build_optimizer(
                self.module.parameters(), cfg.optimizer, self.device.type
            )
            total = ft_spec.total_train_steps if ft_spec is not None else 1
            self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.optimizer, total)
        self._load_tokenizer()
        logger.info(
            "FSDP engine ready: %s on %d %s rank(s), compute %s",
            cfg.path,
            dist.get_world_size(),
            self.device.type,
            cfg.dtype,
        )

    def _shard(self, module: PolicyModule) -> list[nn.Module]:
        """``fully_shard`` each decoder layer and the root; returns the decoder layers."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        compute = to_dtype(self.config.dtype)
        mp = MixedPrecisionPolicy(
            param_dtype=None if compute == torch.float32 else compute,
            reduce_dtype=to_dtype(self.config.grad_reduce_dtype),
        )
        layer_names = set(
            (self.config.fsdp.wrap_policy.transformer_layer_cls_to_wrap or [])
            if self.config.fsdp.wrap_policy is not None
            else []
        ) or set(getattr(module.model, "_no_split_modules", None) or [])
        layers = [m for m in module.model.modules() if type(m).__name__ in layer_names]
        if not layers:
            raise ValueError(
                f"no decoder layers found to shard (looked for {sorted(layer_names)}); set "
                "actor.fsdp.wrap_policy.transformer_layer_cls_to_wrap"
            )
        # with one rank there is nothing to re-gather in backward: keep layers unsharded
        reshard = dist.get_world_size() > 1
        for layer in layers:
            fully_shard(layer, mesh=self._mesh, mp_policy=mp, reshard_after_forward=reshard)
        fully_shard(module, mesh=self._mesh, mp_policy=mp, reshard_after_forward=False)
        return layers

    def _load_tokenizer(self) -> None:
        from transformers import AutoTokenizer

        with contextlib.suppress(Exception):  # a weights-only directory is fine for training
            self.tokenizer = AutoTokenizer.from_pretrained(self.config.path)

    def destroy(self) -> None:
        self.module = self.model = self.optimizer = self.lr_scheduler = None
        if self._own_process_group and dist.is_initialized():
            dist.destroy_process_group()
            self._own_process_group = False
        self._mesh = None
        self._dp_group = self._cp_group = self._reporter_group = None
        self._cp_size = 1

    def train(self, mode: bool = True) -> FSDPEngine:
        assert self.module is not None, "initialize() the engine first"
        self.module.train(mode)
        return self

    # --- forward ---

    def _micro_batches(self, input_: dict[str, Any]):
        batch = {
            k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in input_.items()
        }
        return split_padded_tensor_dict_into_mb_list(
            batch, self.config.mb_spec, group=self._cpu_group
        )

    def _forward(self, mb: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(logp, entropy)`` ``[T]`` over the micro-batch's packed stream ``[1, T]``."""
        assert self.module is not None, "initialize() the engine first"
        if self._cp_size > 1:
            return self._context_parallel_forward(mb)
        return self.module(
            mb["input_ids"],
            mb["position_ids"],
            mb["cu_seqlens"],
            int(mb["max_seqlen"]),
            float(self.config.temperature),
        )

    def _context_parallel_forward(self, mb: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """:meth:`_forward` on this rank's share, gathered back into the micro-batch's stream.

        Every rank of the group gets the whole ``(logp, entropy)``, so each computes the same
        loss; the gather's backward sums the group's (equal) gradients, ``c`` times one
        rank's, which FSDP's average over ``d x c`` ranks divides back out.
        """
        ids, cu_seqlens = mb["input_ids"][0], mb["cu_seqlens"]
        stream = context_parallel_stream(
            ids,
            cu_seqlens,
            int(mb["n_rows"]),
            next_token_labels(ids, cu_seqlens),
            self._cp_size,
            dist.get_rank(self._cp_group),
            self._cp_group,
        )
        shard = stream.shard
        logp, entropy = self.module(
            stream.input_ids,
            stream.position_ids,
            shard.local_cu_seqlens,
            shard.max_seqlen // (2 * self._cp_size),  # the longest local chunk
            float(self.config.temperature),
            shard=shard,
            labels=stream.labels,
        )
        return stream.gather(logp, entropy)

    @torch.no_grad()
    def forward_batch(self, input_: dict[str, Any], **kwargs: Any) -> torch.Tensor:
        """Per-token log-probs ``[B, L]``: position ``t`` scores token ``t + 1`` (0 at the
        last real position and on padding)."""
        was_training = self.module.training
        self.train(False)
        try:
            mb_list = self._micro_batches(input_)
            outputs = [self._forward(mb)[0] for mb in mb_list.mbs]
            logp = mb_list.to_padded(outputs, pad_value=0.0).to(torch.float32)
            return mask_last_tokens(logp, input_["attention_mask"])
        finally:
            self.train(was_training)

    # --- training ---

    def _global_weight(self, weights: list[float]) -> float:
        total = torch.tensor([sum(weights)], dtype=torch.float64)
        dist.all_reduce(total, group=self._cpu_group)
        return float(total.item())

    def train_batch(
        self, input_: dict[str, Any], loss_fn: LossFn, loss_weight_fn: WeightFn
    ) -> dict[str, float]:
        self.train(True)
        mb_list = self._micro_batches(input_)
        weights = [float(loss_weight_fn(flat_micro_batch(mb))) for mb in mb_list.mbs]
        total = self._global_weight(weights)
        self.optimizer_zero_grad()
        if total <= 0:
            logger.warning("train_batch: no trainable tokens in the global batch; step skipped")
            return {"update_successful": 0.0, "grad_norm": 0.0, "lr": self._lr(), "loss": 0.0}
        # FSDP averages gradients over every rank; under context parallelism the c ranks of a
        # group hold copies of each micro-batch, and W counts them c times: the two cancel
        world = dist.get_world_size()
        losses = []  # kept on the device: reading each one would stall the launch queue
        for mb, weight in zip(mb_list.mbs, weights, strict=True):
            logp, entropy = self._forward(mb)
            loss = loss_fn(logp, entropy, flat_micro_batch(mb))
            (loss * (weight / total * world)).backward()
            losses.append(loss.detach().double() * (weight / total))
        stats = self.optimizer_step()
        loss_tensor = torch.stack(losses).sum().reshape(1).cpu()
        dist.all_reduce(loss_tensor, group=self._cpu_group)
        return {**stats, "loss": float(loss_tensor.item()), "num_micro_batches": len(weights)}

    @torch.no_grad()
    def eval_batch(self, input_: dict[str, Any], loss_fn: LossFn, loss_weight_fn: WeightFn):
        was_training = self.module.training
        self.train(False)
        try:
            mb_list = self._micro_batches(input_)
            weights = [float(loss_weight_fn(flat_micro_batch(mb))) for mb in mb_list.mbs]
            total = self._global_weight(weights)
            value = torch.zeros(1, dtype=torch.float64)
            for mb, weight in zip(mb_list.mbs, weights, strict=True):
                logp, entropy = self._forward(mb)
                value += (
                    float(loss_fn(logp, entropy, flat_micro_batch(mb))) * weight / max(total, 1e-12)
                )
            dist.all_reduce(value, group=self._cpu_group)
            return float(value.item())
        finally:
            self.train(was_training)

    def optimizer_zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else 0.0

    def optimizer_step(self) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("this engine has no optimizer (actor.optimizer is null)")
        clip = self.config.optimizer.gradient_clipping
        params = [p for p in self.module.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        grad_norm = float(norm)
        if not torch.isfinite(torch.tensor(grad_norm)):
            self.optimizer_zero_grad()
            logger.warning("non-finite gradient norm %s: optimizer step skipped", grad_norm)
            return {"update_successful": 0.0, "grad_norm": grad_norm, "lr": self._lr()}
        self.optimizer.step()
        self.optimizer_zero_grad()
        return {
            "update_successful": 1.0,
            "grad_norm": grad_norm,
            "lr": self._lr(),
            "optimizer_steps": self._optimizer_steps(),
        }

    def _optimizer_steps(self) -> float:
        """Steps recorded in the optimizer state (restored with a checkpoint)."""
        for state in self.optimizer.state.values():
            step = state.get("step")
            if step is not None:
                return float(step.full_tensor() if hasattr(step, "full_tensor") else step)
        return 0.0

    def lr_scheduler_step(self) -> None:
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()

    step_lr_scheduler = lr_scheduler_step

    # --- versions ---

    def set_version(self, version: int) -> None:
        self._version = version

    def get_version(self) -> int:
        return self._version

    # --- housekeeping ---

    def export_stats(self) -> dict[str, float]:
        """This process's recorded statistics, reduced over the ranks (a collective)."""
        from areal.utils import stats_tracker

        if self._cp_size == 1:
            return stats_tracker.export_all(reduce_group=self._cpu_group)
        # the c ranks of a context-parallel group record the same statistics: one counts
        if self._reporter_group is not None:
            stats = stats_tracker.export_all(reduce_group=self._reporter_group)
        else:
            stats_tracker.export_all()  # drop the copies
            stats = None
        box = [stats]
        dist.broadcast_object_list(box, src=0, group=self._cpu_group)
        return box[0]

    def get_device_stats(self) -> dict[str, float]:
        if self.device.type != "cuda":
            return {}
        return {
            "allocated_gb": torch.cuda.memory_allocated() / 2**30,
            "max_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
        }
