"""Packed (varlen) attention and chunked log-probs agree with the plain unpacked computation."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from areal.engine.attention import (
    VARLEN_ATTENTION,
    packed_causal_attention,
    packed_forward_kwargs,
    register_varlen_attention,
)
from areal.engine.logprobs import gather_logprobs, logprobs_from_logits, next_token_labels
from areal.utils.tiny_model import build_tiny_model

SEQ_LENS = [5, 17, 9, 30]
PAD_LEN = 6


def _reference_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = torch.log_softmax(logits.double() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


# --- gather_logprobs ---


def test_gather_logprobs_hand_computed():
    # hidden [1, 0] against rows [1, 0] and [0, 0] gives logits [1, 0].
    # log p(0) = 1 - ln(1 + e) = 1 - 1.3132617 = -0.3132617
    # p = [0.7310586, 0.2689414]; H = 0.7310586 * 0.3132617 + 0.2689414 * 1.3132617 = 0.5822031
    # At temperature 2 the logits are [0.5, 0]: log p(0) = 0.5 - ln(1 + e^0.5) = -0.4740770
    hidden = torch.tensor([[1.0, 0.0], [1.0, 0.0]])
    weight = torch.tensor([[1.0, 0.0], [0.0, 0.0]])
    labels = torch.tensor([0, 1])
    logp, entropy = gather_logprobs(hidden, weight, labels)
    torch.testing.assert_close(logp, torch.tensor([-0.3132617, -1.3132617]))
    torch.testing.assert_close(entropy, torch.tensor([0.5822031, 0.5822031]))
    logp_t2, _ = gather_logprobs(hidden[:1], weight, labels[:1], temperature=2.0)
    torch.testing.assert_close(logp_t2, torch.tensor([-0.4740770]))


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 37, 64, 1024])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gather_logprobs_forward_matches_reference(chunk_size, temperature):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 16, generator=g)
    weight = torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (37,), generator=g)
    logp, entropy = gather_logprobs(hidden, weight, labels, temperature, chunk_size)
    logits = hidden @ weight.T
    assert logp.dtype == torch.float32 and logp.shape == (37,)
    torch.testing.assert_close(
        logp, logprobs_from_logits(logits, labels, temperature), rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(
        entropy, _reference_entropy(logits, temperature).float(), rtol=1e-5, atol=2e-6
    )
    assert not entropy.requires_grad


def test_gather_logprobs_gradcheck_fp64():
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(7, 4, dtype=torch.float64, generator=g, requires_grad=True)
    labels = torch.randint(0, 7, (6,), generator=g)
    for temperature in (1.0, 0.6):

        def fn(h, w, temperature=temperature):
            return gather_logprobs(h, w, labels, temperature, chunk_size=4)[0]

        assert torch.autograd.gradcheck(fn, (hidden, weight))


@pytest.mark.parametrize("temperature", [1.0, 1.3])
def test_gather_logprobs_grads_match_autograd_fp32(temperature):
    g = torch.Generator().manual_seed(2)
    hidden = torch.randn(300, 64, generator=g, requires_grad=True)
    weight = (0.1 * torch.randn(1000, 64, generator=g)).requires_grad_()
    labels = torch.randint(0, 1000, (300,), generator=g)
    upstream = torch.randn(300, generator=g)

    logp, _ = gather_logprobs(hidden, weight, labels, temperature, chunk_size=128)
    grad_h, grad_w = torch.autograd.grad((logp * upstream).sum(), (hidden, weight))
    ref = logprobs_from_logits(hidden @ weight.T, labels, temperature)
    ref_h, ref_w = torch.autograd.grad((ref * upstream).sum(), (hidden, weight))

    torch.testing.assert_close(logp, ref.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad_h, ref_h, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad_w, ref_w, rtol=1e-4, atol=1e-5)


def test_gather_logprobs_fused_kernels_match_eager():
    """``fused=True`` compiles the per-chunk softmax statistics and logit gradient; same maths.

    300 tokens in chunks of 128 leave a last chunk of 44, so the compiled kernels see two
    chunk lengths (dynamic shapes, no recompile per length needed for correctness).
    """
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(300, 32, generator=g, requires_grad=True)
    weight = (0.1 * torch.randn(500, 32, generator=g)).requires_grad_()
    labels = torch.randint(0, 500, (300,), generator=g)
    upstream = torch.randn(300, generator=g)
    results = []
    for fused in (False, True):
        logp, entropy = gather_logprobs(hidden, weight, labels, 1.3, chunk_size=128, fused=fused)
        grads = torch.autograd.grad((logp * upstream).sum(), (hidden, weight))
        results.append((logp.detach(), entropy, *grads))
    for eager, fused in zip(*results, strict=True):
        torch.testing.assert_close(fused, eager, rtol=1e-5, atol=1e-5)
    ref = logprobs_from_logits(hidden @ weight.T, labels, 1.3)
    torch.testing.assert_close(results[1][0], ref.detach(), rtol=1e-5, atol=1e-5)


def test_gather_logprobs_bf16_inputs_and_frozen_weight():
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(20, 32, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(40, 32, generator=g).bfloat16()  # frozen: no grad requested
    labels = torch.randint(0, 40, (20,), generator=g)
    logp, entropy = gather_logprobs(hidden, weight, labels, chunk_size=8, with_entropy=False)
    assert logp.dtype == torch.float32 and entropy is None
    ref = logprobs_from_logits((hidden @ weight.T).float(), labels)
    torch.testing.assert_close(logp, ref, rtol=1e-5, atol=1e-5)
    (grad_h,) = torch.autograd.grad(logp.sum(), hidden)
    assert grad_h.dtype == torch.bfloat16 and torch.isfinite(grad_h.float()).all()


def test_gather_logprobs_saves_no_logits():
    # Autograd must keep only the inputs and one log-sum-exp per token, never [T, V] logits.
    g = torch.Generator().manual_seed(4)
    n_tokens, vocab, dim = 64, 500, 8
    hidden = torch.randn(n_tokens, dim, generator=g, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=g, requires_grad=True)
    labels = torch.randint(0, vocab, (n_tokens,), generator=g)
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        gather_logprobs(hidden, weight, labels, chunk_size=16)
    assert sum(saved) == hidden.numel() + weight.numel() + 2 * n_tokens


def test_next_token_labels():
    # Segments [10 11 12] [20 21] [0 0] (the last one padding): each end gets label 0.
    ids = torch.tensor([[10, 11, 12, 20, 21, 0, 0]])
    cu = torch.tensor([0, 3, 5, 7], dtype=torch.int32)
    assert next_token_labels(ids, cu).tolist() == [11, 12, 0, 21, 0, 0, 0]
    assert next_token_labels(ids[0], cu).tolist() == [11, 12, 0, 21, 0, 0, 0]


# --- packed attention in real models ---


@pytest.fixture(scope="module")
def qwen3_pair(tmp_path_factory):
    """The repo's tiny Qwen3 (GQA: 4 query heads, 2 KV heads) with both backends, fp32."""
    from transformers import AutoModelForCausalLM

    path = build_tiny_model(tmp_path_factory.mktemp("tiny_qwen3"), seed=0)
    packed = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=register_varlen_attention()
    ).eval()
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return packed, plain


