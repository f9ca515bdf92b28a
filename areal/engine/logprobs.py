"""Next-token log-probabilities from final hidden states, chunked so no [T, V] logits exist.

A packed micro-batch of T tokens against a vocabulary of V would need a ``[T, V]`` fp32
logits tensor (and as much again for its gradient) if the LM head ran on the whole stream.
:func:`gather_logprobs` instead computes ``log_softmax(hidden @ weight.T / temperature)``
for ``chunk_size`` tokens at a time, keeps only each token's log-sum-exp, and recomputes
the chunk logits in backward, so peak extra memory is about one ``[chunk_size, V]`` fp32
block plus an fp32 accumulator for the weight gradient.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

__all__ = ["gather_logprobs", "logprobs_from_logits", "next_token_labels"]


_HALF_DTYPES = (torch.bfloat16, torch.float16)


def _compute_dtype(*tensors: torch.Tensor) -> torch.dtype:
    # fp32 for everything except fp64 inputs, which stay fp64 so gradcheck can be exact.
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


@functools.cache
def _has_wide_mm(device: torch.device) -> bool:
    """Whether ``torch.mm(..., out_dtype=float32)`` runs for 16-bit inputs on ``device``."""
    try:
        one = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
        torch.mm(one, one, out_dtype=torch.float32)
    except (TypeError, RuntimeError, NotImplementedError):
        return False
    return True


def _use_wide_mm(a: torch.Tensor, out_dtype: torch.dtype) -> bool:
    return a.dtype in _HALF_DTYPES and out_dtype == torch.float32 and _has_wide_mm(a.device)


def _mm(a: torch.Tensor, b: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` as ``out_dtype``; 16-bit products come out of the GEMM unrounded where possible."""
    if _use_wide_mm(a, out_dtype):
        return torch.mm(a, b, out_dtype=out_dtype)
    return (a @ b).to(out_dtype)


