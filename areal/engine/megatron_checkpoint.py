"""The Megatron engine's weights on disk and on the wire: HF export and distributed checkpoints.

* HF: mbridge gathers every tensor's TP / PP / EP shards and names it as Hugging Face does
  (a collective on every rank); rank 0 writes safetensors shards, the config, the
  generation config and the tokenizer. The same tensors feed weight sync to inference.
* Recover: Megatron's distributed checkpoint (torch DCP format) of the model chunks and,
  optionally, the optimizer, plus a small per-rank file with the weight version and the
  LR schedule position.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal.engine.checkpoint import read_extra_state, write_extra_state
from areal.engine.megatron_model import unwrap
from areal.engine.train_common import to_dtype
from areal.models import bailing

__all__ = ["HF_SHARD_BYTES", "MegatronCheckpointIO"]

HF_SHARD_BYTES = 3 * 2**30


class MegatronCheckpointIO:
    """Mixin: ``_save_hf`` / ``_load_hf`` / ``_save_dcp`` / ``_load_dcp`` (for
    :class:`~areal.engine.checkpoint.CheckpointFormats`), ``hf_state_dict`` and the
    tensors weight sync sends.

    Reads ``config``, ``model``, ``bridge``, ``optimizer``, ``tokenizer`` and ``_cpu_group``;
    keeps ``_version``, ``_lr_step`` and ``_optimizer_steps`` across a recover, and calls
    the engine's ``_apply_lr`` after one.
    """

    config: Any
    model: list[torch.nn.Module]
    bridge: Any
    optimizer: Any
    tokenizer: Any
    _cpu_group: dist.ProcessGroup | None
    _version: int
    _lr_step: int

    # --- HF export ---

    def _hf_tensors(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """Full HF-named tensors, one at a time (a collective on every rank)."""
        for name, tensor in self.bridge.export_weights(self.model):
            yield name, tensor if dtype is None else tensor.to(dtype)

    def hf_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """A copy of the whole model as an HF state dict on CPU, on every rank (collective)."""
        return {name: t.detach().to("cpu", copy=True) for name, t in self._hf_tensors(dtype)}

    def _weights_for_inference(self) -> Iterator[tuple[str, torch.Tensor]]:
        # every rank takes part in the bridge's TP/PP/EP gathers
        return self._hf_tensors(to_dtype(self.config.dtype))

    def _save_hf(self, path: str, tokenizer: Any = None) -> None:
        from safetensors.torch import save_file
        from transformers import AutoConfig

        rank0 = dist.get_rank() == 0
        out = Path(path)
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        for name, tensor in self._hf_tensors(to_dtype(self.config.dtype)):
            if not rank0:
                continue
            nbytes = tensor.numel() * tensor.element_size()
            if size and size + nbytes > HF_SHARD_BYTES:
                shards.append({})
                size = 0
            shards[-1][name] = tensor.detach().cpu().contiguous()
            size += nbytes
        if rank0:
            out.mkdir(parents=True, exist_ok=True)
            n = len(shards)
            index: dict[str, str] = {}
            for i, shard in enumerate(shards):
                file = (
                    "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
                )
                save_file(shard, str(out / file), metadata={"format": "pt"})
                index.update(dict.fromkeys(shard, file))
            if n > 1:
                (out / "model.safetensors.index.json").write_text(
                    json.dumps({"metadata": {}, "weight_map": index}, indent=2)
                )
            hf_config = AutoConfig.from_pretrained(self.config.path)
            hf_config.save_pretrained(out)
            if bailing.is_bailing_config(hf_config):  # Ling 3 keeps its official config
                bailing.write_official_config(out, source=self.config.path)
            with contextlib.suppress(Exception):
                from transformers import GenerationConfig

                GenerationConfig.from_pretrained(self.config.path).save_pretrained(out)
            tokenizer = tokenizer or self.tokenizer
            if tokenizer is not None:
                tokenizer.save_pretrained(out)
        dist.barrier(group=self._cpu_group)

    def _load_hf(self, path: str) -> None:
        self.bridge.load_weights(self.model, path)
        if self.optimizer is not None:  # main (fp32) params follow the new model params
            self.optimizer.reload_model_params()

    # --- distributed checkpoint (recover) ---

    def _sharded_state(self, with_optim: bool, is_loading: bool) -> dict[str, Any]:
        model_state: dict[str, Any] = {}
        for i, chunk in enumerate(self.model):
            key = "model" if len(self.model) == 1 else f"model{i}"
            model_state[key] = unwrap(chunk).sharded_state_dict()
        state = dict(model_state)
        if with_optim and self.optimizer is not None:
            flat = {}
            for chunk_state in model_state.values():
                flat.update(chunk_state)
            # loading initializes empty optimizer state first, where the optimizer knows how
            # (Megatron has no state initializer for SGD, whose state may stay empty)
            parts = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
            can_init = all(getattr(part, "init_state_fn", None) for part in parts)
            if is_loading and can_init:
                _init_optimizer_state(parts)
            # dp_reshardable: each rank saves and loads its own optimizer shard (recover keeps
            # the layout); megatron-core's default format needs ShardedTensor flattening,
            # which its torch_dist saver refuses ("flattened_range is not supported")
            state["optimizer"] = self.optimizer.sharded_state_dict(
                flat,
                is_loading=is_loading and can_init,
                metadata={"distrib_optim_sharding_type": "dp_reshardable"},
            )
        return state

    def _save_dcp(self, path: str, with_optim: bool) -> None:
        from megatron.core import dist_checkpointing

        Path(path).mkdir(parents=True, exist_ok=True)
        dist.barrier(group=self._cpu_group)
        dist_checkpointing.save(self._sharded_state(with_optim, is_loading=False), path)
        write_extra_state(
            path,
            version=self._version,
            lr_step=self._lr_step,
            optimizer_steps=getattr(self, "_optimizer_steps", 0),
        )
        dist.barrier(group=self._cpu_group)

    def _load_dcp(self, path: str, with_optim: bool) -> None:
        from megatron.core import dist_checkpointing

        with_optim = with_optim and self.optimizer is not None
        state = dist_checkpointing.load(self._sharded_state(with_optim, is_loading=True), path)
        # the optimizer copies loaded values into leaf parameters in place (no autograd)
        with torch.no_grad():
            for i, chunk in enumerate(self.model):
                key = "model" if len(self.model) == 1 else f"model{i}"
                unwrap(chunk).load_state_dict(state[key])
            if with_optim:
                self.optimizer.load_state_dict(state["optimizer"])
            elif self.optimizer is not None:
                self.optimizer.reload_model_params()
        extra = read_extra_state(path)
        if extra is not None:
            self._version = extra.get("version", self._version)
            self._lr_step = extra.get("lr_step", self._lr_step)
            self._optimizer_steps = extra.get("optimizer_steps", 0)
            if self.optimizer is not None:
                self._apply_lr()
        dist.barrier(group=self._cpu_group)


def _init_optimizer_state(parts: list[Any]) -> None:
    """Give a fresh optimizer the state a checkpoint is loaded into.

    Megatron's initializer creates the Adam moments but not torch's per-parameter ``step``,
    which its distributed optimizer reads (without Apex/TE) when it builds the state dict.
    """
    for part in parts:
        inner = getattr(part, "optimizer", None)
        if inner is None:
            continue
        part.init_state_fn(inner, getattr(part, "config", None))
        for group in inner.param_groups:
            for param in group["params"]:
                inner.state[param].setdefault("step", torch.zeros((), dtype=torch.float32))
