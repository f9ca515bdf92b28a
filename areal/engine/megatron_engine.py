"""``MegatronEngine``: a Hugging Face checkpoint trained on megatron-core, bridged by mbridge.

* Process groups (:mod:`areal.engine.megatron_parallel`): Megatron-Core's tensor /
  pipeline / context / expert / data groups from the allocation string
  (``megatron:d2t2p1``, or ``megatron:(attn:...|ffn:...)`` for MoE), plus a gloo group.
* Model (:mod:`areal.engine.megatron_model`): ``mbridge.AutoBridge`` turns the HF config
  into a ``TransformerConfig`` and a ``GPTModel`` (one chunk per virtual pipeline stage),
  loads the HF safetensors into the sharded parameters and exports them back under HF
  names. Layers use Megatron's local (non Transformer Engine) modules with the packed
  causal attention of :mod:`areal.engine.attention`, so the engine runs where only torch is
  installed; the few megatron-core / mbridge internals that assume otherwise are patched
  in :mod:`areal.engine.megatron_compat`, and nowhere else.
* Micro-batches: the same packed varlen streams as :class:`FSDPEngine` (THD layout with
  ``cu_seqlens``), run through Megatron's pipeline schedule (``get_forward_backward_func``).
  Log-probs come from the final hidden states in chunks without tensor parallelism, else
  from the vocab-parallel logits (log-sum-exp reduced over the TP group).
* Context parallelism (``c``, no Transformer Engine): every CP rank takes the same
  micro-batches and runs the model on its zigzag share of each (:func:`~areal.engine.
  train_common.context_parallel_stream`, as the FSDP engine does): attention gathers keys
  and values over the CP group, KDA swaps tokens for heads, rotary embeddings take global
  positions. The share's log-probs and entropies are gathered back into the micro-batch's
  stream, so the loss function sees exactly what it sees at ``c1`` (whole sequences, the
  same counts), the same on every CP rank; statistics count from CP rank 0 only.
* ``train_batch``: each micro-batch loss is weighted ``w_mb / W`` (``W`` summed over the
  data-parallel ranks) and multiplied by the DP size and by the number of micro-batches,
  which undoes the schedule's division by the micro-batch count and DDP's gradient
  averaging: one step optimizes the token mean of the global batch, as FSDP does. Under CP
  the loss is also divided by ``c``, twice over: the schedule multiplies every loss by
  ``c`` (for losses of a share), and the gather's backward sums the ``c`` ranks' equal
  gradients; DDP's average over the ``d x c`` ranks then leaves the ``c1`` gradient.
* Optimizer: Megatron's (distributed) optimizer over DDP gradient buffers; the global
  gradient norm is clipped and a non-finite norm skips the step. LR schedule: the same
  warmup + constant/linear/cosine multiplier as the FSDP engine.
* Checkpoints (:mod:`areal.engine.megatron_checkpoint`): HF safetensors exported through
  the bridge (rank 0 writes) and Megatron's distributed checkpoint (torch DCP format) for
  recover, optimizer optional.
* Weight sync to inference: over disk (HF export) or NCCL in buckets from rank 0, with the
  same protocol as the FSDP engine; the bridge gathers TP/PP/EP shards for every tensor.

megatron-core and mbridge are imported inside methods only: importing this module needs
neither (``pip install 'areal-arena[megatron]'`` for using it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from areal.api.cli_args import TrainEngineConfig
from areal.api.engine_api import InferenceEngine, TrainEngine
from areal.api.io_struct import FinetuneSpec
from areal.engine import megatron_compat
from areal.engine.checkpoint import CheckpointFormats
from areal.engine.logprobs import gather_logprobs, next_token_labels
from areal.engine.megatron_checkpoint import MegatronCheckpointIO
from areal.engine.megatron_model import (
    build_megatron_optimizer,
    clip_grad_norm,
    fp32_lm_head,
    sequence_parallel_for,
    transformer_overrides,
    unwrap,
)
from areal.engine.megatron_parallel import MegatronParallelGroups
from areal.engine.optim import lr_multiplier
from areal.engine.train_common import (
    ContextParallelStream,
    LossFn,
    WeightFn,
    context_parallel_stream,
    flat_micro_batch,
    mask_last_tokens,
    to_dtype,
)
from areal.engine.weight_sync import RolloutWeightSync
from areal.utils import logging
from areal.utils.packing import split_padded_tensor_dict_into_mb_list

__all__ = ["MegatronEngine", "vocab_parallel_logprobs"]

logger = logging.getLogger("engine.megatron")


# --- log-probs over a vocab-parallel LM head ---


def vocab_parallel_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, tp_group: Any, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_softmax(logits / temperature)`` at ``labels``, and the entropy, for vocab shards.

    ``logits`` ``[T, V / tp]`` (this rank's slice of the vocabulary, any float dtype),
    ``labels`` ``[T]`` global token ids. Returns ``(logp [T], entropy [T])`` in float32;
    ``logp`` is differentiable (Megatron's vocab-parallel cross entropy), ``entropy`` is
    detached and only reported.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    with torch.no_grad():
        entropy = _vocab_parallel_entropy(logits, tp_group)
    # the cross entropy shifts its input in place: give it its own copy
    logp = -vocab_parallel_cross_entropy(logits.clone(), labels.long())
    return logp, entropy


def _vocab_parallel_entropy(logits: torch.Tensor, tp_group: Any) -> torch.Tensor:
    # H = lse - sum_v p_v * logit_v, with max, sum-exp and the weighted sum reduced over TP
    peak = logits.max(-1).values
    dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=tp_group)
    shifted = logits - peak[:, None]
    sum_exp = shifted.exp().sum(-1)
    dist.all_reduce(sum_exp, group=tp_group)
    probs = (shifted - sum_exp.log()[:, None]).exp()
    weighted = (probs * shifted).sum(-1)
    dist.all_reduce(weighted, group=tp_group)
    return sum_exp.log() - weighted


class MegatronEngine(
    MegatronParallelGroups, MegatronCheckpointIO, CheckpointFormats, RolloutWeightSync, TrainEngine
):
    def __init__(self, config: TrainEngineConfig):
        self.config = config
        self.model: list[torch.nn.Module] = []
        self.bridge: Any = None
        self.optimizer: Any = None
        self.tokenizer: Any = None
        self.device = torch.device("cpu")
        self.parallel: Any = None
        self._cpu_group: dist.ProcessGroup | None = None
        self._mp_group: dist.ProcessGroup | None = None
        self._reporter_group: dist.ProcessGroup | None = None
        self._reporters: list[int] = []
        self._own_process_group = False
        self._groups_ready = False
        self._version = 0
        self._lr_step = 0
        self._total_steps = 1
        self._training = True
        self._sequence_parallel = False
        self.rollout_engine: InferenceEngine | None = None
        self._weight_group: dist.ProcessGroup | None = None

    # --- model ---

    def initialize(
        self, addr: str | None = None, ft_spec: FinetuneSpec | None = None, **kwargs: Any
    ) -> None:
        if addr is not None:
            raise ValueError("MegatronEngine.initialize takes no address (addr must be None)")
        if not self._groups_ready:
            self.create_process_group(kwargs.get("parallel_strategy"))
        from mbridge import AutoBridge

        from areal.engine import megatron_bailing  # noqa: F401  (registers the Ling 3 bridge)

        cfg = self.config
        if not cfg.path:
            raise ValueError("actor.path must name an HF model directory")
        dtype = to_dtype(cfg.dtype)
        self.bridge = AutoBridge.from_pretrained(cfg.path, dtype=dtype)
        megatron_compat.apply_patches(self.bridge)
        self._sequence_parallel = sequence_parallel_for(self.bridge, self.parallel.tp_size)
        self.bridge.set_extra_args(
            **transformer_overrides(cfg, self.device, self.bridge.config, self._sequence_parallel)
        )
        train = cfg.optimizer is not None
        mcfg = cfg.megatron
        ddp = dataclasses.asdict(mcfg.ddp) if hasattr(mcfg.ddp, "__dataclass_fields__") else {}
        ddp = {k: v for k, v in ddp.items() if not k.startswith("_")}
        self.model = self.bridge.get_model(
            wrap_with_ddp=train,
            bf16=dtype == torch.bfloat16,
            fp16=dtype == torch.float16,
            ddp_config=ddp,
            use_cpu_initialization=self.device.type == "cpu",
            data_parallel_random_init=False,
        )
        if not cfg.init_from_scratch:
            self.bridge.load_weights(self.model, cfg.path)
        if cfg.use_kernels:
            megatron_compat.enable_compiled_rope(self.model)
        if mcfg.enable_fp32_lm_head and self._is_last_stage:
            for chunk in self.model:
                head = getattr(unwrap(chunk), "output_layer", None)
                if head is not None:
                    head.register_forward_pre_hook(fp32_lm_head, with_kwargs=True)
        self._head_weights: list[torch.Tensor] = []
        self._chunked_head = self._install_chunked_head()
        if train:
            self.optimizer = build_megatron_optimizer(cfg, self.model)
            self._total_steps = ft_spec.total_train_steps if ft_spec is not None else 1
            self._apply_lr()
        self._load_tokenizer()
        logger.info(
            "Megatron engine ready: %s on %d %s rank(s) (%s), compute %s",
            cfg.path,
            dist.get_world_size(),
            self.device.type,
            self.parallel,
            cfg.dtype,
        )

    def _install_chunked_head(self) -> bool:
        """Without tensor parallelism, the output layer hands its input through and the loss
        computes log-probs chunk by chunk from it (:func:`gather_logprobs`), as the FSDP
        engine does: no ``[T, vocab]`` logits are kept, so micro-batches can be as large.

        With tensor parallelism the vocabulary is sharded and the full-logits vocab-parallel
        path stays. Returns whether the chunked head is in use on this rank.
        """
        if self.parallel.tp_size != 1 or not self._is_last_stage:
            return False
        heads = [getattr(unwrap(chunk), "output_layer", None) for chunk in self.model]
        heads = [head for head in heads if head is not None]
        if not heads or getattr(self.bridge.config, "mtp_num_layers", None):
            return False  # multi-token prediction reads real logits from the output layer
        patched = [
            megatron_compat.pass_hidden_through_output_layer(head, self._head_weights)
            for head in heads
        ]
        return all(patched)

    def _load_tokenizer(self) -> None:
        from transformers import AutoTokenizer

        with contextlib.suppress(Exception):  # a weights-only directory is fine for training
            self.tokenizer = AutoTokenizer.from_pretrained(self.config.path)

    def destroy(self) -> None:
        self.model, self.optimizer, self.bridge = [], None, None
        self._destroy_process_groups()

    def train(self, mode: bool = True) -> MegatronEngine:
        assert self.model, "initialize() the engine first"
        for chunk in self.model:
            chunk.train(mode)
        self._training = mode
        return self

    # --- forward ---

    def _micro_batches(self, input_: dict[str, Any]):
        batch = {
            k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in input_.items()
        }
        # sequence parallelism splits every stream over the TP ranks
        multiple = math.lcm(64, self.parallel.tp_size)
        return split_padded_tensor_dict_into_mb_list(
            batch, self.config.mb_spec, group=self._cpu_group, pad_to_multiple=multiple
        )

    def _context_parallel_stream(self, mb: dict[str, Any]) -> ContextParallelStream:
        """This rank's share of a packed micro-batch under context parallelism."""
        from megatron.core import parallel_state

        ids, cu_seqlens = mb["input_ids"][0], mb["cu_seqlens"]
        return context_parallel_stream(
            ids,
            cu_seqlens,
            int(mb["n_rows"]),
            next_token_labels(ids, cu_seqlens),
            self.parallel.cp_size,
            parallel_state.get_context_parallel_rank(),
            parallel_state.get_context_parallel_group(),
            # sequence parallelism splits each share over the TP ranks
            multiple=self.parallel.tp_size if self._sequence_parallel else 1,
        )

    def _run_schedule(self, mbs: list[dict[str, Any]], loss_of, forward_only: bool) -> list:
        """Megatron's pipeline schedule over packed micro-batches.

        ``loss_of(mb, logp, entropy) -> (scaled_loss, report)`` runs on the last pipeline
        stage with the log-probs and entropies ``[T]`` of the micro-batch's packed stream
        (under CP gathered from the group's shares); returns the ``report`` dicts of the
        micro-batches there (empty elsewhere).
        """
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from areal.engine.megatron_model import packed_seq_params_class

        temperature = float(self.config.temperature)
        tp_group = self._tp_group
        packed_seq_params = packed_seq_params_class()
        streams: dict[int, ContextParallelStream] = {}
        if self.parallel.cp_size > 1:
            streams = {id(mb): self._context_parallel_stream(mb) for mb in mbs}

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            stream = streams.get(id(mb))
            if stream is None:
                cu = mb["cu_seqlens"].to(torch.int32)
                seqlen, shard = int(mb["max_seqlen"]), None
                input_ids, position_ids = mb["input_ids"], mb["position_ids"]
                labels = next_token_labels(input_ids[0], cu)
            else:  # attention and rotary embeddings see the padded global stream's bounds
                shard = stream.shard
                cu, seqlen = shard.cu_seqlens, shard.max_seqlen
                input_ids, position_ids, labels = (
                    stream.input_ids, stream.position_ids, stream.labels
                )  # fmt: skip
            packed = packed_seq_params(
                qkv_format="thd",
                cu_seqlens_q=cu,
                cu_seqlens_kv=cu,
                max_seqlen_q=seqlen,
                max_seqlen_kv=seqlen,
                context_shard=shard,
            )
            output = model(
                input_ids=input_ids,
                position_ids=position_ids,
                attention_mask=None,
                packed_seq_params=packed,
            )

            def loss_func(logits: torch.Tensor):
                if self._chunked_head:  # "logits" are the final hidden states [1, T, H]
                    weight = self._head_weights.pop()
                    hidden = logits[0]
                    if weight.dtype in (torch.bfloat16, torch.float16):
                        # Megatron's half-precision wrapper hands the last stage's output
                        # back as fp32; the values are 16-bit, so this cast is exact
                        hidden = hidden.to(weight.dtype)
                    logp, entropy = gather_logprobs(
                        hidden,
                        weight,
                        labels,
                        temperature=temperature,
                        chunk_size=self.config.logprobs_chunk_size,
                        fused=self.config.use_kernels,
                    )
                else:
                    logp, entropy = vocab_parallel_logprobs(
                        logits[0], labels, tp_group, temperature
                    )
                if stream is not None:
                    logp, entropy = stream.gather(logp, entropy)
                return loss_of(mb, logp, entropy)

            return output, loss_func

        n_chunks = len(self.model)
        iterators = [iter(mbs) for _ in range(n_chunks)]
        # the schedule's pipeline buffers hold seq_length / c tokens (/ t with sequence
        # parallelism): under CP that is a share of the padded stream
        seq_length = max(
            int(streams[id(mb)].input_ids.shape[-1]) * self.parallel.cp_size
            if streams
            else int(mb["input_ids"].shape[-1])
            for mb in mbs
        )
        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if n_chunks > 1 else iterators[0],
            model=self.model if n_chunks > 1 else self.model[0],
            num_microbatches=len(mbs),
            seq_length=seq_length,
            micro_batch_size=1,
            forward_only=forward_only,
        )

    @torch.no_grad()
    def forward_batch(self, input_: dict[str, Any], **kwargs: Any) -> torch.Tensor:
        """Per-token log-probs ``[B, L]``: position ``t`` scores token ``t + 1`` (0 at the
        last real position and on padding); the same on every rank."""
        was_training = self._training
        self.train(False)
        try:
            mb_list = self._micro_batches(input_)
            reports = self._run_schedule(
                mb_list.mbs,
                lambda mb, logp, entropy: (logp.sum() * 0.0, {"logp": logp.detach()}),
                forward_only=True,
            )
            logp = None
            if self._is_last_stage:
                logp = mb_list.to_padded([r["logp"] for r in reports], pad_value=0.0)
                logp = logp.to(torch.float32)
            shape = tuple(input_["attention_mask"].shape)
            logp = self._broadcast_from_last_stage(logp, shape, torch.float32)
            return mask_last_tokens(logp, input_["attention_mask"])
        finally:
            self.train(was_training)

    # --- training ---

    def train_batch(
        self, input_: dict[str, Any], loss_fn: LossFn, loss_weight_fn: WeightFn
    ) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("this engine has no optimizer (actor.optimizer is null)")
        self.train(True)
        mb_list = self._micro_batches(input_)
        weights = [float(loss_weight_fn(flat_micro_batch(mb))) for mb in mb_list.mbs]
        total = self._global_weight(weights)
        self.optimizer_zero_grad()
        if total <= 0:
            logger.warning("train_batch: no trainable tokens in the global batch; step skipped")
            return {"update_successful": 0.0, "grad_norm": 0.0, "lr": self._lr(), "loss": 0.0}
        # the schedule divides each loss by the micro-batch count, DDP averages over DP; under
        # CP the schedule multiplies each loss by c, the gather's backward sums the c ranks'
        # equal gradients, and DDP averages over the d x c ranks: c x c / c = c too many
        cp = self.parallel.cp_size
        factor = self.data_parallel_world_size * len(mb_list.mbs) / (total * cp)
        weight_of = {id(mb): w for mb, w in zip(mb_list.mbs, weights, strict=True)}

        def loss_of(mb, logp, entropy):
            loss = loss_fn(logp, entropy, flat_micro_batch(mb))
            weight = weight_of[id(mb)]
            return loss * (weight * factor), {"weighted": loss.detach() * (weight / total)}

        reports = self._run_schedule(mb_list.mbs, loss_of, forward_only=False)
        loss_sum = float(sum(float(r["weighted"]) for r in reports))
        stats = self.optimizer_step()
        return {
            **stats,
            "loss": self._reported_sum(loss_sum),
            "num_micro_batches": len(weights),
        }

    @torch.no_grad()
    def eval_batch(self, input_: dict[str, Any], loss_fn: LossFn, loss_weight_fn: WeightFn):
        was_training = self._training
        self.train(False)
        try:
            mb_list = self._micro_batches(input_)
            weights = [float(loss_weight_fn(flat_micro_batch(mb))) for mb in mb_list.mbs]
            total = max(self._global_weight(weights), 1e-12)
            weight_of = {id(mb): w for mb, w in zip(mb_list.mbs, weights, strict=True)}

            def loss_of(mb, logp, entropy):
                loss = loss_fn(logp, entropy, flat_micro_batch(mb))
                return loss.detach() * 0.0, {"weighted": loss.detach() * weight_of[id(mb)] / total}

            reports = self._run_schedule(mb_list.mbs, loss_of, forward_only=True)
            return self._reported_sum(float(sum(float(r["weighted"]) for r in reports)))
        finally:
            self.train(was_training)

    def optimizer_zero_grad(self) -> None:
        for chunk in self.model:
            if hasattr(chunk, "zero_grad_buffer"):
                chunk.zero_grad_buffer()
        if self.optimizer is not None:
            self.optimizer.zero_grad()

    def _lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"]) if self.optimizer else 0.0

    def _apply_lr(self) -> None:
        lr = self.config.optimizer.lr * lr_multiplier(
            self._lr_step, self.config.optimizer, max(1, self._total_steps)
        )
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def optimizer_step(self) -> dict[str, float]:
        if self.optimizer is None:
            raise RuntimeError("this engine has no optimizer (actor.optimizer is null)")
        found_inf = self.optimizer.prepare_grads()
        clip = self.config.optimizer.gradient_clipping
        # one norm computation: clipping returns the norm it clipped by (a non-finite
        # norm leaves nothing worth keeping: the step is skipped and the grads zeroed)
        if clip > 0:
            grad_norm = clip_grad_norm(self.optimizer, clip)
        else:
            grad_norm = float(self.optimizer.get_grad_norm())
        if found_inf or not math.isfinite(grad_norm):
            self.optimizer_zero_grad()
            logger.warning("non-finite gradient norm %s: optimizer step skipped", grad_norm)
            return {"update_successful": 0.0, "grad_norm": grad_norm, "lr": self._lr()}
        ok = self.optimizer.step_with_ready_grads()
        self.optimizer_zero_grad()
        self._optimizer_steps = getattr(self, "_optimizer_steps", 0) + 1
        return {
            "update_successful": float(bool(ok)),
            "grad_norm": grad_norm,
            "lr": self._lr(),
            "optimizer_steps": float(self._optimizer_steps),
        }

    def lr_scheduler_step(self) -> None:
        if self.optimizer is not None:
            self._lr_step += 1
            self._apply_lr()

    step_lr_scheduler = lr_scheduler_step

    # --- versions ---

    def set_version(self, version: int) -> None:
        self._version = version

    def get_version(self) -> int:
        return self._version

    # --- housekeeping ---

    def get_device_stats(self) -> dict[str, float]:
        if self.device.type != "cuda":
            return {}
        return {
            "allocated_gb": torch.cuda.memory_allocated() / 2**30,
            "max_allocated_gb": torch.cuda.max_memory_allocated() / 2**30,
        }