def _pack(seqs: list[torch.Tensor], pad_len: int):
    lens = [len(s) for s in seqs] + [pad_len]
    ids = torch.cat([*seqs, torch.zeros(pad_len, dtype=torch.long)])[None]
    pos = torch.cat([torch.arange(n) for n in lens])[None]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32)
    return ids, pos, cu, max(lens)


def _assert_packed_matches_unpacked(packed_model, plain_model, vocab_size: int):
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, vocab_size, (n,), generator=g) for n in SEQ_LENS]
    ids, pos, cu, max_len = _pack(seqs, PAD_LEN)
    with torch.no_grad():
        hidden = packed_model.model(
            input_ids=ids, position_ids=pos, **packed_forward_kwargs(cu, max_len)
        ).last_hidden_state[0]
        labels = next_token_labels(ids, cu)
        logp, _ = gather_logprobs(hidden, packed_model.lm_head.weight, labels, chunk_size=16)
        start = 0
        for seq in seqs:
            alone = plain_model(input_ids=seq[None]).logits[0]
            ref = logprobs_from_logits(alone[:-1], seq[1:])
            got = logp[start : start + len(seq) - 1]
            assert (got - ref).abs().max().item() < 1e-5
            start += len(seq)


def test_packed_tiny_qwen3_matches_unpacked(qwen3_pair):
    packed, plain = qwen3_pair
    assert packed.config._attn_implementation == VARLEN_ATTENTION
    assert plain.config.num_key_value_heads < plain.config.num_attention_heads
    _assert_packed_matches_unpacked(packed, plain, packed.config.vocab_size)


