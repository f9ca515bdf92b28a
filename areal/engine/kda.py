"""Kimi Delta Attention (KDA) on packed token streams, in plain torch.

KDA is the linear attention of Ling 3's hybrid layers: a gated delta rule whose forget gate
decays every key dimension separately. Per head, with a state ``S`` of ``[Dk, Dv]`` and for
each token ``t`` (``q``, ``k`` L2-normalised, ``q`` scaled by ``Dk ** -0.5``)::

    S <- diag(exp(g_t)) S                       # forget, per key dimension
    u_t = beta_t * (v_t - S^T k_t)              # delta-rule correction
    S <- S + k_t u_t^T
    o_t = S^T q_t

Training packs several sequences into one ``[T]`` stream (``cu_seqlens``, as the rest of the
engine does); the state and the short causal convolution in front of it restart at every
segment start. :func:`chunked_kda` computes the recurrence chunk by chunk: inside a chunk the
corrections solve a unit lower-triangular system, and only the ``[Dk, Dv]`` state crosses
chunk boundaries, so a sequence costs ``T / C`` sequential steps instead of ``T``.

Everything here is differentiable torch (CPU or GPU). :func:`kda_delta_rule` is what the
model code calls: on CUDA, with flash-linear-attention installed, it runs that package's
varlen ``chunk_kda`` Triton kernel (forward and backward); otherwise :func:`chunked_kda`.
Both the FSDP engine's packed forward of transformers' layers
(:mod:`areal.models.bailing_packed`) and the Megatron bridge's KDA layer go through it.

flash-linear-attention autotunes each Triton kernel on its first call, compiling every
candidate configuration: for KDA's forward and backward that is a few hundred compilations,
minutes of CPU before the first training step. ``AREAL_FLA_AUTOTUNE=quick`` (read when the
kernels are first used; :func:`limit_fla_autotuning`) keeps two candidates per kernel, for
correctness checks and short benchmarks; the default ``full`` leaves fla's tuning alone.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import os
import sys

import torch
from torch.nn import functional

from areal.utils import logging

__all__ = [
    "KDA_CHUNK",
    "chunked_kda",
    "gated_rms_norm",
    "kda_delta_rule",
    "kda_forget_gate",
    "l2_normalize",
    "limit_fla_autotuning",
    "packed_causal_conv1d",
    "segment_positions",
]

# Chunk length of the chunked recurrence. Intra-chunk work holds a [C, C, Dk] decay tensor
# per chunk and head, so memory grows with C; the sequential steps shrink with it.
KDA_CHUNK = 32


def segment_positions(cu_seqlens: torch.Tensor, n_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's segment index and position inside it, both ``[T]`` long, on the device.

    ``cu_seqlens`` ``[n + 1]`` runs from 0 to ``n_tokens``; empty segments are allowed.
    """
    bounds = cu_seqlens.to(dtype=torch.long)
    index = torch.arange(n_tokens, device=bounds.device)
    segment = torch.searchsorted(bounds[1:].contiguous(), index, right=True)
    return segment, index - bounds[segment]


def packed_causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, cu_seqlens: torch.Tensor
) -> torch.Tensor:
    """Depthwise causal convolution of each packed segment, in float32.

    ``x`` ``[T, C]``, ``weight`` ``[C, 1, K]`` (a ``Conv1d(groups=C)`` kernel, tap ``K - 1``
    on the current token), ``cu_seqlens`` ``[n + 1]``. Returns ``[T, C]`` float32: token
    ``t`` sees ``x[t - K + 1 .. t]`` of its own segment only (earlier taps read zeros).
    """
    taps = weight.shape[-1]
    kernel = weight.reshape(weight.shape[0], taps).float()
    x = x.float()
    _, position = segment_positions(cu_seqlens, x.shape[0])
    out = x * kernel[:, taps - 1]
    for lag in range(1, taps):
        shifted = (
            functional.pad(x[:-lag], (0, 0, lag, 0)) if lag < x.shape[0] else torch.zeros_like(x)
        )
        inside = (position >= lag).unsqueeze(-1)
        out = out + torch.where(inside, shifted, 0.0) * kernel[:, taps - 1 - lag]
    return out


