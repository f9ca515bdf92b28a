"""Token-balanced micro-batching: bin packing of rows and varlen packing of padded batches.

A training batch arrives padded, ``[B, L]``. The engine splits its rows into micro-batches
balanced by real token count (first-fit-decreasing under a token budget, or Karmarkar-Karp
into a fixed number of groups), then packs each micro-batch into one 1-D token stream
described by ``cu_seqlens`` so varlen attention sees every row as its own sequence and no
compute is spent on padding. The stream is padded to a bucket length (a multiple of 64 by
default) so kernel shapes repeat across steps; that padding is one extra pseudo-sequence,
so attention never mixes it with real rows.

Packed micro-batch layout (``T`` = bucket length, ``m`` = rows in the micro-batch)::

    <per-token key>  [1, T, ...]  rows' real tokens back to back, padding with 0
    <per-row key>    [m, ...]     the rows' values, ascending original order
    position_ids     [1, T] long  0.. per row; the padding continues 0..pad_len-1
    cu_seqlens       [m+1] int32  (+1 entry, the padding pseudo-sequence, when pad_len > 0)
    max_seqlen       int          longest entry of cu_seqlens (padding included)
    n_rows           int          m; real sequences are the first n_rows of cu_seqlens
    pad_len          int          T - real tokens
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from areal.api.config.train import MicroBatchSpec

__all__ = [
    "MicroBatchList",
    "PackingAlgorithm",
    "allocate_groups",
    "ffd_allocate",
    "kk_allocate",
    "pack_rows",
    "pad_sequences_to_tensor",
    "split_into_minibatches",
    "split_padded_tensor_dict_into_mb_list",
    "unpack_stream",
]

PackingAlgorithm = Literal["ffd", "kk"]


# --- allocation: row indices -> groups ---


def _fits(group: Sequence[int], lengths: Sequence[int], capacity: int | None) -> bool:
    """A group is within budget, or is a single row (an over-long row stands alone)."""
    return capacity is None or len(group) == 1 or sum(lengths[i] for i in group) <= capacity


def _lpt(lengths: Sequence[int], indices: Sequence[int], k: int) -> list[list[int]]:
    """Longest-first into the lightest of ``k`` groups; empty groups count as lightest."""
    groups: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in sorted(indices, key=lambda i: (-lengths[i], i)):
        j = min(range(k), key=lambda j: (loads[j], len(groups[j]), j))
        groups[j].append(i)
        loads[j] += lengths[i]
    return groups


def _canonical(groups: list[list[int]]) -> list[list[int]]:
    """Rows ascending within a group, groups ordered by their first row."""
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def ffd_allocate(lengths: list[int], capacity: int | None, min_groups: int) -> list[list[int]]:
    """First-fit-decreasing bin packing of row indices into at least ``min_groups`` groups.

    Rows (longest first) go into the first group whose token sum stays ``<= capacity``
    (``None``: unbounded); a row longer than ``capacity`` gets a group of its own. With
    fewer groups than ``min_groups`` the rows are re-spread longest-first onto the lightest
    of ``min_groups`` groups; when that breaks the budget, the heaviest multi-row group is
    split in two instead, repeatedly (splitting never raises a group's load).

    Returns non-empty groups of ascending row indices, ordered by their first row.
    Raises ``ValueError`` when ``min_groups`` exceeds the number of rows.
    """
    n = len(lengths)
    if min_groups > n:
        raise ValueError(f"cannot form {min_groups} non-empty groups from {n} rows")
    if capacity is not None and capacity < 1:
        raise ValueError(f"capacity must be a positive token count or None (got {capacity})")
    groups: list[list[int]] = []
    loads: list[int] = []
    for i in sorted(range(n), key=lambda i: (-lengths[i], i)):
        for j, load in enumerate(loads):
            if capacity is None or load + lengths[i] <= capacity:
                groups[j].append(i)
                loads[j] += lengths[i]
                break
        else:
            groups.append([i])
            loads.append(lengths[i])
    if len(groups) < min_groups:
        spread = _lpt(lengths, range(n), min_groups)
        if all(_fits(g, lengths, capacity) for g in spread):
            groups = spread
        else:
            while len(groups) < min_groups:
                heaviest = max(
                    (g for g in groups if len(g) > 1), key=lambda g: sum(lengths[i] for i in g)
                )
                groups.remove(heaviest)
                groups.extend(_lpt(lengths, heaviest, 2))
    return _canonical(groups)


def kk_allocate(lengths: list[int], k: int) -> list[list[int]]:
    """Karmarkar-Karp (largest differencing) partition of row indices into exactly ``k`` groups.

    Every row starts as a k-way partial partition (itself plus k-1 empty sets). The two
    partial partitions with the largest spread (max - min set sum) are merged repeatedly,
    pairing the heaviest set of one with the lightest of the other, until one remains.
    Returns non-empty groups of ascending row indices, ordered by their first row.
    """
    n = len(lengths)
    if not 1 <= k <= n:
        raise ValueError(f"cannot form {k} non-empty groups from {n} rows")

    def order(sets: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
        # Heaviest first; among equal sums, empty sets last so merges fill them first.
        return sorted(sets, key=lambda s: (s[0], len(s[1])), reverse=True)

    heap: list[tuple[int, int, list[tuple[int, list[int]]]]] = []
    for i, length in enumerate(lengths):
        sets = order([(length, [i])] + [(0, []) for _ in range(k - 1)])
        heap.append((-(sets[0][0] - sets[-1][0]), i, sets))
    heapq.heapify(heap)
    counter = n
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = order([(a[j][0] + b[-1 - j][0], a[j][1] + b[-1 - j][1]) for j in range(k)])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), counter, merged))
        counter += 1
    return _canonical([items for _, items in heap[0][2]])


def allocate_groups(
    lengths: list[int],
    capacity: int | None,
    min_groups: int,
    algorithm: PackingAlgorithm = "ffd",
    granularity: int = 1,
    divisor: int = 1,
) -> list[list[int]]:
    """Group row indices under ``capacity`` tokens per group, in units of ``granularity`` rows.

    Adjacent rows ``[u*granularity, (u+1)*granularity)`` form one unit that is never split.
    The group count is ``max(FFD groups under capacity, min_groups)`` rounded up to a
    multiple of ``divisor``, for either algorithm, so it depends only on lengths and
    settings. ``"kk"`` partitions into that many groups with Karmarkar-Karp and falls back
    to FFD when the balanced partition breaks the budget.
    """
    if algorithm not in ("ffd", "kk"):
        raise ValueError(f"unknown packing algorithm {algorithm!r} (expected 'ffd' or 'kk')")
    if granularity < 1 or divisor < 1:
        raise ValueError(f"granularity and divisor must be >= 1 ({granularity}, {divisor})")
    units = [
        list(range(s, min(s + granularity, len(lengths))))
        for s in range(0, len(lengths), granularity)
    ]
    unit_lengths = [sum(lengths[i] for i in unit) for unit in units]
    count = max(len(ffd_allocate(unit_lengths, capacity, 0)), min_groups)
    count = math.ceil(count / divisor) * divisor
    if count > len(units):
        raise ValueError(
            f"cannot form {count} non-empty micro-batches from {len(units)} units of "
            f"{granularity} row(s) (min_groups={min_groups}, divisor={divisor})"
        )
    unit_groups = None
    if algorithm == "kk" and count > 0:
        unit_groups = kk_allocate(unit_lengths, count)
        if not all(_fits(g, unit_lengths, capacity) for g in unit_groups):
            unit_groups = None
    if unit_groups is None:
        unit_groups = ffd_allocate(unit_lengths, capacity, count)
    return [[i for u in group for i in units[u]] for group in unit_groups]


def _sync_max(value: int, group: Any, device: torch.device) -> int:
    """All-reduce MAX of ``value`` over ``group`` when torch.distributed is initialized."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    backend = str(dist.get_backend(group))
    if "nccl" in backend and "gloo" not in backend:
        device = (
            device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
        )
    else:
        device = torch.device("cpu")
    t = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t.item())