def _gqa_config(arch: str):
    common = dict(
        vocab_size=97,
        hidden_size=48,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    if arch == "llama":
        return transformers.LlamaConfig(**common)
    return transformers.Qwen2Config(**common)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_packed_gqa_models_match_unpacked(arch):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _gqa_config(arch)
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    packed = AutoModelForCausalLM.from_config(
        config, dtype=torch.float32, attn_implementation=register_varlen_attention()
    ).eval()
    packed.load_state_dict(plain.state_dict())
    _assert_packed_matches_unpacked(packed, plain, config.vocab_size)


def test_unpacked_padded_batch_and_generation_match_sdpa(qwen3_pair):
    # Without packing kwargs the backend is plain causal attention: left-padded batches and
    # cached decoding (queries at the end of the keys) must agree with the default backend.
    packed, plain = qwen3_pair
    ids = torch.tensor([[0, 0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15]])
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    with torch.no_grad():
        got = packed(input_ids=ids, attention_mask=mask).logits
        ref = plain(input_ids=ids, attention_mask=mask).logits
        torch.testing.assert_close(got[mask.bool()], ref[mask.bool()], rtol=1e-5, atol=1e-5)
        # Padded (a 2-D mask reaches attention) and unpadded (no mask at all) decoding.
        for batch, batch_mask in ((ids, mask), (ids[1:], None)):
            kwargs = dict(
                attention_mask=batch_mask,
                max_new_tokens=4,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
            out_got = packed.generate(batch, **kwargs)
            out_ref = plain.generate(batch, **kwargs)
            assert out_got.sequences.tolist() == out_ref.sequences.tolist()
            for a, b in zip(out_got.scores, out_ref.scores):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


# --- no [T, T] mask ---


class _LargestSquare(TorchDispatchMode):
    """Records the largest trailing [n, n] block of any tensor an op produces."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[-1] == t.shape[-2]:
                self.largest = max(self.largest, t.shape[-1])
        return out


def test_packed_forward_builds_no_full_mask(qwen3_pair):
    from transformers.masking_utils import create_causal_mask

    model = qwen3_pair[0]
    n_tokens, seg = 4096, 512
    ids = torch.randint(0, model.config.vocab_size, (1, n_tokens))
    pos = torch.arange(seg).repeat(n_tokens // seg)[None]
    cu = torch.arange(0, n_tokens + 1, seg, dtype=torch.int32)
    embeds = model.model.embed_tokens(ids)
    assert create_causal_mask(model.config, embeds, None, None, position_ids=pos) is None

    mode = _LargestSquare()
    with torch.no_grad(), mode:
        model.model(input_ids=ids, position_ids=pos, **packed_forward_kwargs(cu, seg))
    # Per-segment attention scores are [seg, seg] at most; a stream-wide mask would be 4096.
    assert mode.largest <= seg


def test_packed_attention_skips_empty_segments_and_checks_heads():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(10, 4, 8, generator=g)
    kv = torch.randn(10, 2, 8, generator=g)
    cu = torch.tensor([0, 4, 4, 10], dtype=torch.int32)
    out = packed_causal_attention(q, kv, kv, cu, 6, backend="sdpa")
    # The first token of a segment attends only to itself: its output is its own value.
    torch.testing.assert_close(out[4], kv[4].repeat_interleave(2, dim=0))
    torch.testing.assert_close(out[0], kv[0].repeat_interleave(2, dim=0))
    assert out.shape == q.shape and math.isfinite(out.abs().max().item())
    with pytest.raises(ValueError, match="multiple"):
        packed_causal_attention(q, torch.randn(10, 3, 8), torch.randn(10, 3, 8), cu, 6)
    with pytest.raises(ValueError, match="from 0 to 10"):
        packed_causal_attention(q, kv, kv, torch.tensor([0, 4, 12]), 8, backend="sdpa")


@pytest.mark.parametrize("grouped_ok", [True, False])
def test_grouped_kv_probe_decides_and_runs_in_any_grad_mode(monkeypatch, grouped_ok):
    """The probe behind native GQA in the varlen path (CUDA in practice; here a CPU stand-in
    kernel): True when grouped key/value heads give the repeated-heads result, forward and
    backward; False when the kernel refuses them. Its first call may come from inside
    ``inference_mode`` (generation) and must still be able to run autograd."""
    import areal.engine.attention as attention

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True):
        if not grouped_ok and k.shape[1] != q.shape[1]:
            raise RuntimeError("number of heads in key/value must equal query")
        return attention._packed_sdpa(q, k, v, cu_q, None)

    monkeypatch.setattr(attention, "_VARLEN_ATTN", stand_in)
    monkeypatch.setattr(attention, "_VARLEN_PARAMS", frozenset({"is_causal"}))
    attention._varlen_reads_grouped_kv.cache_clear()
    try:
        with torch.inference_mode():
            decided = attention._varlen_reads_grouped_kv(torch.device("cpu"), torch.float32)
        assert decided is grouped_ok
        # the packed path follows the decision: grouped heads reach the kernel only if True
        seen = []
        monkeypatch.setattr(
            attention, "_call_varlen", lambda q, k, *a: seen.append(k.shape[1]) or q.clone()
        )
        q, k, v = torch.randn(6, 4, 8), torch.randn(6, 2, 8), torch.randn(6, 2, 8)
        attention._packed_varlen(q, k, v, torch.tensor([0, 6]), 6, None)
        assert seen == [2 if grouped_ok else 4]
    finally:
        attention._varlen_reads_grouped_kv.cache_clear()


def test_grouped_kv_probe_inside_a_checkpointed_layer_leaves_recomputation_alone(monkeypatch):
    """The probe's first call comes from the first layer's forward, which activation
    checkpointing (non-reentrant) runs under saved-tensor hooks; the recomputation finds the
    answer cached. The probe's own tensors must not count among the layer's saved tensors,
    or backward fails ("A different number of tensors was saved"), as it did on a GPU for
    Qwen2-0.5B with gradient checkpointing."""
    import areal.engine.attention as attention

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=True):
        return attention._packed_sdpa(q, k, v, cu_q, None)

    monkeypatch.setattr(attention, "_VARLEN_ATTN", stand_in)
    monkeypatch.setattr(attention, "_VARLEN_PARAMS", frozenset({"is_causal"}))
    attention._varlen_reads_grouped_kv.cache_clear()

    def layer(x: torch.Tensor) -> torch.Tensor:
        attention._varlen_reads_grouped_kv(x.device, x.dtype)
        return (x.sin() * x).sum(-1)

    try:
        x = torch.randn(4, 8, requires_grad=True)
        out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
        out.sum().backward()
        torch.testing.assert_close(x.grad, x.detach().cos() * x.detach() + x.detach().sin())
    finally:
        attention._varlen_reads_grouped_kv.cache_clear()
