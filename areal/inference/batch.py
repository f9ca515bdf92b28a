"""A running batch for continuous batching on a ``transformers`` causal LM.

Rows are left-padded: the KV cache is ``[B, heads, L, dim]`` per attention layer and a
``[B, L]`` attention mask marks real positions. New requests are prefilled as their own
group and merged in (both sides left-padded to the longer length); finished rows are
dropped and columns that became padding for every row are trimmed. Positions come from the
mask, so padding never shifts RoPE. Linear-attention layers of hybrid models keep one
recurrent and one conv state per row, merged and dropped with the rows
(:mod:`areal.inference.cache_rows`).
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache

from areal.inference.cache_rows import append_rows, select_rows

__all__ = ["RunningBatch", "cache_kwarg", "prefill_inputs"]


def cache_kwarg(model: torch.nn.Module) -> str:
    """The forward() keyword of the KV cache (``cache`` in newer transformers)."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _pad_left(t: torch.Tensor, length: int) -> torch.Tensor:
    """``[B, L]`` → ``[B, length]``, zeros in front."""
    missing = length - t.shape[1]
    if missing <= 0:
        return t
    return torch.cat([t.new_zeros(t.shape[0], missing), t], dim=1)


class RunningBatch:
    """KV cache, attention mask and the pending next token of every running row."""

    def __init__(self) -> None:
        self.cache: Cache | None = None
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

    def merge(self, cache: Cache, mask: torch.Tensor, next_tokens: torch.Tensor) -> None:
        """Append rows (a freshly prefilled group) to the batch; takes ``cache`` over."""
        if self.size == 0:
            self.cache, self.mask, self.next_tokens = cache, mask, next_tokens
            return
        length = max(self.length, mask.shape[1])
        append_rows(self.cache, cache, length)
        self.mask = torch.cat([_pad_left(self.mask, length), _pad_left(mask, length)], 0)
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
        select_rows(self.cache, index, start, self.length)

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
