"""On CUDA in bf16, the varlen-kernel path of packed attention agrees with the exact SDPA loop.

Both paths are compared against an fp32 SDPA reference: the fast path may not be much
further from it than the bf16 SDPA loop is (bf16 keeps 8 bits of mantissa, so differences of
a few 1e-3 relative to the output scale are rounding, not bugs).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from areal.engine.attention import (
    packed_causal_attention,
    packed_forward_kwargs,
    register_varlen_attention,
    varlen_kernel_available,
)
from areal.engine.logprobs import gather_logprobs, logprobs_from_logits, next_token_labels

pytestmark = pytest.mark.gpu

# Segments of a packed micro-batch; the last one is padding. GQA: 8 query heads, 2 KV heads.
SEGMENTS = [5, 100, 37, 300, 1, 64, 58]
HQ, HKV, HEAD_DIM = 8, 2, 64


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def _packed_inputs(dtype: torch.dtype):
    g = torch.Generator(device="cuda").manual_seed(0)
    n_tokens = sum(SEGMENTS)
    q = torch.randn(n_tokens, HQ, HEAD_DIM, device="cuda", generator=g)
    k = torch.randn(n_tokens, HKV, HEAD_DIM, device="cuda", generator=g)
    v = torch.randn(n_tokens, HKV, HEAD_DIM, device="cuda", generator=g)
    grad_out = torch.randn(n_tokens, HQ, HEAD_DIM, device="cuda", generator=g)
    cu = torch.tensor([0, *itertools.accumulate(SEGMENTS)], dtype=torch.int32, device="cuda")
    return [t.to(dtype) for t in (q, k, v, grad_out)], cu


def _run(backend: str, dtype: torch.dtype):
    (q, k, v, grad_out), cu = _packed_inputs(dtype)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = packed_causal_attention(q, k, v, cu, max(SEGMENTS), scale=0.1, backend=backend)
    out.backward(grad_out)
    return out.detach(), q.grad, k.grad, v.grad


@pytest.mark.skipif(not varlen_kernel_available(), reason="torch has no varlen_attn kernel")
def test_varlen_kernel_matches_sdpa_loop_bf16_gqa():
    reference = _run("sdpa", torch.float32)
    slow = _run("sdpa", torch.bfloat16)
    fast = _run("varlen", torch.bfloat16)
    for name, ref, s, f in zip(("out", "dq", "dk", "dv"), reference, slow, fast):
        assert f.dtype == torch.bfloat16 and f.shape == ref.shape, name
        err_fast, err_slow = _rel_err(f, ref), _rel_err(s, ref)
        assert err_fast < max(2 * err_slow, 1e-2), (name, err_fast, err_slow)
        assert _rel_err(f, s) < 2e-2, name


@pytest.mark.skipif(not varlen_kernel_available(), reason="torch has no varlen_attn kernel")
def test_grouped_kv_and_repeated_kv_paths_agree(monkeypatch):
    """Whatever the probe decides (printed), both GQA paths give the same out and grads."""
    import areal.engine.attention as attention

    native = attention._varlen_reads_grouped_kv(torch.device("cuda", 0), torch.bfloat16)
    print(f"varlen kernel reads grouped key/value heads natively: {native}")
    default = _run("varlen", torch.bfloat16)
    monkeypatch.setattr(attention, "_varlen_reads_grouped_kv", lambda *a: False)
    repeated = _run("varlen", torch.bfloat16)
    for name, a, b in zip(("out", "dq", "dk", "dv"), default, repeated):
        assert a.shape == b.shape, name
        assert _rel_err(a, b) < 1e-2, name


@pytest.mark.skipif(not varlen_kernel_available(), reason="torch has no varlen_attn kernel")
def test_auto_backend_picks_varlen_for_bf16_cuda(monkeypatch):
    import areal.engine.attention as attention

    calls = []
    real = attention._packed_varlen
    monkeypatch.setattr(
        attention, "_packed_varlen", lambda *a, **k: calls.append(1) or real(*a, **k)
    )
    (q, k, v, _), cu = _packed_inputs(torch.bfloat16)
    packed_causal_attention(q, k, v, cu, max(SEGMENTS))
    assert calls == [1]
    (q, k, v, _), cu = _packed_inputs(torch.float32)
    packed_causal_attention(q, k, v, cu, max(SEGMENTS))
    assert calls == [1]  # fp32 takes the exact loop


def test_packed_tiny_model_bf16_matches_unpacked(tmp_path):
    from transformers import AutoModelForCausalLM

    from areal.utils.tiny_model import build_tiny_model

    path = build_tiny_model(tmp_path / "tiny", seed=0)
    packed = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation=register_varlen_attention()
    ).cuda()
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    g = torch.Generator().manual_seed(0)
    lens = [5, 17, 9, 30, 6]
    seqs = [torch.randint(0, packed.config.vocab_size, (n,), generator=g) for n in lens]
    ids = torch.cat(seqs)[None].cuda()
    pos = torch.cat([torch.arange(n) for n in lens])[None].cuda()
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")

    hidden = packed.model(
        input_ids=ids, position_ids=pos, **packed_forward_kwargs(cu, max(lens))
    ).last_hidden_state[0]
    logp, entropy = gather_logprobs(
        hidden, packed.lm_head.weight, next_token_labels(ids, cu), chunk_size=32
    )
    assert logp.dtype == torch.float32 and torch.isfinite(entropy).all()
    logp.sum().backward()
    assert all(
        p.grad is not None and torch.isfinite(p.grad.float()).all()
        for p in packed.parameters()
        if p.requires_grad
    )

    start = 0
    with torch.no_grad():
        for seq in seqs[:-1]:  # the last segment stands for padding
            alone = plain(input_ids=seq[None].cuda()).logits[0].float()
            ref = logprobs_from_logits(alone[:-1], seq[1:].cuda())
            got = logp[start : start + len(seq) - 1].detach()
            assert (got - ref).abs().max().item() < 0.1
            start += len(seq)


def test_gather_logprobs_bf16_cuda_matches_fp32_reference():
    # Same bf16 values on both sides: only the GEMM's accumulation and the softmax differ.
    g = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(700, 256, device="cuda", generator=g).bfloat16().requires_grad_()
    weight = (0.05 * torch.randn(5000, 256, device="cuda", generator=g)).bfloat16()
    weight.requires_grad_()
    labels = torch.randint(0, 5000, (700,), device="cuda", generator=g)
    upstream = torch.randn(700, device="cuda", generator=g)

    logp, _ = gather_logprobs(hidden, weight, labels, temperature=0.9, chunk_size=256)
    grad_h, grad_w = torch.autograd.grad((logp * upstream).sum(), (hidden, weight))
    h32, w32 = (t.detach().float().requires_grad_() for t in (hidden, weight))
    ref = logprobs_from_logits(h32 @ w32.T, labels, temperature=0.9)
    ref_h, ref_w = torch.autograd.grad((ref * upstream).sum(), (h32, w32))

    assert (logp.detach() - ref.detach()).abs().max().item() < 1e-3
    assert grad_h.dtype == grad_w.dtype == torch.bfloat16
    assert _rel_err(grad_h, ref_h) < 1e-2 and _rel_err(grad_w, ref_w) < 1e-2
