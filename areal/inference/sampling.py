"""Per-request sampling over a batch of next-token logits.

Reported log-probs are those of the sampling distribution ``log_softmax(logits / T)``
before top-k/top-p truncation (what SGLang returns, and what the trainer recomputes with
``actor.temperature``); greedy requests (``T = 0``) report ``log_softmax(logits)``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["SamplingParams", "sample_tokens"]


@dataclass
class SamplingParams:
    """SGLang's ``sampling_params`` subset (``temperature 0`` means greedy)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0
    sampling_seed: int | None = None


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: list[list[int]],
    stop_ids: list[set[int]],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; returns ``(tokens [B], logprobs [B])``.

    ``logits`` is ``[B, V]``; ``outputs[i]`` are row i's tokens so far (for the frequency
    penalty and ``min_new_tokens``), ``stop_ids[i]`` its stop tokens.
    """
    logits = logits.float()
    vocab = logits.shape[1]
    for i, p in enumerate(params):
        if p.frequency_penalty and outputs[i]:
            counts = torch.bincount(
                torch.tensor(outputs[i], device=logits.device), minlength=vocab
            )[:vocab]
            logits[i] -= p.frequency_penalty * counts.to(logits.dtype)
        if len(outputs[i]) < p.min_new_tokens and stop_ids[i]:
            banned = torch.tensor(sorted(t for t in stop_ids[i] if t < vocab), device=logits.device)
            logits[i, banned] = float("-inf")

    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    greedy = temps <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    logprobs = torch.log_softmax(scaled, dim=-1)
    tokens = scaled.argmax(dim=-1)

    sampled_rows = (~greedy).nonzero().flatten().tolist()
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        filtered = _truncate(scaled[rows], [params[i] for i in sampled_rows], vocab)
        probs = torch.softmax(filtered, dim=-1)
        if any(generators[i] is not None for i in sampled_rows):
            picks = [
                torch.multinomial(probs[j], 1, generator=generators[i])
                for j, i in enumerate(sampled_rows)
            ]
            choice = torch.cat(picks)
        else:
            choice = torch.multinomial(probs, 1).flatten()
        tokens[rows] = choice
    chosen = logprobs.gather(1, tokens[:, None]).flatten()
    return tokens, chosen


def _truncate(scaled: torch.Tensor, params: list[SamplingParams], vocab: int) -> torch.Tensor:
    """Apply per-row top-k and top-p by setting excluded logits to -inf."""
    out = scaled.clone()
    ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(ks) < vocab:
        kth = torch.topk(out, max(ks), dim=-1).values
        thresholds = kth.gather(1, torch.tensor(ks, device=out.device)[:, None] - 1)
        out = out.masked_fill(out < thresholds, float("-inf"))
    ps = torch.tensor([p.top_p for p in params], device=out.device)
    if bool((ps < 1.0).any()):
        sorted_logits, order = torch.sort(out, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly before each token
        drop = before > ps[:, None]
        drop[:, 0] = False  # always keep the most likely token
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        out = torch.empty_like(out).scatter_(1, order, sorted_logits)
    return out