# --- small tensor utilities ---


def pack_rows(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate ``[len_i, ...]`` rows into ``([sum len_i, ...], cu_seqlens int32 [n+1])``."""
    if not rows:
        raise ValueError("pack_rows needs at least one row")
    lens = torch.tensor([0] + [r.shape[0] for r in rows], dtype=torch.int64)
    cu_seqlens = torch.cumsum(lens, 0).to(torch.int32).to(rows[0].device)
    return torch.cat(rows, 0), cu_seqlens


def unpack_stream(x: torch.Tensor, cu_seqlens: torch.Tensor, n_rows: int) -> list[torch.Tensor]:
    """The first ``n_rows`` sequences of a packed stream ``x [T, ...]`` as ``[len_i, ...]`` views.

    Trailing entries of ``cu_seqlens`` (the padding pseudo-sequence) are ignored.
    """
    bounds = cu_seqlens[: n_rows + 1].tolist()
    return [x[bounds[i] : bounds[i + 1]] for i in range(n_rows)]


def pad_sequences_to_tensor(seqs: list[torch.Tensor], pad_value: float = 0.0) -> torch.Tensor:
    """Right-pad ``[len_i, ...]`` sequences into one ``[B, max len_i, ...]`` tensor."""
    if not seqs:
        raise ValueError("pad_sequences_to_tensor needs at least one sequence")
    max_len = max(s.shape[0] for s in seqs)
    ref = seqs[0]
    out = torch.full(
        (len(seqs), max_len, *ref.shape[1:]), pad_value, dtype=ref.dtype, device=ref.device
    )
    for i, s in enumerate(seqs):
        out[i, : s.shape[0]] = s
    return out


def _is_per_token(value: Any, batch: int, seq_len: int) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dim() >= 2
        and value.shape[0] == batch
        and value.shape[1] == seq_len
    )


def _is_per_row(value: Any, batch: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() >= 1 and value.shape[0] == batch


def _row_lengths(data: dict[str, Any]) -> tuple[torch.Tensor, list[int]]:
    if "attention_mask" not in data:
        raise KeyError("padded batch needs an 'attention_mask' [B, L] to find real tokens")
    mask = data["attention_mask"].bool()
    if mask.dim() != 2 or mask.shape[0] == 0:
        raise ValueError(f"attention_mask must be a non-empty [B, L] tensor (got {mask.shape})")
    return mask, mask.sum(1).tolist()


# --- micro-batches ---


@dataclass
class MicroBatchList:
    """A padded batch split into packed micro-batches, with the map back to its rows.

    ``groups[i]`` holds the original row indices of ``mbs[i]`` (ascending), ``seqlens[i]``
    their real lengths, ``padded_to[i]`` the bucket length ``T`` of its token stream.
    """

    data: dict[str, Any]
    mbs: list[dict[str, Any]]
    groups: list[list[int]]
    padded_to: list[int]
    seqlens: list[list[int]]

    def __len__(self) -> int:
        return len(self.mbs)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return iter(self.mbs)

    def _stream(self, i: int, out: torch.Tensor) -> torch.Tensor:
        """Output of micro-batch ``i`` as ``[T, ...]``, accepting ``[1, T, ...]`` too."""
        if out.dim() >= 2 and out.shape[0] == 1 and self.padded_to[i] != 1:
            out = out[0]
        real = sum(self.seqlens[i])
        if out.shape[0] < real:
            raise ValueError(f"micro-batch {i}: output has {out.shape[0]} tokens, need {real}")
        return out

    def unpack(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Per-token outputs of each micro-batch -> one ``[len_r, ...]`` tensor per row.

        ``outputs[i]`` is ``[T_i, ...]`` or ``[1, T_i, ...]`` aligned with ``mbs[i]``'s
        stream (the padding tail, if present, is dropped). Rows come back in original order.
        """
        if len(outputs) != len(self.mbs):
            raise ValueError(f"expected {len(self.mbs)} outputs, got {len(outputs)}")
        rows: list[torch.Tensor | None] = [None] * sum(len(g) for g in self.groups)
        for i, (out, group, lens) in enumerate(zip(outputs, self.groups, self.seqlens)):
            stream = self._stream(i, out)
            start = 0
            for row, n in zip(group, lens):
                rows[row] = stream[start : start + n]
                start += n
        return rows  # type: ignore[return-value]

    def to_padded(self, outputs: list[torch.Tensor], pad_value: float = 0.0) -> torch.Tensor:
        """Per-mb outputs -> ``[B, L, ...]`` at the original ``attention_mask`` positions."""
        rows = self.unpack(outputs)
        mask = self.data["attention_mask"].bool()
        ref = rows[0]
        out = torch.full(
            (*mask.shape, *ref.shape[1:]), pad_value, dtype=ref.dtype, device=ref.device
        )
        out[mask.to(ref.device)] = torch.cat(rows, 0)
        return out


def _pack_group(
    data: dict[str, Any],
    mask: torch.Tensor,
    rows: list[int],
    pad_to_multiple: int,
    pad_to: int | None,
) -> tuple[dict[str, Any], list[int], int]:
    """Pack ``rows`` of a padded batch into one stream; returns (mb, seqlens, bucket)."""
    batch, seq_len = mask.shape
    idx = torch.tensor(rows, dtype=torch.long, device=mask.device)
    sub_mask = mask[idx]
    seqlens = sub_mask.sum(1).tolist()
    total = sum(seqlens)
    bucket = max(math.ceil(total / pad_to_multiple), 1) * pad_to_multiple
    if pad_to is not None and total <= pad_to:
        bucket = pad_to
    pad_len = bucket - total

    mb: dict[str, Any] = {}
    for key, value in data.items():
        if _is_per_token(value, batch, seq_len):
            sub = value[idx.to(value.device)]
            stream = sub[sub_mask.to(value.device)]
            if pad_len:
                filler = stream.new_zeros((pad_len, *stream.shape[1:]))
                stream = torch.cat([stream, filler], 0)
            mb[key] = stream.unsqueeze(0)
        elif _is_per_row(value, batch):
            mb[key] = value[idx.to(value.device)]
        else:
            mb[key] = value

    seq_bounds = seqlens + ([pad_len] if pad_len else [])
    lens = torch.tensor(seq_bounds, dtype=torch.long, device=mask.device)
    starts = torch.cumsum(lens, 0) - lens
    positions = torch.arange(bucket, device=mask.device) - torch.repeat_interleave(starts, lens)
    mb["position_ids"] = positions.unsqueeze(0)
    mb["cu_seqlens"] = torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)]).to(torch.int32)
    mb["max_seqlen"] = max(seq_bounds, default=0)
    mb["n_rows"] = len(rows)
    mb["pad_len"] = pad_len
    return mb, seqlens, bucket