def kda_forget_gate(
    gate_input: torch.Tensor,
    a_log: torch.Tensor,
    dt_bias: torch.Tensor,
    safe_gate: bool,
    lower_bound: float,
) -> torch.Tensor:
    """Per-key-dimension log decay ``g`` (``<= 0``), float32.

    ``gate_input`` ``[T, H, D]`` (the forget-gate projection), ``a_log`` ``[H]``, ``dt_bias``
    ``[H, D]``. With ``safe_gate`` the decay is bounded: ``lower_bound * sigmoid(A x)``
    (``lower_bound`` in ``[-5, 0)``); without it, ``-A * softplus(x)``; ``A = exp(a_log)``
    and ``x = gate_input + dt_bias``.
    """
    x = gate_input.float() + dt_bias.float()
    rate = a_log.float().exp().unsqueeze(-1)
    if safe_gate:
        return lower_bound * torch.sigmoid(rate * x)
    return -rate * functional.softplus(x)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(|x|^2 + eps)`` over the last dimension (eps inside the root, as FLA does)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_rms_norm(
    x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """RMS norm over the last dimension times ``sigmoid(gate)``, in float32, cast to ``gate``'s
    dtype. ``x``, ``gate`` ``[..., D]``, ``weight`` ``[D]``."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return (normed * torch.sigmoid(gate.float())).to(gate.dtype)


def _to_chunks(
    x: torch.Tensor, segment: torch.Tensor, position: torch.Tensor, n_seg: int, length: int
) -> torch.Tensor:
    """``[T, H, ...]`` packed -> ``[n_seg, H, length / C, C, ...]`` zero-padded per segment."""
    padded = x.new_zeros((n_seg * length, *x.shape[1:]))
    padded = padded.index_copy(0, segment * length + position, x)
    padded = padded.view(n_seg, length // KDA_CHUNK, KDA_CHUNK, *x.shape[1:])
    return padded.movedim(3, 1)


def chunked_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
) -> torch.Tensor:
    """The KDA recurrence over every packed segment, each from a zero state, in float32.

    ``q``, ``k``, ``g`` ``[T, H, Dk]`` (``q``/``k`` before L2 normalisation, ``g`` the log
    decay of :func:`kda_forget_gate`), ``v`` ``[T, H, Dv]``, ``beta`` ``[T, H]``,
    ``cu_seqlens`` ``[n + 1]``. Returns ``o`` ``[T, H, Dv]`` float32.

    Reads the segment lengths on the host once per call (to size the padded chunks).
    """
    n_tokens, _, dk = q.shape
    bounds = cu_seqlens.tolist()
    n_seg = len(bounds) - 1
    longest = max((b - a for a, b in itertools.pairwise(bounds)), default=0)
    length = max(1, -(-longest // KDA_CHUNK)) * KDA_CHUNK
    segment, position = segment_positions(cu_seqlens, n_tokens)

    def chunks(x: torch.Tensor) -> torch.Tensor:
        return _to_chunks(x.float(), segment, position, n_seg, length)

    q = chunks(l2_normalize(q.float()) * dk**-0.5)  # [B, H, N, C, Dk]
    k = chunks(l2_normalize(k.float()))
    v, g, beta = chunks(v), chunks(g), chunks(beta)  # beta: [B, H, N, C]

    # --- inside each chunk (all chunks at once) ---
    decay_to = g.cumsum(-2)  # G_i: log decay from the chunk start through token i
    upto = torch.ones(KDA_CHUNK, KDA_CHUNK, dtype=torch.bool, device=q.device).tril()
    gap = decay_to.unsqueeze(-2) - decay_to.unsqueeze(-3)  # [.., i, j, Dk]: G_i - G_j
    pair_decay = gap.masked_fill(~upto[..., None], float("-inf")).exp()  # 0 where j > i
    kk = torch.einsum("...id,...jd,...ijd->...ij", k, k, pair_decay)
    qk = torch.einsum("...id,...jd,...ijd->...ij", q, k, pair_decay)
    # (I + A) u = beta v - beta (k exp(G)) S0 with A_ij = beta_i kk_ij for j < i
    strict = beta.unsqueeze(-1) * kk.masked_fill(~upto.tril(-1), 0.0)
    eye = torch.eye(KDA_CHUNK, dtype=q.dtype, device=q.device)
    rhs = torch.cat([beta.unsqueeze(-1) * v, beta.unsqueeze(-1) * k * decay_to.exp()], -1)
    solved = torch.linalg.solve_triangular(eye + strict, rhs, upper=False, unitriangular=True)
    u_free, u_from_state = solved.split([v.shape[-1], dk], dim=-1)
    q_decayed = q * decay_to.exp()
    total = decay_to[..., -1:, :]  # G_C
    k_to_end = k * (total - decay_to).exp()

    # --- across chunks: only the state travels ---
    state = q.new_zeros(n_seg, q.shape[1], dk, v.shape[-1])
    outs = []
    for n in range(length // KDA_CHUNK):
        u = u_free[:, :, n] - u_from_state[:, :, n] @ state
        outs.append(q_decayed[:, :, n] @ state + qk[:, :, n] @ u)
        state = total[:, :, n].transpose(-1, -2).exp() * state + k_to_end[:, :, n].mT @ u
    o = torch.stack(outs, dim=2)  # [B, H, N, C, Dv]
    o = o.movedim(1, 3).reshape(n_seg * length, q.shape[1], v.shape[-1])
    return o.index_select(0, segment * length + position)


def fla_available() -> bool:
    """Whether flash-linear-attention's kernels can be imported (they run on CUDA only)."""
    return importlib.util.find_spec("fla") is not None


def _fla_compute_dtype(tensors: tuple[torch.Tensor, ...]) -> torch.dtype:
    """The one dtype fla's kernels get for ``q``, ``k``, ``v`` and ``beta``: bfloat16 when
    any of them is bfloat16, else float16 when any is float16, else float32."""
    dtypes = {t.dtype for t in tensors}
    for half in (torch.bfloat16, torch.float16):
        if half in dtypes:
            return half
    return torch.float32


def kda_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    *,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The KDA recurrence of every packed segment from a zero state (inputs as
    :func:`chunked_kda`'s). On CUDA with flash-linear-attention installed: its varlen
    ``chunk_kda`` kernel, output in ``q``'s dtype; otherwise :func:`chunked_kda`, float32.

    The fla kernels get contiguous inputs of one dtype: ``q``, ``k``, ``v`` and ``beta`` in
    ``compute_dtype`` (the caller's activation dtype, when it passes one), else bfloat16
    when any of them is bfloat16 (float16 likewise), else float32; the log decay ``g``
    always float32 and ``cu_seqlens`` int64 on ``q``'s device. (Callers hand over views of
    a split convolution output, float32 ``g`` beside bfloat16 ``q``/``k``/``v``, and
    bfloat16 or float32 ``beta``.) ``compute_dtype`` does not affect the torch path.
    """
    if q.is_cuda and fla_available():
        from fla.ops.kda import chunk_kda

        if os.environ.get(FLA_AUTOTUNE_ENV, "full") == "quick":
            limit_fla_autotuning()

        out_dtype = q.dtype
        dtype = compute_dtype or _fla_compute_dtype((q, k, v, beta))
        q, k, v, beta = (t.to(dtype).contiguous() for t in (q, k, v, beta))
        g = g.to(torch.float32).contiguous()
        out, _ = chunk_kda(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            g=g.unsqueeze(0),
            beta=beta.unsqueeze(0),
            cu_seqlens=cu_seqlens.to(device=q.device, dtype=torch.long).contiguous(),
            use_qk_l2norm_in_kernel=True,
        )
        return out[0].to(out_dtype)
    return chunked_kda(q, k, v, g, beta, cu_seqlens)


FLA_AUTOTUNE_ENV = "AREAL_FLA_AUTOTUNE"
logger = logging.getLogger("engine.kda")


def limit_fla_autotuning(keep: int = 2) -> int:
    """Cut every imported flash-linear-attention kernel's autotuning candidates to ``keep``:
    the one nearest 4 warps and 2 pipeline stages, with the largest blocks, then the first
    of fla's own list (a fallback: a candidate that does not fit the GPU is skipped by
    Triton's autotuner). Kernels already tuned keep their choice. Returns how many kernels
    were cut; idempotent. Used by ``AREAL_FLA_AUTOTUNE=quick``."""
    cut = 0
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fla" or name.startswith("fla.")):
            continue
        for value in list(vars(module).values()):
            tuner = _autotuner_of(value)
            if tuner is None or getattr(tuner, "_areal_limited", False):
                continue
            configs = list(tuner.configs)
            if len(configs) > keep:
                ranked = sorted(configs, key=_config_rank)
                chosen = ranked[:1] + [c for c in configs if c is not ranked[0]][: keep - 1]
                tuner.configs = chosen
                cut += 1
            tuner._areal_limited = True
    if cut:
        logger.info(
            "%s=quick: cut %d fla kernels to %d tuning candidates", FLA_AUTOTUNE_ENV, cut, keep
        )
    return cut


def _autotuner_of(value: object) -> object | None:
    """The Triton autotuner behind a kernel object (under ``triton.heuristics`` wrappers),
    or None for anything else."""
    for _ in range(4):
        if value is None or isinstance(value, type):
            return None
        if any(cls.__name__ == "Autotuner" for cls in type(value).__mro__):
            return value if hasattr(value, "configs") else None
        value = getattr(value, "fn", None)
    return None


def _config_rank(config: object) -> tuple:
    warps = getattr(config, "num_warps", 4) or 4
    stages = getattr(config, "num_stages", 2) or 2
    blocks = sum(v for v in getattr(config, "kwargs", {}).values() if isinstance(v, int))
    return (abs(math.log2(warps / 4)), abs(stages - 2), -blocks)
