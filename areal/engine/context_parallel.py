"""Context parallelism over packed token streams: who holds which tokens, and moving them.

A context-parallel (CP) group of ``c`` ranks trains the same packed micro-batch, each rank
holding a share of every sequence. Causal attention costs more for late tokens than for
early ones, so the share is load-balanced: every sequence is padded (at its end) to a
multiple of ``2c`` tokens and cut into ``2c`` equal chunks, and rank ``r`` holds chunks
``r`` and ``2c - 1 - r`` (the zigzag layout Megatron's context parallelism also uses). A
rank's local stream is, sequence after sequence, its early chunk then its late chunk, so
every rank holds exactly ``T / c`` tokens.

:class:`ContextShard` describes one rank's share of one packed micro-batch; it travels to
the attention functions and KDA layers in the model's forward keyword arguments
(:data:`CP_KWARG`). The token movers are differentiable:

* :func:`gather_tokens`: every rank's share, back in global order (all-gather forward,
  reduce-scatter of the gradient backward); softmax attention gathers keys and values;
* :func:`tokens_to_heads` / :func:`heads_to_tokens`: all-to-all between "my tokens, all
  heads" and "all tokens, my heads"; a recurrence (KDA) runs over whole sequences for a
  share of its heads.

Padding tokens sit after every real token of their sequence, so causality keeps them out of
real tokens' outputs; the engines mask them out of losses.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = [
    "CP_KWARG",
    "ContextShard",
    "context_parallel_attention",
    "gather_tokens",
    "heads_to_tokens",
    "padded_length",
    "plan_shard",
    "tokens_to_heads",
]

# the forward keyword argument under which a model's layers receive the ContextShard
CP_KWARG = "areal_context_shard"


def padded_length(length: int, size: int) -> int:
    """``length`` rounded up to a multiple of ``2 * size`` (a sequence's length under CP)."""
    step = 2 * size
    return -(-length // step) * step


@dataclass(frozen=True, eq=False)
class ContextShard:
    """One rank's share of a packed stream under context parallelism of ``size`` ranks.

    ``cu_seqlens`` ``[n + 1]``: the global stream's (padded) sequence bounds; every sequence
    length is a multiple of ``2 * size``. ``local_index`` ``[T / size]``: the global index of
    each local token, in local order. ``positions`` ``[T / size]``: each local token's
    position inside its sequence (for rotary embeddings). ``local_cu_seqlens`` ``[2n + 1]``:
    the local stream's chunks (early, late per sequence). ``rank_order`` ``[T]``: the global
    index of each row of the rank-major concatenation of all ranks' local streams.
    """

    size: int
    rank: int
    group: dist.ProcessGroup | None
    cu_seqlens: torch.Tensor
    max_seqlen: int
    local_index: torch.Tensor
    positions: torch.Tensor
    local_cu_seqlens: torch.Tensor
    rank_order: torch.Tensor
    to_global: torch.Tensor  # inverse permutation of rank_order

    @property
    def n_tokens(self) -> int:
        return int(self.cu_seqlens[-1])

    @property
    def n_local(self) -> int:
        return self.n_tokens // self.size

    def shard(self, x: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """This rank's tokens of a global ``x`` (``T`` along ``dim``), in local order."""
        return x.index_select(dim, self.local_index.to(x.device))

    def unshard(self, gathered: torch.Tensor, dim: int = 0) -> torch.Tensor:
        """A rank-major concatenation of every rank's local tokens, in global order."""
        return gathered.index_select(dim, self.to_global.to(gathered.device))


def _local_index(bounds: list[int], size: int, rank: int) -> list[torch.Tensor]:
    pieces = []
    for start, end in itertools.pairwise(bounds):
        chunk = (end - start) // (2 * size)
        for c in (rank, 2 * size - 1 - rank):
            pieces.append(torch.arange(start + c * chunk, start + (c + 1) * chunk))
    return pieces


def plan_shard(
    cu_seqlens: torch.Tensor,
    size: int,
    rank: int,
    group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
) -> ContextShard:
    """The share of rank ``rank`` of ``size``; ``cu_seqlens``: the padded global stream's
    bounds (each sequence a multiple of ``2 * size`` long, see :func:`padded_length`)."""
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"context-parallel rank {rank} of {size}")
    bounds = [int(b) for b in cu_seqlens.tolist()]
    lengths = [e - s for s, e in itertools.pairwise(bounds)]
    uneven = [n for n in lengths if n % (2 * size)]
    if bounds[0] != 0 or uneven:
        raise ValueError(
            f"context parallelism over {size} ranks needs every sequence padded to a multiple "
            f"of {2 * size} tokens; got lengths {uneven[:4]}"
        )
    device = torch.device(device) if device is not None else cu_seqlens.device
    per_rank = [torch.cat(_local_index(bounds, size, r) or [torch.zeros(0, dtype=torch.long)])
                for r in range(size)]  # fmt: skip
    local = per_rank[rank]
    starts = torch.tensor(bounds[:-1], dtype=torch.long)
    sequence = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    local_positions = local - starts[sequence[local]] if len(local) else local
    chunk_lens = [n // (2 * size) for n in lengths for _ in range(2)]
    local_cu = torch.tensor([0, *itertools.accumulate(chunk_lens)], dtype=torch.int32)
    rank_order = torch.cat(per_rank)
    return ContextShard(
        size=size,
        rank=rank,
        group=group,
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32, device=device),
        max_seqlen=max(lengths, default=0),
        local_index=local.to(device),
        positions=local_positions.to(device),
        local_cu_seqlens=local_cu.to(device),
        rank_order=rank_order.to(device),
        to_global=torch.argsort(rank_order).to(device),
    )


# --- differentiable token movers ---

# torch 2.13 renamed reduce_scatter_tensor (deprecated there); the GPU image's 2.11 has only it
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def _all_gather(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """Rank-major concatenation of every rank's ``x`` along dim 0."""
    out = x.new_empty((shard.size * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=shard.group)
    return out


def _reduce_scatter(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """Sum over ranks of a rank-major ``x``; this rank's block."""
    out = x.new_empty((x.shape[0] // shard.size, *x.shape[1:]))
    _REDUCE_SCATTER(out, x.contiguous(), group=shard.group)
    return out


class _GatherTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
        ctx.shard = shard
        return shard.unshard(_all_gather(x, shard))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shard = ctx.shard
        rank_major = grad.index_select(0, shard.rank_order.to(grad.device))
        return _reduce_scatter(rank_major, shard), None


def gather_tokens(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """``x`` ``[T / c, ...]`` (this rank's tokens) -> ``[T, ...]`` every rank's, in global
    order. The gradient of each rank's tokens is summed over the ranks that used them."""
    if shard.size == 1:
        return x
    return _GatherTokens.apply(x, shard)


def _all_to_all(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """``x`` ``[c, ...]``: block ``j`` goes to rank ``j``; returns ``[c, ...]`` whose block
    ``j`` came from rank ``j``."""
    x = x.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    dist.all_to_all_single(out, x, group=shard.group)
    return out


def _split_heads(x: torch.Tensor, size: int) -> torch.Tensor:
    """``[N, H, ...]`` -> ``[c, N, H / c, ...]``."""
    n, heads = x.shape[:2]
    return x.reshape(n, size, heads // size, *x.shape[2:]).movedim(1, 0)


def _to_heads(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    received = _all_to_all(_split_heads(x, shard.size), shard)  # [c, T/c, H/c, ...]
    return shard.unshard(received.flatten(0, 1))


def _to_tokens(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    rank_major = x.index_select(0, shard.rank_order.to(x.device))
    blocks = rank_major.reshape(shard.size, -1, *x.shape[1:])  # block j: rank j's tokens
    received = _all_to_all(blocks, shard)  # [c, T/c, H/c, ...]: block j holds heads of rank j
    return received.movedim(0, 1).flatten(1, 2)


class _TokensToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
        ctx.shard = shard
        return _to_heads(x, shard)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _to_tokens(grad, ctx.shard), None


class _HeadsToTokens(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
        ctx.shard = shard
        return _to_tokens(x, shard)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _to_heads(grad, ctx.shard), None


def tokens_to_heads(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """``[T / c, H, ...]`` (my tokens, all heads) -> ``[T, H / c, ...]`` (all tokens in global
    order, heads ``rank * H / c`` onwards). ``H`` must be a multiple of ``c``."""
    if shard.size == 1:
        return x
    if x.shape[1] % shard.size:
        raise ValueError(f"{x.shape[1]} heads do not split over {shard.size} context ranks")
    return _TokensToHeads.apply(x, shard)


def heads_to_tokens(x: torch.Tensor, shard: ContextShard) -> torch.Tensor:
    """The inverse of :func:`tokens_to_heads`: ``[T, H / c, ...]`` -> ``[T / c, H, ...]``."""
    if shard.size == 1:
        return x
    return _HeadsToTokens.apply(x, shard)


# --- causal softmax attention over a context-parallel share ---


def _chunk_prefixes(shard: ContextShard) -> tuple[list[tuple[int, int, int, int]], int]:
    """Per local chunk: (local start, local end, global sequence start, global chunk end),
    and the longest key prefix."""
    bounds = shard.cu_seqlens.tolist()
    local = shard.local_cu_seqlens.tolist()
    spans, longest = [], 0
    for i, (start, end) in enumerate(itertools.pairwise(bounds)):
        chunk = (end - start) // (2 * shard.size)
        for j, c in enumerate((shard.rank, 2 * shard.size - 1 - shard.rank)):
            k_end = start + (c + 1) * chunk
            spans.append((local[2 * i + j], local[2 * i + j + 1], start, k_end))
            longest = max(longest, k_end - start)
    return spans, longest


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    shard: ContextShard,
    *,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over every rank's keys and values.

    ``query`` ``[T / c, Hq, D]``, ``key`` ``[T / c, Hkv, D]``, ``value`` ``[T / c, Hkv, Dv]``:
    this rank's tokens in local order (rotary embeddings already applied at global
    positions). Keys and values are gathered (:func:`gather_tokens`); each local chunk then
    attends to its sequence's keys from the start through the chunk's own end, causally
    (query ``i`` of a chunk ending at global position ``e`` sees keys up to
    ``e - len + i``). Returns ``[T / c, Hq, Dv]``.
    """
    from areal.engine.attention import prefix_causal_attention

    keys = gather_tokens(key, shard)
    values = gather_tokens(value, shard)
    spans, longest = _chunk_prefixes(shard)
    return prefix_causal_attention(query, keys, values, spans, longest, scale=scale)