def split_padded_tensor_dict_into_mb_list(
    data: dict[str, Any],
    mb_spec: MicroBatchSpec,
    group: Any = None,
    *,
    pad_to_multiple: int = 64,
    pad_to: int | None = None,
) -> MicroBatchList:
    """Split a padded batch (``attention_mask [B, L]`` bool) into packed micro-batches.

    Rows are grouped by real token count with ``mb_spec.packing_algorithm`` under
    ``max_tokens_per_mb`` into at least ``n_mbs`` groups (``granularity``, ``n_mbs_divisor``
    honoured). With torch.distributed initialized the group count is the MAX over ``group``
    so every rank runs the same number of micro-batches. Each micro-batch is packed as in
    the module docstring, its stream padded to a multiple of ``pad_to_multiple`` tokens, or
    to ``pad_to`` tokens when given (``pad_to_maximum``; a longer stream keeps the multiple).
    Keys of shape ``[B, L, ...]`` are per-token, other ``[B, ...]`` tensors per-row, anything
    else is copied as is; an input ``position_ids`` is replaced.
    """
    if pad_to_multiple < 1:
        raise ValueError(f"pad_to_multiple must be >= 1 (got {pad_to_multiple})")
    mask, lengths = _row_lengths(data)
    settings = dict(
        capacity=mb_spec.max_tokens_per_mb,
        algorithm=mb_spec.packing_algorithm,
        granularity=mb_spec.granularity,
        divisor=mb_spec.n_mbs_divisor,
    )
    groups = allocate_groups(lengths, min_groups=mb_spec.n_mbs, **settings)
    n_groups = _sync_max(len(groups), group, mask.device)
    if n_groups != len(groups):
        groups = allocate_groups(lengths, min_groups=n_groups, **settings)

    mbs, padded_to, seqlens = [], [], []
    for rows in groups:
        mb, lens, bucket = _pack_group(data, mask, rows, pad_to_multiple, pad_to)
        mbs.append(mb)
        seqlens.append(lens)
        padded_to.append(bucket)
    return MicroBatchList(data=data, mbs=mbs, groups=groups, padded_to=padded_to, seqlens=seqlens)


