"""The FSDP engine's whole tensors: HF and DCP checkpoints, and the weights it sends to
inference servers.

Parameters are FSDP2 DTensors sharded over the engine's ranks; an HF save and every weight
update need them whole, gathered one tensor at a time (a collective on every rank) under
the names of the checkpoint the model came from (Ling 3's official names). DCP checkpoints
stay sharded: each rank writes its own part of the model, optimizer, LR schedule and RNG
state.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from areal.engine.checkpoint import read_extra_state, write_extra_state
from areal.engine.train_common import to_dtype
from areal.models import checkpoint_weights, hf_state_dict, save_pretrained

__all__ = ["FSDPStateIO"]


class FSDPStateIO:
    """Mixin of :class:`~areal.engine.fsdp_engine.FSDPEngine`: its checkpoint formats'
    save and load, and its weights for inference servers."""

    # --- checkpoints ---

    def _full_state_dict(self, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """The HF-named full state dict in host memory on rank 0 (empty elsewhere);
        collective.

        One tensor at a time: gathered and cast to ``dtype`` on the device, then copied to
        the host (a tensor that two names share, as tied embeddings do, is gathered and
        copied once). Casting before the copy moves half the bytes of fp32 master weights
        across, and the host never casts.
        """
        rank0 = dist.get_rank() == 0
        state: dict[str, torch.Tensor] = {}
        copied: dict[tuple[int, int, tuple[int, ...]], torch.Tensor] = {}
        with torch.no_grad():
            for name, tensor in self.model.state_dict().items():
                local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
                key = (
                    local.untyped_storage().data_ptr(),
                    local.storage_offset(),
                    tuple(local.shape),
                )
                if key in copied:
                    if rank0:
                        state[name] = copied[key]
                    continue
                full = _gathered(tensor)
                if not rank0:
                    continue
                if dtype is not None and full.is_floating_point():
                    full = full.to(dtype)
                host = (
                    full.detach().to("cpu", copy=True)
                    if full.device.type != "cpu"
                    else full.detach().clone()
                )
                copied[key] = state[name] = host
        return state

    def _save_hf(self, path: str, tokenizer: Any = None) -> None:
        state = self._full_state_dict(to_dtype(self.config.dtype))
        if dist.get_rank() == 0:
            Path(path).mkdir(parents=True, exist_ok=True)
            save_pretrained(self.model, path, state_dict=state, source=self.config.path)
            tokenizer = tokenizer or self.tokenizer
            if tokenizer is not None:
                tokenizer.save_pretrained(path)
        dist.barrier(group=self._cpu_group)

    def _save_dcp(self, path: str, with_optim: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(
            self.module, self.optimizer if with_optim and self.optimizer else []
        )
        state: dict[str, Any] = {"model": model_state}
        if with_optim and self.optimizer is not None:
            state["optim"] = optim_state
        Path(path).mkdir(parents=True, exist_ok=True)
        dcp.save(state, checkpoint_id=path)
        write_extra_state(
            path,
            version=self._version,
            lr_scheduler=self.lr_scheduler.state_dict() if self.lr_scheduler else None,
        )
        dist.barrier(group=self._cpu_group)

    def _load_dcp(self, path: str, with_optim: bool) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        optimizer = self.optimizer if with_optim and self.optimizer else []
        model_state, optim_state = get_state_dict(self.module, optimizer)
        state: dict[str, Any] = {"model": model_state}
        if optimizer:
            state["optim"] = optim_state
        dcp.load(state, checkpoint_id=path)
        set_state_dict(
            self.module,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", {}),
        )
        extra = read_extra_state(path)
        if extra is not None:
            self._version = extra.get("version", self._version)
            if self.lr_scheduler is not None and extra.get("lr_scheduler") is not None:
                self.lr_scheduler.load_state_dict(extra["lr_scheduler"])
        dist.barrier(group=self._cpu_group)

    def _load_hf(self, path: str) -> None:
        from safetensors.torch import load_file
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        state: dict[str, torch.Tensor] = {}
        for file in sorted(Path(path).glob("*.safetensors")):
            state.update(load_file(str(file)))
        if not state:
            raise FileNotFoundError(f"no *.safetensors weights in {path}")
        state = hf_state_dict(self.model.config, state)  # a checkpoint may use other names
        set_model_state_dict(
            self.model, state, options=StateDictOptions(full_state_dict=True, strict=False)
        )

    # --- weight sync ---

    def _weights_for_inference(self) -> Iterator[tuple[str, torch.Tensor]]:
        # under the names the inference server loaded from the checkpoint (SGLang's)
        return checkpoint_weights(self.model.config, self._full_parameters())

    def _full_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named full parameters, one at a time (a collective on every rank)."""
        for name, param in self.model.named_parameters():
            yield name, _gathered(param)


def _gathered(tensor: torch.Tensor) -> torch.Tensor:
    """The whole of a (possibly distributed) tensor, a collective over its mesh.

    A DTensor on a mesh of one rank, or replicated on every rank, already holds all of it
    locally: its local tensor is returned without a redistribution, which costs ~0.25 ms
    of Python per parameter (for a ~300-tensor model, most of an in-place weight update).
    """
    if not hasattr(tensor, "full_tensor"):
        return tensor
    if tensor.device_mesh.size() == 1 or all(p.is_replicate() for p in tensor.placements):
        # the local tensor itself: to_local() is an autograd function costing as much again
        local = getattr(tensor, "_local_tensor", None)
        return (tensor.to_local() if local is None else local).detach()
    return tensor.full_tensor()
