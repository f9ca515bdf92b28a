"""Causal attention over packed token streams, registered as a transformers attention backend.

Training packs several sequences into one ``[1, T]`` stream whose boundaries are given by
``cu_seqlens`` (int32, ``[n + 1]``); attention must never cross a boundary. Passing the
kwargs from :func:`packed_forward_kwargs` to ``model(...)`` is enough: HF decoder models
(Qwen2, Qwen3, Llama) forward unknown keyword arguments unchanged from the top-level
``forward`` through every decoder layer to the attention function, under the names that
transformers uses for flash-attention varlen calls (``cu_seq_lens_q``, ``cu_seq_lens_k``,
``max_length_q``, ``max_length_k``).

Two backends compute the same thing:

* ``varlen``: ``torch.nn.attention.varlen.varlen_attn`` (a flash kernel, CUDA, bf16/fp16),
  one launch for the whole stream;
* ``sdpa``: an exact loop of ``scaled_dot_product_attention(is_causal=True)`` over the
  segments, used on CPU, in fp32, or where the varlen kernel is missing.

Neither builds a ``[T, T]`` mask: the mask function registered alongside returns at most the
2-D padding mask, which only matters for unpacked (generation, eval) calls.

Under context parallelism each rank holds a share of the stream
(:mod:`areal.engine.context_parallel`); the shard travels in the kwargs too (``CP_KWARG``)
and attention then runs over keys and values gathered from the whole context-parallel group.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch.nn.functional import scaled_dot_product_attention

from areal.engine.context_parallel import CP_KWARG, ContextShard, context_parallel_attention

__all__ = [
    "VARLEN_ATTENTION",
    "AttentionBackend",
    "packed_causal_attention",
    "packed_forward_kwargs",
    "prefix_causal_attention",
    "register_varlen_attention",
    "varlen_attention_forward",
    "varlen_kernel_available",
]

VARLEN_ATTENTION = "areal_varlen"

AttentionBackend = Literal["auto", "varlen", "sdpa"]

_VARLEN_DTYPES = (torch.bfloat16, torch.float16)


def _load_varlen_kernel() -> tuple[Callable[..., torch.Tensor] | None, frozenset[str]]:
    """The varlen kernel and the names of its parameters (they changed across torch releases)."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, frozenset()
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


_VARLEN_ATTN, _VARLEN_PARAMS = _load_varlen_kernel()


def varlen_kernel_available() -> bool:
    """Whether this torch build ships ``varlen_attn`` and a CUDA device is present."""
    return _VARLEN_ATTN is not None and torch.cuda.is_available()