def split_into_minibatches(
    data: dict[str, Any], n_minibatches: int, group: Any = None
) -> list[dict[str, Any]]:
    """Split a padded batch into at least ``n_minibatches`` token-balanced padded parts.

    FFD with no token budget (so a balanced spread into exactly the synchronized count);
    the count is the MAX over ``group`` when torch.distributed is initialized. Each part
    keeps its rows in original order as a padded ``[b, L']`` dict, ``L'`` trimmed to the
    part's last real token; per-row keys follow their rows, other values are copied.
    """
    mask, lengths = _row_lengths(data)
    batch, seq_len = mask.shape
    groups = allocate_groups(lengths, None, n_minibatches)
    n_groups = _sync_max(len(groups), group, mask.device)
    if n_groups != len(groups):
        groups = allocate_groups(lengths, None, n_groups)

    positions = torch.arange(1, seq_len + 1, device=mask.device)
    ends = (mask * positions).amax(1).tolist()  # last real token + 1, per row
    parts = []
    for rows in groups:
        idx = torch.tensor(rows, dtype=torch.long, device=mask.device)
        width = max(ends[r] for r in rows)
        part: dict[str, Any] = {}
        for key, value in data.items():
            if _is_per_token(value, batch, seq_len):
                part[key] = value[idx.to(value.device), :width]
            elif _is_per_row(value, batch):
                part[key] = value[idx.to(value.device)]
            else:
                part[key] = value
        parts.append(part)
    return parts
