"""KDA linear attention under context parallelism: sequence sharding swapped for head sharding.

Under context parallelism (CP, :mod:`areal.engine.context_parallel`) a rank holds ``T / c``
tokens of every packed sequence, in zigzag order, with all heads. KDA's short causal
convolution and its delta-rule recurrence need each sequence whole and in order, but every
head (with its convolution channels) is independent of the others. So the per-token inputs
(q, k, v before the convolution, the log decay ``g``, ``beta``) travel by one all-to-all
from "my tokens, all heads" to "all tokens in order, ``H / c`` heads"; each rank runs the
convolution and the recurrence of its heads over the global ``cu_seqlens``, and a second
all-to-all brings the outputs back to its tokens. Both moves are differentiable, so
gradients return the same way. The recurrent state never crosses ranks, and every rank
runs the same ``T x H / c`` share of the work.

When ``c`` does not divide the heads, every rank gathers every token instead
(:func:`areal.engine.context_parallel.gather_tokens`), computes all heads over the whole
stream and keeps its own rows: ``c`` times the convolution and recurrence work and an
all-gather of ``T`` rows, but exact (the gather's backward sums each token's gradient
over the ranks that used it).

The inputs travel as float32 (the convolution computes in float32 anyway; ``g`` is float32
in the Megatron layer): twice the bytes of a bfloat16 move, in one collective. Parameter
gradients (convolution taps here, projections before) are partial per CP rank, to be summed
over the CP group like those of every other layer.

The same code serves transformers' KDA layer (:mod:`areal.models.bailing_packed`) and the
Megatron bridge's.
"""

from __future__ import annotations

import torch
from torch.nn import functional

from areal.engine.context_parallel import (
    ContextShard,
    gather_tokens,
    heads_to_tokens,
    tokens_to_heads,
)
from areal.engine.kda import kda_delta_rule, packed_causal_conv1d

__all__ = ["context_parallel_kda", "conv_delta_rule"]

ConvWeights = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _head_major_kernel(weights: ConvWeights, heads: int) -> torch.Tensor:
    """q, k, v kernels ``[H * D, 1, K]`` each -> ``[H * (Dq + Dk + Dv), 1, K]``, channels in
    the order of ``cat([q, k, v], -1)`` of ``[T, H, D]`` tensors, flattened."""
    taps = weights[0].shape[-1]
    per_head = [w.reshape(heads, -1, taps) for w in weights]
    return torch.cat(per_head, dim=1).reshape(-1, 1, taps)


def conv_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    conv_weights: ConvWeights,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    conv_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """KDA's token mixing over a packed stream: short causal convolution, SiLU, delta rule.

    ``q``, ``k`` ``[T, H, Dk]``, ``v`` ``[T, H, Dv]``: the projections before the
    convolution; ``conv_weights``: the depthwise kernels of q, k and v, ``[H * D, 1, K]``
    each, head-major (``Conv1d(groups=C)`` weights); ``g`` ``[T, H, Dk]`` the log decay;
    ``beta`` ``[T, H]``; ``cu_seqlens`` ``[n + 1]``. Convolution and state restart at every
    segment. ``conv_dtype``: the dtype the convolved q, k, v are cast to before the
    recurrence (the model's, as transformers' layer does; float32 if None). Returns
    ``[T, H, Dv]`` (see :func:`areal.engine.kda.kda_delta_rule` for its dtype).
    """
    n_tokens, heads = q.shape[:2]
    widths = [q.shape[-1], k.shape[-1], v.shape[-1]]
    x = torch.cat([q.float(), k.float(), v.float()], dim=-1).reshape(n_tokens, -1)
    kernel = _head_major_kernel(conv_weights, heads)
    mixed = functional.silu(packed_causal_conv1d(x, kernel, cu_seqlens))
    if conv_dtype is not None:
        mixed = mixed.to(conv_dtype)
    q, k, v = mixed.reshape(n_tokens, heads, -1).split(widths, dim=-1)
    return kda_delta_rule(q, k, v, g, beta, cu_seqlens)


def context_parallel_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    conv_weights: ConvWeights,
    g: torch.Tensor,
    beta: torch.Tensor,
    shard: ContextShard,
    *,
    conv_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`conv_delta_rule` of this rank's tokens under context parallelism.

    Inputs as :func:`conv_delta_rule`'s, but ``T / c`` rows: this rank's tokens in local
    (zigzag) order, all ``H`` heads; ``conv_weights`` are the kernels of all ``H`` heads.
    The segments are ``shard.cu_seqlens`` (the padded global stream). Returns
    ``[T / c, H, Dv]`` in local order. With ``c`` dividing ``H`` each rank runs ``H / c``
    heads over the whole stream (two all-to-alls); otherwise all heads (an all-gather).
    """
    heads, dk, dv = q.shape[1], k.shape[-1], v.shape[-1]
    # one collective moves every per-token input: [T / c, H, Dq + Dk + Dv + Dk + 1]
    inputs = torch.cat([q.float(), k.float(), v.float(), g.float(), beta.float()[..., None]], -1)
    split = [q.shape[-1], dk, dv, dk, 1]

    def mix(rows: torch.Tensor, weights: ConvWeights) -> torch.Tensor:
        q_, k_, v_, g_, beta_ = rows.split(split, dim=-1)
        return conv_delta_rule(
            q_, k_, v_, weights, g_, beta_[..., 0], shard.cu_seqlens, conv_dtype=conv_dtype
        )

    if heads % shard.size == 0:
        mine = heads // shard.size
        first = shard.rank * mine
        weights = tuple(
            w.reshape(heads, -1, w.shape[-1])[first : first + mine].reshape(-1, 1, w.shape[-1])
            for w in conv_weights
        )
        out = mix(tokens_to_heads(inputs, shard), weights)  # [T, H / c, Dv]
        return heads_to_tokens(out, shard)
    out = mix(gather_tokens(inputs, shard), conv_weights)  # [T, H, Dv]
    return shard.shard(out)
