"""Packed-sequence forward of Ling 3's KDA layers: no state crosses a sequence boundary.

Training packs several sequences into one ``[1, T]`` stream with boundaries ``cu_seqlens``
(:func:`areal.engine.attention.packed_forward_kwargs`). The MLA layers of transformers'
``bailing_hybrid`` model honour them through the attention function, but its KDA layers
(``BailingHybridDeltaAttention``) cannot be told them: both the short causal convolution and
the chunked delta rule run over the whole stream, so each sequence would start from the
previous one's convolution window and recurrent state.

:func:`enable_packed_sequences` therefore changes the class of every KDA layer of a loaded
model, in place, to a subclass whose ``forward`` handles a packed call (``cu_seq_lens_q`` in
its keyword arguments, no cache) itself and defers every other call (generation, cached
decoding, unpacked batches) to transformers' code. Parameter names, the state dict and
checkpoints are unchanged. The packed path:

* runs the projections and the forget gate over the whole stream (they are per token);
* computes the depthwise causal convolution per sequence
  (:func:`areal.engine.kda.packed_causal_conv1d`, float32: taps before a sequence's start
  read zeros, exactly what the unpacked convolution sees);
* runs the delta rule with a zero initial state per sequence through
  :func:`areal.engine.kda.kda_delta_rule`: flash-linear-attention's varlen ``chunk_kda`` on
  CUDA when installed, otherwise the port's chunked torch recurrence, the same code the
  Megatron bridge runs.

Under context parallelism the layer receives its rank's :class:`ContextShard` in the keyword
argument :data:`~areal.engine.context_parallel.CP_KWARG` and ``hidden_states`` holds only
that rank's ``T / c`` tokens; the per-token projections stay local and the convolution and
recurrence run through :func:`areal.engine.kda_context_parallel.context_parallel_kda`.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from areal.engine.context_parallel import CP_KWARG, ContextShard
from areal.engine.kda_context_parallel import context_parallel_kda, conv_delta_rule

__all__ = ["enable_packed_sequences", "packed_kda_forward"]

_KDA_CLASS_NAME = "BailingHybridDeltaAttention"


def enable_packed_sequences(model: nn.Module) -> int:
    """Give every KDA layer of ``model`` the packed-sequence forward; returns how many.

    Idempotent; call it once after loading, before wrapping the model (FSDP, compile).
    """
    count = 0
    for module in model.modules():
        cls = type(module)
        if getattr(cls, "_packed_kda", False):
            count += 1
        elif cls.__name__ == _KDA_CLASS_NAME:
            module.__class__ = _packed_class(cls)
            count += 1
    return count


@functools.cache
def _packed_class(base: type[nn.Module]) -> type[nn.Module]:
    def forward(
        self,
        hidden_states: torch.Tensor,
        cache: Any = None,
        attention_mask: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        cu_seqlens = kwargs.get("cu_seq_lens_q")
        shard = kwargs.pop(CP_KWARG, None)
        if shard is not None and cache is not None:
            raise ValueError("context parallelism has no cached KDA forward")
        if (cu_seqlens is None and shard is None) or cache is not None:
            return base.forward(
                self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs
            )
        if attention_mask is not None:
            raise ValueError("a packed KDA forward takes no attention_mask")
        return packed_kda_forward(self, hidden_states, cu_seqlens, shard=shard)

    return type(
        f"Packed{base.__name__}",
        (base,),
        {"forward": forward, "_packed_kda": True, "__module__": __name__},
    )


def packed_kda_forward(
    layer: nn.Module,
    hidden_states: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    shard: ContextShard | None = None,
) -> torch.Tensor:
    """One KDA layer over a packed stream: ``hidden_states`` ``[1, T, D]`` -> ``[1, T, D]``.

    ``layer`` is a ``BailingHybridDeltaAttention``; its parameters are used as its own
    forward uses them. With ``shard`` (context parallelism) ``hidden_states`` is this rank's
    ``[1, T / c, D]`` in local order, the segments are ``shard.cu_seqlens`` and
    ``cu_seqlens`` is ignored.
    """
    if hidden_states.shape[0] != 1:
        raise ValueError(f"a packed stream has batch size 1, got {hidden_states.shape[0]}")
    if layer.activation != "silu":
        raise ValueError(f"unsupported convolution activation {layer.activation!r}")
    x = hidden_states
    n_tokens = x.shape[1]
    head_shape = (n_tokens, -1, layer.head_dim)
    projections = (layer.q_proj, layer.k_proj, layer.v_proj)
    query, key, value = (proj(x)[0].view(head_shape) for proj in projections)
    conv_weights = layer.conv1d.weight.split(layer.qkv_dim, dim=0)  # q, k, v channels
    decay = layer.forget_gate(x)[0]
    beta = torch.sigmoid(layer.b_proj(x))[0]
    if shard is None:
        out = conv_delta_rule(
            query, key, value, conv_weights, decay, beta, cu_seqlens, conv_dtype=x.dtype
        )
    else:
        out = context_parallel_kda(
            query, key, value, conv_weights, decay, beta, shard, conv_dtype=x.dtype
        )
    gate = layer.g_proj(x).view(1, *head_shape)
    out = layer.o_norm(out.to(x.dtype).unsqueeze(0), gate).reshape(1, n_tokens, -1)
    return layer.o_proj(out)