def _addmm_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` in place, ``acc`` being wider than ``a`` and ``b`` or as wide."""
    if a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif _use_wide_mm(a, acc.dtype):
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += (a @ b).to(acc.dtype)


def _chunk_stats(
    logits: torch.Tensor, labels: torch.Tensor, inv_temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(lse, logp, entropy)`` of one chunk's raw logits ``[n, V]``, in place on ``logits``."""
    if inv_temperature != 1.0:
        logits.mul_(inv_temperature)
    lse = torch.logsumexp(logits, dim=-1)
    logp = logits.gather(-1, labels[:, None])[:, 0] - lse
    if not with_entropy:
        return lse, logp, None
    # H = sum_v p_v * (lse - logit_v): non-negative terms, no cancellation.
    neg_logp = logits.neg_().add_(lse[:, None])
    return lse, logp, neg_logp.neg().exp_().mul_(neg_logp).sum(-1)


def _chunk_grad(
    logits: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    grad_logp: torch.Tensor,
    inv_temperature: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """d loss / d raw logits, ``(1[v == label] - p_v) * grad_logp / temperature``, in place."""
    scale = grad_logp.to(logits.dtype) * inv_temperature
    if inv_temperature != 1.0:
        logits.mul_(inv_temperature)
    grad = logits.sub_(lse[:, None]).exp_().mul_(-scale[:, None])
    grad.scatter_add_(-1, labels[:, None], scale[:, None])
    return grad.to(out_dtype)


def _chunk_stats_pure(
    logits: torch.Tensor, labels: torch.Tensor, inv_temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`_chunk_stats` without mutation, the form the compiler fuses best."""
    scaled = logits * inv_temperature
    lse = torch.logsumexp(scaled, dim=-1)
    logp = scaled.gather(-1, labels[:, None])[:, 0] - lse
    if not with_entropy:
        return lse, logp, None
    neg_logp = lse[:, None] - scaled
    return lse, logp, (neg_logp.neg().exp() * neg_logp).sum(-1)


def _chunk_grad_pure(
    logits: torch.Tensor,
    lse: torch.Tensor,
    labels: torch.Tensor,
    grad_logp: torch.Tensor,
    inv_temperature: float,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """:func:`_chunk_grad` without mutation: one read of the logits, one write of the result."""
    scale = (grad_logp.to(logits.dtype) * inv_temperature)[:, None]
    probs = (logits * inv_temperature - lse[:, None]).exp()
    vocab = torch.arange(logits.shape[-1], device=logits.device)
    hit = (vocab[None, :] == labels[:, None]).to(logits.dtype)
    return ((hit - probs) * scale).to(out_dtype)


@functools.cache
def _fused_kernels():
    """``torch.compile`` of the chunk functions: one or two passes over the logits, not ~8."""
    return (
        torch.compile(_chunk_stats_pure, dynamic=True),
        torch.compile(_chunk_grad_pure, dynamic=True),
    )


def _kernels(fused: bool):
    return _fused_kernels() if fused else (_chunk_stats, _chunk_grad)


class _ChunkedLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight_in: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        chunk_size: int,
        with_entropy: bool,
        fused: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        dtype = _compute_dtype(hidden, weight_in)
        weight = weight_in.to(torch.promote_types(hidden.dtype, weight_in.dtype))
        stats, _ = _kernels(fused)
        n_tokens = hidden.shape[0]
        logp = torch.empty(n_tokens, dtype=dtype, device=hidden.device)
        lse = torch.empty(n_tokens, dtype=dtype, device=hidden.device)
        entropy = torch.empty(n_tokens if with_entropy else 0, dtype=dtype, device=hidden.device)
        for start in range(0, n_tokens, chunk_size):
            end = min(start + chunk_size, n_tokens)
            logits = _mm(hidden[start:end].to(weight.dtype), weight.T, dtype)
            chunk_lse, chunk_logp, chunk_entropy = stats(
                logits, labels[start:end], 1.0 / temperature, with_entropy
            )
            lse[start:end] = chunk_lse
            logp[start:end] = chunk_logp
            if with_entropy:
                entropy[start:end] = chunk_entropy
        ctx.save_for_backward(hidden, weight_in, labels, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.fused = fused
        ctx.mark_non_differentiable(entropy)
        return logp, entropy

    @staticmethod
    def backward(ctx: Any, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
        del grad_entropy  # entropy is reported, never trained on
        hidden, weight_in, labels, lse = ctx.saved_tensors
        temperature, chunk_size = ctx.temperature, ctx.chunk_size
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = lse.dtype
        weight = weight_in.to(torch.promote_types(hidden.dtype, weight_in.dtype))
        _, grad_fn = _kernels(ctx.fused)
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # Summed over chunks in fp32 (fp64 for fp64 inputs), cast to the weight's dtype once.
        grad_weight = (
            torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_weight else None
        )
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            h = hidden[start:end].to(weight.dtype)
            logits = _mm(h, weight.T, dtype)
            grad_logits = grad_fn(
                logits,
                lse[start:end],
                labels[start:end],
                grad_logp[start:end],
                1.0 / temperature,
                weight.dtype,
            )
            del logits
            if need_hidden:
                grad_hidden[start:end] = grad_logits @ weight
            if need_weight:
                _addmm_(grad_weight, grad_logits.T, h)
        if need_weight:
            grad_weight = grad_weight.to(weight_in.dtype)
        return grad_hidden, grad_weight, None, None, None, None, None


def gather_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = True,
    fused: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probability of ``labels`` under ``softmax(hidden @ weight.T / temperature)``.

    ``hidden`` ``[T, H]`` (any float dtype), ``weight`` ``[V, H]`` (the LM head, tied or not),
    ``labels`` ``[T]`` long. Returns ``(logp [T], entropy [T] or None)`` in float32 (float64
    for float64 inputs). ``logp`` is differentiable w.r.t. ``hidden`` and ``weight``, whose
    gradients come back in their own dtypes; ``entropy`` is detached.

    ``fused``: run each chunk's softmax statistics and logit gradient as ``torch.compile``
    kernels (one or two passes over the ``[chunk, V]`` block instead of one per op); the
    first call per process compiles them. Same maths, float rounding aside.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden [T, H] and weight [V, H], got {hidden.shape}, {weight.shape}"
        )
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels {tuple(labels.shape)} do not match hidden {tuple(hidden.shape)}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    logp, entropy = _ChunkedLogprobs.apply(
        hidden,
        weight,
        labels.long(),
        float(temperature),
        int(chunk_size),
        with_entropy,
        bool(fused),
    )
    return logp, (entropy if with_entropy else None)


def logprobs_from_logits(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """Reference: ``log_softmax(logits / temperature)`` at ``labels``; ``[..., V]`` -> ``[...]``.

    Float32 math (float64 for float64 logits); materializes the full log-softmax.
    """
    logits = logits.to(_compute_dtype(logits)) / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.long()[..., None])[..., 0]


def next_token_labels(input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Labels for a packed stream: position t scores token t + 1 of the same segment.

    ``input_ids`` ``[1, T]`` or ``[T]``, ``cu_seqlens`` ``[n + 1]``; returns ``[T]`` long. The
    last token of each segment has no successor and gets label 0, a valid index whose
    log-prob is meaningless: callers must mask it out (the loss mask does).
    """
    ids = input_ids.reshape(-1)
    labels = torch.roll(ids, shifts=-1).long()
    ends = cu_seqlens[1:].to(device=ids.device, dtype=torch.long) - 1
    # Empty segments repeat the previous end (or -1, the stream's last token): still a segment end.
    labels[ends] = 0
    return labels
