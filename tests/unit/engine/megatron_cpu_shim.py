"""Run megatron-core and mbridge on CPU, for tests only.

Both libraries assume CUDA in a few places (workspace buffers, the model-parallel RNG
tracker, ``.cuda()`` after building a model). :func:`apply` replaces exactly those spots,
as listed in the environment notes, and :func:`restore` undoes it. What the engine needs
on a GPU machine without Transformer Engine (local layer spec, name mappings,
``rope_theta``, the packed rotary embedding, ...) is patched in
:mod:`areal.engine.megatron_compat`, never here.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["apply", "cpu_megatron", "megatron_available", "restore"]

_SAVED: list[tuple[Any, str, Any]] = []


def megatron_available() -> tuple[bool, str]:
    """Whether megatron-core and mbridge import here, and why not."""
    try:
        import mbridge  # noqa: F401
        import megatron.core  # noqa: F401
    except Exception as e:  # ImportError, or a broken install
        return False, f"megatron-core / mbridge not importable: {e}"
    return True, ""


class _TorchOnCPU:
    """``torch`` with ``device='cuda'`` factory arguments sent to the CPU."""

    _FACTORIES = ("tensor", "zeros", "ones", "empty", "full")

    def __getattr__(self, name: str) -> Any:
        value = getattr(torch, name)
        if name not in self._FACTORIES:
            return value

        def on_cpu(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("device") in ("cuda", "cpu") or isinstance(kwargs.get("device"), int):
                kwargs["device"] = "cpu"
            return value(*args, **kwargs)

        return on_cpu


class _HostStream:
    """Stands in for the side CUDA stream of Megatron's all-to-all MoE token dispatcher.

    It is also what ``torch.cuda.current_stream()`` returns under the shim, so the
    dispatcher sees itself on its own stream and skips ``record_stream`` calls.
    """

    def wait_stream(self, other: Any) -> None:
        del other

    def record_event(self) -> Any:
        return self

    def synchronize(self) -> None:
        pass


_HOST_STREAM = _HostStream()


def _clip_grads_on_cpu(
    parameters: Any, max_norm: float, total_norm: float, use_decoupled_grad: bool = False
) -> None:
    """Megatron's clip by total norm: scale every gradient by ``max_norm / total_norm``."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    attr = "decoupled_grad" if use_decoupled_grad else "grad"
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for param in parameters:
            grad = getattr(param, attr, None)
            if grad is not None:
                grad.detach().mul_(coeff)


def _splits_on_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """Megatron's ``maybe_move_tensor_to_cpu`` for host tensors: numpy when asked."""
    del record_stream
    if torch.is_tensor(tensor):
        tensor = tensor.cpu()
        return tensor.numpy() if as_numpy else tensor
    return tensor


def _patch(owner: Any, name: str, value: Any) -> None:
    _SAVED.append((owner, name, getattr(owner, name)))
    setattr(owner, name, value)


def apply() -> None:
    """Install the CPU replacements (idempotent)."""
    if _SAVED:
        return
    from megatron.core import utils as mcore_utils
    from megatron.core.tensor_parallel import random as mcore_random

    def get_tensor(self, tensor_shape, dtype, name, mem_alloc_context=None):
        numel = 1
        for dim in tensor_shape:
            numel *= dim
        buf = self.buffer.get((name, dtype))
        if buf is None or buf.numel() < numel:
            buf = self.buffer[(name, dtype)] = torch.empty(numel, dtype=dtype)
        return buf[:numel].view(*tensor_shape)

    _patch(mcore_utils.GlobalMemoryBuffer, "get_tensor", get_tensor)
    _patch(
        mcore_random.CudaRNGStatesTracker,
        "fork",
        lambda self, name=None: contextlib.nullcontext(),
    )
    _patch(torch.nn.Module, "cuda", lambda self, device=None: self)
    _patch(torch.cuda, "current_device", lambda: "cpu")
    _patch(torch.cuda, "synchronize", lambda device=None: None)  # checkpoint writes
    # the optimizer, gradient clipping and the schedules create small bookkeeping tensors on 'cuda'
    from megatron.core.optimizer import clip_grads
    from megatron.core.optimizer import optimizer as mcore_optimizer
    from megatron.core.pipeline_parallel import schedules

    for module in (clip_grads, mcore_optimizer, schedules, mcore_utils):
        _patch(module, "torch", _TorchOnCPU())
    # activation recompute saves and restores the CUDA RNG state around each layer
    _patch(mcore_random, "_get_cuda_rng_state", lambda *args, **kwargs: None)
    _patch(mcore_random, "_set_cuda_rng_state", lambda *args, **kwargs: None)
    # clipping asserts CUDA gradients and scales them with a fused CUDA kernel
    _patch(mcore_optimizer, "clip_grad_by_total_norm_fp32", _clip_grads_on_cpu)
    # MoE: the all-to-all token dispatcher (the one that takes packed, variable-length
    # micro-batches) copies routing counts to the host on a side CUDA stream
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    _patch(MoEAlltoAllTokenDispatcher, "cuda_dtoh_stream", _HOST_STREAM)
    # ... and hands the split sizes to all_to_all as numpy arrays, converting only CUDA
    # tensors: with expert parallelism on CPU they must be converted as well
    from megatron.core.transformer.moe import token_dispatcher

    _patch(token_dispatcher, "maybe_move_tensor_to_cpu", _splits_on_host)
    _patch(torch.cuda, "current_stream", lambda device=None: _HOST_STREAM)
    _patch(torch.cuda, "stream", lambda stream=None: contextlib.nullcontext())


def restore() -> None:
    while _SAVED:
        owner, name, value = _SAVED.pop()
        setattr(owner, name, value)


@contextlib.contextmanager
def cpu_megatron() -> Iterator[None]:
    apply()
    try:
        yield
    finally:
        restore()
