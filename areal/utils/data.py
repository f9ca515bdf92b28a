"""Batch helpers for trajectories (dicts of ``[batch, seq, ...]`` tensors)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["concat_padded_tensors"]


def concat_padded_tensors(
    items: Sequence[dict[str, torch.Tensor]], pad_value: float = 0.0
) -> dict[str, torch.Tensor]:
    """Concatenate trajectory dicts along the batch dimension.

    Every tensor of an item has shape ``[batch, seq, ...]`` (or ``[batch]``); sequences
    are right-padded to the longest ``seq`` with ``pad_value`` (``attention_mask`` and
    ``loss_mask`` always with 0). All items must have the same keys.
    """
    items = [item for item in items if item]
    if not items:
        return {}
    keys = list(items[0])
    for item in items[1:]:
        if list(item) != keys:
            raise ValueError(f"trajectories have different keys: {keys} vs {list(item)}")
    seq_len = max((t.shape[1] for item in items for t in item.values() if t.dim() >= 2), default=0)
    out: dict[str, torch.Tensor] = {}
    for key in keys:
        parts = []
        fill = 0 if key in ("attention_mask", "loss_mask") else pad_value
        for item in items:
            t = item[key]
            if t.dim() >= 2 and t.shape[1] < seq_len:
                pad_shape = (t.shape[0], seq_len - t.shape[1], *t.shape[2:])
                t = torch.cat([t, torch.full(pad_shape, fill, dtype=t.dtype, device=t.device)], 1)
            parts.append(t)
        out[key] = torch.cat(parts, 0)
    return out
