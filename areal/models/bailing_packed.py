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
* computes the depthwise causal convolution as ``K`` shifted products, each masked where
  the shifted token lies before its sequence's start (as if each sequence were zero-padded
  on the left, exactly what the unpacked convolution sees);
* runs the delta rule with a zero initial state per sequence: flash-linear-attention's
  ``chunk_kda`` with ``cu_seqlens`` on CUDA when installed, otherwise transformers' torch
  ``chunk_kimi_delta_attention`` on the sequences padded on the right into one batch
  (padding comes after every real token, so causality keeps it out of their outputs).
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from typing import Any

import torch
from torch import nn

__all__ = ["enable_packed_sequences", "packed_kda_forward", "segment_causal_conv1d"]

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


def _positions_in_segments(cu_seqlens: torch.Tensor, n_tokens: int) -> torch.Tensor:
    """``[T]`` index of every token inside its own sequence."""
    cu = cu_seqlens.to(torch.long)
    starts = torch.repeat_interleave(cu[:-1], cu[1:] - cu[:-1], output_size=n_tokens)
    return torch.arange(n_tokens, device=cu.device) - starts


def segment_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    activation: str | None = "silu",
) -> torch.Tensor:
    """Depthwise causal convolution of a packed stream, restarting at every sequence.

    ``x`` ``[T, C]``, ``weight`` ``[C, 1, K]`` (``nn.Conv1d`` layout, tap ``K - 1`` on the
    current token), ``cu_seqlens`` ``[n + 1]`` from 0 to ``T``. Computed in ``weight``'s
    dtype; returns ``[T, C]`` in ``x``'s dtype.
    """
    n_tokens, kernel = x.shape[0], weight.shape[-1]
    taps = weight[:, 0, :]  # [C, K]
    pos = _positions_in_segments(cu_seqlens.to(x.device), n_tokens)
    xs = x.to(weight.dtype)
    out = xs * taps[:, kernel - 1]
    for shift in range(1, kernel):
        shifted = nn.functional.pad(xs, (0, 0, shift, 0))[:n_tokens]  # shifted[t] = x[t - shift]
        inside = (pos >= shift).to(xs.dtype)[:, None]
        out = out + shifted * inside * taps[:, kernel - 1 - shift]
    if activation == "silu":
        out = nn.functional.silu(out)
    elif activation is not None:
        raise ValueError(f"unsupported convolution activation {activation!r}")
    return out.to(x.dtype)


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
    mixed = torch.cat([layer.q_proj(x), layer.k_proj(x), layer.v_proj(x)], dim=-1)[0]
    mixed = segment_causal_conv1d(mixed, layer.conv1d.weight, cu_seqlens, layer.activation)
    query, key, value = (
        t.reshape(head_shape) for t in torch.split(mixed, [layer.qkv_dim] * 3, dim=-1)
    )
    decay = layer.forget_gate(x)
    beta = torch.sigmoid(layer.b_proj(x))
    out = _delta_rule_varlen(query, key, value, decay, beta, cu_seqlens)
    gate = layer.g_proj(x).view(head_shape)
    out = layer.o_norm(out, gate).reshape(1, n_tokens, -1)
    return layer.o_proj(out)


def _fla_available() -> bool:
    return importlib.util.find_spec("fla") is not None


def _delta_rule_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    decay: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """The KDA delta rule per sequence from a zero state, on ``[1, T, H, D]`` inputs
    (``decay``: log forget gate ``[1, T, H, D]``; ``beta`` ``[1, T, H]``)."""
    if query.is_cuda and _fla_available():
        from fla.ops.kda import chunk_kda

        out, _ = chunk_kda(
            query,
            key,
            value,
            g=decay,
            beta=beta,
            cu_seqlens=cu_seqlens.to(device=query.device, dtype=torch.long),
            use_qk_l2norm_in_kernel=True,
        )
        return out
    from transformers.models.bailing_hybrid.modeling_bailing_hybrid import (
        chunk_kimi_delta_attention,
    )

    bounds = cu_seqlens.tolist()
    spans = [(s, e) for s, e in itertools.pairwise(bounds) if e > s]
    # [n, L_max, ...]: each sequence padded on the right
    batch = [
        nn.utils.rnn.pad_sequence([t[0, s:e] for s, e in spans], batch_first=True)
        for t in (query, key, value, decay, beta)
    ]
    out, _ = chunk_kimi_delta_attention(
        *batch[:3],
        g=batch[3],
        beta=batch[4],
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=True,
    )
    pieces = [out[i, : e - s] for i, (s, e) in enumerate(spans)]
    return torch.cat(pieces, dim=0).unsqueeze(0)
