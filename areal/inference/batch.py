"""A running batch for continuous batching on a ``transformers`` causal LM.

Rows are left-padded: the KV cache is ``[B, heads, L, dim]`` per layer and a ``[B, L]``
attention mask marks real positions. New requests are prefilled as their own group and
merged in (both sides left-padded to the longer length); finished rows are dropped and
columns that became padding for every row are trimmed. Positions come from the mask, so
padding never shifts RoPE.
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache

__all__ = ["RunningBatch", "cache_kwarg"]


def cache_kwarg(model: torch.nn.Module) -> str:
    """The forward() keyword of the KV cache (``cache`` in newer transformers)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _pad_left(t: torch.Tensor, length: int, dim: int) -> torch.Tensor:
    missing = length - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t.new_zeros(shape), t], dim=dim)


def _new_cache(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    cache = DynamicCache()
    for index, (keys, values) in enumerate(layers):
        cache.update(keys, values, index)
    return cache


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


class RunningBatch:
    """KV cache, attention mask and the pending next token of every running row."""

    def __init__(self) -> None:
        self.cache: DynamicCache | None = None
        self.mask: torch.Tensor | None = None  # [B, L] of 0/1
        self.next_tokens: torch.Tensor | None = None  # [B], sampled but not yet fed

    @property
    def size(self) -> int:
        return 0 if self.mask is None else self.mask.shape[0]

    @property
    def length(self) -> int:
        return 0 if self.mask is None else self.mask.shape[1]

    def clear(self) -> None:
        self.cache = self.mask = self.next_tokens = None

    def merge(self, cache: DynamicCache, mask: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Append rows (a freshly prefilled group) to the batch."""
        if self.size == 0:
            self.cache, self.mask, self.next_tokens = cache, mask, next_tokens
            return
        length = max(self.length, mask.shape[1])
        merged = [
            (
                torch.cat([_pad_left(k1, length, 2), _pad_left(k2, length, 2)], 0),
                torch.cat([_pad_left(v1, length, 2), _pad_left(v2, length, 2)], 0),
            )
            for (k1, v1), (k2, v2) in zip(_layers(self.cache), _layers(cache))
        ]
        self.cache = _new_cache(merged)
        self.mask = torch.cat([_pad_left(self.mask, length, 1), _pad_left(mask, length, 1)], 0)
        self.next_tokens = torch.cat([self.next_tokens, next_tokens])

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in that order), then trim all-padding leading columns."""
        if not rows:
            self.clear()
            return
        if rows == list(range(self.size)):
            return
        index = torch.tensor(rows, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        start = int((mask.sum(0) > 0).nonzero()[0])
        self.mask = mask[:, start:]
        self.next_tokens = self.next_tokens.index_select(0, index)
        self.cache = _new_cache(
            [
                (k.index_select(0, index)[:, :, start:], v.index_select(0, index)[:, :, start:])
                for k, v in _layers(self.cache)
            ]
        )

    def decode_inputs(self) -> dict[str, torch.Tensor]:
        """Forward() arguments that feed every row's pending token."""
        mask = torch.cat([self.mask, self.mask.new_ones(self.size, 1)], 1)
        positions = self.mask.sum(-1, keepdim=True)
        return {
            "input_ids": self.next_tokens[:, None],
            "attention_mask": mask,
            "position_ids": positions,
            "cache_position": torch.tensor([self.length], device=self.mask.device),
        }

    def advance(self, next_tokens: torch.Tensor) -> None:
        """After a decode step: the fed tokens are now in the cache."""
        self.mask = torch.cat([self.mask, self.mask.new_ones(self.size, 1)], 1)
        self.next_tokens = next_tokens


def prefill_inputs(
    prompts: list[list[int]], device: torch.device, pad_id: int = 0
) -> dict[str, torch.Tensor]:
    """Forward() arguments for a left-padded group of prompts (no cache yet)."""
    length = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (length - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (length - len(p)) + [1] * len(p) for p in prompts], device=device)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": positions}
