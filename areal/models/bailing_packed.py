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
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn

from areal.engine.kda import kda_delta_rule, packed_causal_conv1d

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
        if cu_seqlens is None or cache is not None:
            return base.forward(
                self, hidden_states, cache=cache, attention_mask=attention_mask, **kwargs
            )
        if attention_mask is not None:
            raise ValueError("a packed KDA forward takes no attention_mask")
        return packed_kda_forward(self, hidden_states, cu_seqlens)

    return type(
        f"Packed{base.__name__}",
        (base,),
        {"forward": forward, "_packed_kda": True, "__module__": __name__},
    )


def packed_kda_forward(
    layer: nn.Module, hidden_states: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """One KDA layer over a packed stream: ``hidden_states`` ``[1, T, D]`` -> ``[1, T, D]``.

    ``layer`` is a ``BailingHybridDeltaAttention``; its parameters are used as its own
    forward uses them.
    """
    if hidden_states.shape[0] != 1:
        raise ValueError(f"a packed stream has batch size 1, got {hidden_states.shape[0]}")
    x = hidden_states
    n_tokens = x.shape[1]
    head_shape = (1, n_tokens, -1, layer.head_dim)
    if layer.activation != "silu":
        raise ValueError(f"unsupported convolution activation {layer.activation!r}")
    mixed = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], dim=-1)[0]
    mixed = nn.functional.silu(packed_causal_conv1d(mixed, layer.conv1d.weight, cu_seqlens))
    query, key, value = (
        t.reshape(n_tokens, -1, layer.head_dim)
        for t in torch.split(mixed.to(x.dtype), [layer.qkv_dim] * 3, dim=-1)
    )
    decay = layer.forget_gate(x)[0]
    beta = torch.sigmoid(layer.b_proj(x))[0]
    out = kda_delta_rule(query, key, value, decay, beta, cu_seqlens).to(x.dtype)
    gate = layer.g_proj(x).view(head_shape)
    out = layer.o_norm(out.unsqueeze(0), gate).reshape(1, n_tokens, -1)
    return layer.o_proj(out)