def packed_forward_kwargs(
    cu_seqlens: torch.Tensor, max_seqlen: int, shard: ContextShard | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``model(input_ids, position_ids=..., **kwargs)`` on a packed stream.

    ``cu_seqlens``: ``[n + 1]`` cumulative segment lengths, ``cu_seqlens[-1] == T``; padding
    at the end of the stream is a segment of its own. ``max_seqlen``: longest segment.
    Includes ``use_cache=False``. Pass no ``attention_mask`` alongside.

    ``shard``: this rank's share under context parallelism, passed on under ``CP_KWARG``;
    ``input_ids`` are then the share's tokens, ``cu_seqlens``/``max_seqlen`` its local chunks
    (``shard.local_cu_seqlens``), so a layer that reads them never crosses a sequence.
    """
    cu = cu_seqlens.to(torch.int32)
    max_len = int(max_seqlen)
    extra = {} if shard is None else {CP_KWARG: shard}
    return {
        **extra,
        # A packed stream is never decoded from; a KV cache would only hold memory.
        "use_cache": False,
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max_len,
        "max_length_k": max_len,
    }


# --- packed attention ([T, H, D] layout) ---


def _segment_bounds(cu_seqlens: torch.Tensor, n_tokens: int) -> list[tuple[int, int]]:
    bounds = cu_seqlens.tolist()
    if bounds[0] != 0 or bounds[-1] != n_tokens:
        raise ValueError(f"cu_seqlens must run from 0 to {n_tokens}, got {bounds[0]}..{bounds[-1]}")
    return [(s, e) for s, e in itertools.pairwise(bounds) if e > s]


def _packed_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None,
) -> torch.Tensor:
    # [1, H, T, D] so each segment is a 4-D view, which SDPA's fused kernels require.
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (query, key, value))
    gqa = q.shape[1] != k.shape[1]
    outs = [
        scaled_dot_product_attention(
            q[:, :, s:e], k[:, :, s:e], v[:, :, s:e], is_causal=True, scale=scale, enable_gqa=gqa
        )
        for s, e in _segment_bounds(cu_seqlens, query.shape[0])
    ]
    if not outs:
        return query.new_empty(*query.shape[:2], value.shape[-1])
    return torch.cat(outs, dim=2)[0].transpose(0, 1)


def _causal_kwargs() -> dict[str, Any]:
    """How this torch release's varlen kernel is asked for a causal mask."""
    if "is_causal" in _VARLEN_PARAMS:
        return {"is_causal": True}
    # Releases without ``is_causal`` test ``window_size == (-1, 0)``: it must be a tuple.
    return {"window_size": (-1, 0)}


@functools.cache
def _varlen_reads_grouped_kv(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the varlen kernel takes fewer key/value heads than query heads as GQA.

    Flash kernels do, but some torch releases neither document it nor take ``enable_gqa``;
    one tiny call, compared against repeated key/value heads, settles it per device. Without
    it every key/value head is copied ``Hq / Hkv`` times per layer, forward and backward.
    """
    # Its own autograd context: the first caller may be inside no_grad or inference_mode, or
    # inside an activation-checkpointed layer, whose saved-tensor hooks must not see the
    # probe's tensors (the recomputation, which finds the answer cached, saves none of them,
    # and checkpointing then fails on the count: "A different number of tensors was saved").
    with (
        torch.inference_mode(False),
        torch.enable_grad(),
        torch.autograd.graph.saved_tensors_hooks(_keep, _keep),
    ):
        return _probe_grouped_kv(device, dtype)


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _probe_grouped_kv(device: torch.device, dtype: torch.dtype) -> bool:
    g = torch.Generator(device=device).manual_seed(0)
    q = torch.randn(12, 4, 64, device=device, dtype=dtype, generator=g)
    k, v = (torch.randn(12, 2, 64, device=device, dtype=dtype, generator=g) for _ in range(2))
    upstream = torch.randn(12, 4, 64, device=device, dtype=dtype, generator=g)
    cu = torch.tensor([0, 5, 12], device=device, dtype=torch.int32)
    kwargs = _causal_kwargs()

    def run(repeat: int) -> list[torch.Tensor]:
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        qq, kk, vv = leaves
        kk, vv = (x.repeat_interleave(repeat, 1) for x in (kk, vv))
        out = _call_varlen(qq, kk, vv, (cu, 7), (cu, 7), kwargs)
        grads = torch.autograd.grad((out * upstream).sum(), leaves)
        return [out, *grads]

    try:
        grouped, repeated = run(1), run(2)
    except (RuntimeError, ValueError, TypeError):
        return False
    return all(
        a.shape == b.shape and torch.allclose(a, b, atol=1e-2, rtol=1e-2)
        for a, b in zip(grouped, repeated, strict=True)
    )


def _packed_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    scale: float | None,
    keys: tuple[torch.Tensor, int] | None = None,
) -> torch.Tensor:
    """``keys``: the key segments' bounds and longest length where they differ from the
    query segments (each query segment then sits at the end of its key segment)."""
    assert _VARLEN_ATTN is not None
    kwargs = _causal_kwargs()
    if "scale" in _VARLEN_PARAMS:
        kwargs["scale"] = scale
    elif scale is not None and scale != query.shape[-1] ** -0.5:
        query = query * (scale * query.shape[-1] ** 0.5)
    n_rep = query.shape[1] // key.shape[1]
    if n_rep > 1:
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        elif not _varlen_reads_grouped_kv(query.device, query.dtype):
            key = key.repeat_interleave(n_rep, dim=1)
            value = value.repeat_interleave(n_rep, dim=1)
    value_dim = value.shape[-1]
    if value_dim < query.shape[-1]:
        # MLA's values are narrower than its queries and keys; flash kernels take one head
        # size, and zero value columns only add zero output columns, cut off below.
        value = torch.nn.functional.pad(value, (0, query.shape[-1] - value_dim))
    cu_k, max_k = keys if keys is not None else (cu_seqlens, max_seqlen)
    out = _call_varlen(query, key, value, (cu_seqlens, max_seqlen), (cu_k, max_k), kwargs)
    return out[..., :value_dim]


def _call_varlen(query, key, value, queries, keys, kwargs) -> torch.Tensor:
    (cu_q, max_q), (cu_k, max_k) = queries, keys
    return _VARLEN_ATTN(
        query.contiguous(),
        key.contiguous(),
        value.contiguous(),
        cu_q.to(device=query.device, dtype=torch.int32),
        cu_k.to(device=query.device, dtype=torch.int32),
        max_q,
        max_k,
        **kwargs,
    )


def _pick_backend(query: torch.Tensor, key: torch.Tensor, backend: AttentionBackend) -> str:
    """``varlen`` or ``sdpa`` for these inputs; checks the head counts and the kernel."""
    if query.shape[1] % key.shape[1]:
        raise ValueError(f"query heads {query.shape[1]} not a multiple of kv heads {key.shape[1]}")
    if backend == "auto":
        use_varlen = _VARLEN_ATTN is not None and query.is_cuda and query.dtype in _VARLEN_DTYPES
        return "varlen" if use_varlen else "sdpa"
    if backend == "varlen" and _VARLEN_ATTN is None:
        raise RuntimeError("torch.nn.attention.varlen.varlen_attn is not available")
    return backend


@torch.compiler.disable
def packed_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    max_seqlen: int,
    *,
    scale: float | None = None,
    backend: AttentionBackend = "auto",
) -> torch.Tensor:
    """Causal attention within each segment of a packed stream.

    ``query``/``key`` ``[T, Hq or Hkv, D]``, ``value`` ``[T, Hkv, Dv]`` with ``Hq % Hkv == 0``
    (GQA: query head ``h`` reads key/value head ``h // (Hq // Hkv)``) and ``Dv <= D`` (MLA
    has ``Dv < D``); ``cu_seqlens`` ``[n + 1]`` from 0 to T (checked by the SDPA loop only:
    the kernel path avoids a host sync). Returns ``[T, Hq, Dv]``. ``backend="auto"`` takes
    the varlen kernel for CUDA bf16/fp16 inputs when it exists and the exact SDPA loop
    otherwise. Never traced by ``torch.compile`` (compiled decoder layers call it as an
    opaque function).
    """
    if _pick_backend(query, key, backend) == "varlen":
        return _packed_varlen(query, key, value, cu_seqlens, int(max_seqlen), scale)
    return _packed_sdpa(query, key, value, cu_seqlens, scale)


class _PrefixSpanAttention(torch.autograd.Function):
    """One query chunk over the keys it ends, keeping only the inputs, the output and the
    row log-sum-exp for backward (the score matrix is recomputed there, as flash kernels
    do), so a share's saved activations do not grow with its chunks' key prefixes."""

    @staticmethod
    def _scores(q, k, scale):  # [n, Hq, D] x [m, Hq, D] -> [Hq, n, m], causal to the end
        n, m = q.shape[0], k.shape[0]
        scores = torch.einsum("nhd,mhd->hnm", q, k) * scale
        allowed = torch.ones(n, m, dtype=torch.bool, device=q.device).tril(m - n)
        return scores.masked_fill(~allowed, float("-inf"))

    @staticmethod
    def forward(ctx, q, k, v, scale):
        rep = q.shape[1] // k.shape[1]
        kf, vf = (x.repeat_interleave(rep, dim=1) for x in (k, v))
        scores = _PrefixSpanAttention._scores(q, kf, scale)
        lse = torch.logsumexp(scores, dim=-1)
        out = torch.einsum("hnm,mhd->nhd", torch.exp(scores - lse[..., None]), vf)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad):
        q, k, v, out, lse = ctx.saved_tensors
        rep = q.shape[1] // k.shape[1]
        kf, vf = (x.repeat_interleave(rep, dim=1) for x in (k, v))
        probs = torch.exp(_PrefixSpanAttention._scores(q, kf, ctx.scale) - lse[..., None])
        grad_v = torch.einsum("hnm,nhd->mhd", probs, grad)
        grad_p = torch.einsum("nhd,mhd->hnm", grad, vf)
        delta = (grad * out).sum(-1).transpose(0, 1)  # [Hq, n]
        grad_s = probs * (grad_p - delta[..., None]) * ctx.scale
        grad_q = torch.einsum("hnm,mhd->nhd", grad_s, kf)
        grad_k = torch.einsum("hnm,nhd->mhd", grad_s, q)
        m, heads = k.shape[0], k.shape[1]
        grad_k = grad_k.reshape(m, heads, rep, -1).sum(2)
        grad_v = grad_v.reshape(m, heads, rep, -1).sum(2)
        return grad_q, grad_k, grad_v, None


@torch.compiler.disable
def prefix_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    spans: list[tuple[int, int, int, int]],
    max_key_len: int,
    *,
    scale: float | None = None,
    backend: AttentionBackend = "auto",
) -> torch.Tensor:
    """Query chunks, each attending causally to a range of keys that it ends.

    ``spans``: per chunk ``(q_start, q_end, k_start, k_end)``; the chunks tile ``query``
    ``[Tq, Hq, D]`` in order, and chunk query ``i`` sits at key position
    ``k_end - (q_end - q_start) + i``: it sees keys ``k_start`` through that position of
    ``key`` ``[Tk, Hkv, D]`` / ``value`` ``[Tk, Hkv, Dv]``. Key ranges may overlap (context
    parallelism: a sequence's two chunks on one rank read the same prefix). Returns
    ``[Tq, Hq, Dv]``. ``varlen``: the flash kernel (CUDA bf16/fp16); otherwise an exact torch
    path that recomputes each chunk's scores in backward instead of keeping them.
    """
    if _pick_backend(query, key, backend) == "varlen":
        index = torch.cat([torch.arange(ks, ke) for _, _, ks, ke in spans]).to(key.device)
        q_lens = [qe - qs for qs, qe, _, _ in spans]
        k_lens = [ke - ks for _, _, ks, ke in spans]
        cu_q = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
        cu_k = torch.tensor([0, *itertools.accumulate(k_lens)], dtype=torch.int32)
        return _packed_varlen(
            query,
            key.index_select(0, index),
            value.index_select(0, index),
            cu_q,
            max(q_lens, default=0),
            scale,
            keys=(cu_k, int(max_key_len)),
        )
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    outs = [
        _PrefixSpanAttention.apply(query[qs:qe], key[ks:ke], value[ks:ke], scale)
        for qs, qe, ks, ke in spans
    ]
    if not outs:
        return query.new_empty(*query.shape[:2], value.shape[-1])
    return torch.cat(outs, dim=0)


# --- unpacked attention ([B, H, S, D] layout, optional 2-D padding mask) ---


def _batched_causal_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    padding_mask: torch.Tensor | None,
    scale: float | None,
    dropout: float,
) -> torch.Tensor:
    q_len, kv_len = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if padding_mask is not None and padding_mask.dim() == 4:
        # A caller-built 4-D mask (boolean or additive) already encodes everything.
        return scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=padding_mask,
            dropout_p=dropout,
            scale=scale,
            enable_gqa=gqa,
        )
    if padding_mask is None and q_len == kv_len:
        return scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, is_causal=True, scale=scale, enable_gqa=gqa
        )
    # With a cache the queries are the last q_len positions (bottom-right causal alignment),
    # which SDPA's ``is_causal`` does not express, so the [B, 1, q, kv] mask is built here.
    q_pos = torch.arange(kv_len - q_len, kv_len, device=query.device)
    k_pos = torch.arange(kv_len, device=query.device)
    allowed = (k_pos[None, :] <= q_pos[:, None])[None, None]
    if padding_mask is not None:
        keep = padding_mask[:, -kv_len:].to(device=query.device, dtype=torch.bool)
        allowed = allowed & keep[:, None, None, :]
        # A padding query would see no key at all and SDPA would return NaN; let it see itself.
        allowed = allowed | (k_pos[None, :] == q_pos[:, None])[None, None]
    return scaled_dot_product_attention(
        query, key, value, attn_mask=allowed, dropout_p=dropout, scale=scale, enable_gqa=gqa
    )


def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    max_length_q: int | None = None,
    max_length_k: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The function transformers calls per attention layer under ``VARLEN_ATTENTION``.

    ``query`` ``[B, Hq, S, D]``, ``key``/``value`` ``[B, Hkv, S_kv, D]``; returns
    ``([B, S, Hq, D], None)``. With packing kwargs (``B == 1``, no mask, no cache) attention
    stays inside each segment; without them it is ordinary causal attention honouring the
    2-D padding mask, so generation and evaluation work on the same model. With a
    :class:`ContextShard` under ``CP_KWARG`` the inputs are this rank's share of the stream
    (``S = T / c``) and attention reads the keys and values of the whole group.
    """
    shard = kwargs.get(CP_KWARG)
    del module, kwargs
    if sliding_window is not None:
        raise NotImplementedError(f"{VARLEN_ATTENTION} does not support sliding-window layers")
    if softcap is not None:
        raise NotImplementedError(f"{VARLEN_ATTENTION} does not support logit soft-capping")
    if cu_seq_lens_q is None and shard is None:
        out = _batched_causal_attention(query, key, value, attention_mask, scaling, dropout)
        return out.transpose(1, 2).contiguous(), None

    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch size 1, got {query.shape[0]}")
    if attention_mask is not None:
        raise ValueError("packed attention takes no attention_mask: padding is its own segment")
    if query.shape[2] != key.shape[2]:
        raise ValueError("packed attention does not run with a KV cache")
    if dropout:
        raise NotImplementedError("packed attention does not implement attention dropout")
    if shard is not None:
        out = context_parallel_attention(
            query[0].transpose(0, 1),
            key[0].transpose(0, 1),
            value[0].transpose(0, 1),
            shard,
            scale=scaling,
        )
        return out.unsqueeze(0), None
    same_k = cu_seq_lens_k is None or cu_seq_lens_k is cu_seq_lens_q
    if not same_k and not torch.equal(cu_seq_lens_k, cu_seq_lens_q):
        raise ValueError("packed attention needs identical query and key segments")
    max_len = max_length_q if max_length_q is not None else max_length_k
    if max_len is None:
        max_len = int((cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]).max())
    out = packed_causal_attention(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cu_seq_lens_q,
        int(max_len),
        scale=scaling,
    )
    return out.unsqueeze(0), None


def _padding_mask_only(
    *, kv_length: int, attention_mask: torch.Tensor | None = None, **kwargs: Any
) -> torch.Tensor | None:
    """Mask function for ``VARLEN_ATTENTION``: the 2-D padding mask, or None when nothing pads.

    Causality and segment boundaries are the attention function's job, so no 4-D mask is made.
    """
    del kwargs
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[-1] == kv_length and bool(attention_mask.all()):
        return None
    return attention_mask


def register_varlen_attention() -> str:
    """Register the attention and mask functions with transformers; returns ``VARLEN_ATTENTION``.

    Safe to call repeatedly. Use the result as ``attn_implementation`` when loading a model.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(VARLEN_ATTENTION, varlen_attention_forward)
    try:
        from transformers import AttentionMaskInterface
    except ImportError:
        # Without a mask registry, mask creation passes the 2-D mask through for unknown
        # implementations, which is what the attention function expects anyway.
        return VARLEN_ATTENTION
    AttentionMaskInterface.register(VARLEN_ATTENTION, _padding_mask_only)
    return VARLEN_ATTENTION
