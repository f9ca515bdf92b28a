"""Per-request sampling over a batch of next-token logits, and SGLang's parameter rules.

Reported log-probs are those of the sampling distribution ``log_softmax(logits / T)``
before top-k/top-p/min-p truncation (what SGLang returns, and what the trainer recomputes
with ``actor.temperature``); greedy requests (``T`` below ``1e-6``, as SGLang rounds it)
report ``log_softmax(logits)``.

:meth:`SamplingParams.verify` applies SGLang's ``SamplingParams.verify`` ranges, plus
finiteness of every float (SGLang lets a NaN or infinite temperature through). The sampler
still refuses rows whose distribution is not finite (:class:`SamplingError`), before it
draws anything, so the engine can fail those requests alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

__all__ = ["GREEDY_EPS", "SamplingError", "SamplingParams", "SamplingParamsError", "sample_tokens"]

GREEDY_EPS = 1e-6  # SGLang treats 0 <= temperature < 1e-6 as greedy
_SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts


class SamplingParamsError(ValueError):
    """A sampling parameter outside SGLang's rules; ``field`` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field} {message}")
        self.field = field


class SamplingError(RuntimeError):
    """Rows of a batch whose next-token distribution cannot be sampled (``rows``)."""

    def __init__(self, rows: list[int], message: str):
        super().__init__(message)
        self.rows = rows


@dataclass
class SamplingParams:
    """SGLang's ``sampling_params`` subset (``temperature 0`` means greedy).

    ``max_new_tokens=None`` means "up to the context length" (SGLang's meaning); the
    engine resolves it against the prompt.
    """

    max_new_tokens: int | None = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def verify(self) -> None:
        """Raise :class:`SamplingParamsError` unless every value is within SGLang's rules."""
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "frequency_penalty",
            "presence_penalty",
            "repetition_penalty",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise SamplingParamsError(name, f"must be a number, got {value!r}")
            if not math.isfinite(value):
                raise SamplingParamsError(name, f"must be a finite number, got {value}")
        if self.temperature < 0.0:
            raise SamplingParamsError(
                "temperature", f"must be non-negative, got {self.temperature}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise SamplingParamsError("top_p", f"must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise SamplingParamsError("min_p", f"must be in [0, 1], got {self.min_p}")
        if self.top_k != -1 and self.top_k < 1:
            raise SamplingParamsError(
                "top_k", f"must be -1 (whole vocabulary) or at least 1, got {self.top_k}"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise SamplingParamsError(name, f"must be in [-2, 2], got {getattr(self, name)}")
        # SGLang's range is [0, 2], but its penalizer divides by the value: 0 is refused here
        if not 0.0 < self.repetition_penalty <= 2.0:
            raise SamplingParamsError(
                "repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}"
            )
        if self.min_new_tokens < 0:
            raise SamplingParamsError(
                "min_new_tokens", f"must be in [0, max_new_tokens], got {self.min_new_tokens}"
            )
        if self.max_new_tokens is not None:
            # SGLang accepts 0 (a prefill-only request); this server always samples a token
            if self.max_new_tokens < 1:
                raise SamplingParamsError(
                    "max_new_tokens",
                    f"must be at least 1 on this server, got {self.max_new_tokens}",
                )
            if self.min_new_tokens > self.max_new_tokens:
                raise SamplingParamsError(
                    "min_new_tokens",
                    f"must be in [0, max_new_tokens ({self.max_new_tokens})], got "
                    f"{self.min_new_tokens}",
                )
        seed = self.sampling_seed
        if seed is not None and not _SEED_RANGE[0] <= seed < _SEED_RANGE[1]:
            raise SamplingParamsError("sampling_seed", f"must fit in 64 bits, got {seed}")


def sample_tokens(
    logits: torch.Tensor,
    params: list[SamplingParams],
    outputs: list[list[int]],
    stop_ids: list[set[int]],
    generators: list[torch.Generator | None],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; returns ``(tokens [B], logprobs [B])``.

    ``logits`` is ``[B, V]``; ``outputs[i]`` are row i's tokens so far (for the penalties
    and ``min_new_tokens``), ``stop_ids[i]`` its stop tokens. Raises
    :class:`SamplingError` naming the rows whose distribution is not finite, before any
    random number is drawn.
    """
    logits = logits.float()
    vocab = logits.shape[1]
    for i, p in enumerate(params):
        _apply_penalties(logits, i, p, outputs[i], vocab)
        if len(outputs[i]) < p.min_new_tokens and stop_ids[i]:
            banned = sorted(t for t in stop_ids[i] if 0 <= t < vocab)
            if banned:
                logits[i, torch.tensor(banned, device=logits.device)] = float("-inf")

    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    temps = torch.tensor([p.temperature for p in params], device=logits.device)
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    # NaN anywhere, +inf anywhere or nothing finite: the row has no distribution
    bad = (~torch.isfinite(torch.logsumexp(scaled, dim=-1))).nonzero().flatten().tolist()
    if bad:
        raise SamplingError(
            bad,
            "the next-token distribution is not finite (NaN or infinite logits after "
            "temperature and penalties)",
        )
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


def _apply_penalties(
    logits: torch.Tensor, row: int, p: SamplingParams, output: list[int], vocab: int
) -> None:
    """SGLang's output-token penalties on ``logits[row]`` (in place)."""
    if not output or (
        p.frequency_penalty == 0.0 and p.presence_penalty == 0.0 and p.repetition_penalty == 1.0
    ):
        return
    ids = torch.tensor([t for t in output if 0 <= t < vocab], device=logits.device)
    counts = torch.bincount(ids, minlength=vocab)[:vocab].to(logits.dtype)
    seen = counts > 0
    values = logits[row]
    if p.repetition_penalty != 1.0:  # seen tokens: negative logits times p, others over p
        penalized = torch.where(
            values < 0, values * p.repetition_penalty, values / p.repetition_penalty
        )
        values = torch.where(seen, penalized, values)
    values = values - p.frequency_penalty * counts - p.presence_penalty * seen.to(values.dtype)
    logits[row] = values


def _truncate(scaled: torch.Tensor, params: list[SamplingParams], vocab: int) -> torch.Tensor:
    """Apply per-row top-k, top-p and min-p by setting excluded logits to -inf."""
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
    min_ps = torch.tensor([p.min_p for p in params], device=out.device)
    if bool((min_ps > 0.0).any()):  # keep tokens at least min_p times the likeliest one
        probs = torch.softmax(out, dim=-1)
        floor = probs.max(dim=-1, keepdim=True).values * min_ps[:, None]
        out = out.masked_fill(probs < floor, float("-inf"))
    return out
