"""KDA under context parallelism on gloo: c2 and c4 against one rank on the whole stream.

Each rank count runs once, in spawned processes, through every case: the bare CP function
with heads that split over the ranks and heads that do not (the gather fallback), the
packed forward of transformers' KDA layer, and the whole tiny Ling 3 model (its MLA layers
through the varlen attention function's context-parallel path). Sequences are
not multiples of ``2c`` long and are padded at their ends; the reference runs the same
real tokens unpadded on one rank. Outputs (log-probs), losses and the gradients of every
input and parameter (summed over ranks) must agree to float32 precision.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areal.engine.context_parallel import CP_KWARG, padded_length, plan_shard
from areal.engine.kda_context_parallel import context_parallel_kda, conv_delta_rule

LENGTHS = [5, 13, 1, 40]  # none a multiple of 4 or 8; 40 spans two 32-token KDA chunks
MODEL_LENGTHS = [7, 21, 3]
RTOL = 1e-5  # of the largest magnitude of each compared tensor (at least 1)


# --- the packed stream: real tokens, with each sequence padded at its end ---


def _bounds(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)


def _padded_stream(lengths: list[int], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Padded bounds ``[n + 1]`` and the padded-stream index of every real token."""
    padded = [padded_length(n, size) for n in lengths]
    starts = _bounds(padded)[:-1].tolist()
    real = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)])
    return _bounds(padded), real


def _pad(
    real: torch.Tensor, index: torch.Tensor, n_tokens: int, fill: torch.Tensor
) -> torch.Tensor:
    """``real`` ``[T_real, ...]`` scattered to rows ``index`` of ``fill[:n_tokens]``."""
    return fill[:n_tokens].index_copy(0, index, real)


def _kda_inputs(heads: int, n_tokens: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    dk, dv, taps = 8, 6, 4

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g)

    return {
        "q": randn(n_tokens, heads, dk),
        "k": randn(n_tokens, heads, dk),
        "v": randn(n_tokens, heads, dv),
        "g": -torch.rand(n_tokens, heads, dk, generator=g),  # log decay in (-1, 0]
        "beta": torch.rand(n_tokens, heads, generator=g),
        "out_weight": randn(n_tokens, heads, dv),  # loss = sum(out * out_weight)
        "wq": randn(heads * dk, 1, taps) * 0.5,
        "wk": randn(heads * dk, 1, taps) * 0.5,
        "wv": randn(heads * dv, 1, taps) * 0.5,
    }


TOKEN_INPUTS = ("q", "k", "v", "g", "beta")


def _kda_case(heads: int, size: int, rank: int) -> dict[str, torch.Tensor]:
    """Outputs and gradients of the CP function on this rank (size 1: the reference)."""
    real_tokens = sum(LENGTHS)
    real = _kda_inputs(heads, real_tokens, seed=heads)
    weights = [real[w].clone().requires_grad_() for w in ("wq", "wk", "wv")]
    if size == 1:
        tokens = {name: real[name].clone().requires_grad_() for name in TOKEN_INPUTS}
        q, k, v, g, beta = tokens.values()
        out = conv_delta_rule(q, k, v, weights, g, beta, _bounds(LENGTHS))
        (out * real["out_weight"]).sum().backward()
    else:
        cu, index = _padded_stream(LENGTHS, size)
        n_tokens = int(cu[-1])
        filler = _kda_inputs(heads, n_tokens, seed=100 + heads)  # padding rows' inputs
        filler["out_weight"] = torch.zeros_like(filler["out_weight"])  # padding: no loss
        shard = plan_shard(cu, size, rank)
        tokens = {
            name: shard.shard(_pad(real[name], index, n_tokens, filler[name])).requires_grad_()
            for name in TOKEN_INPUTS
        }
        q, k, v, g, beta = tokens.values()
        out = context_parallel_kda(q, k, v, weights, g, beta, shard)
        out_weight = _pad(real["out_weight"], index, n_tokens, filler["out_weight"])
        (out * shard.shard(out_weight)).sum().backward()
    result = {"out": out.detach()}
    result |= {f"grad_{n}": t.grad for n, t in tokens.items()}
    result |= {f"grad_w{i}": w.grad for i, w in enumerate(weights)}
    return result


# --- transformers' KDA layer and the whole tiny model ---


def _load_model(model_dir: str):
    from transformers import AutoModelForCausalLM

    from areal.engine.attention import register_varlen_attention
    from areal.models.bailing_packed import enable_packed_sequences

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, attn_implementation=register_varlen_attention()
    )
    enable_packed_sequences(model)
    return model.float().eval()


def _kda_layer(model_dir: str, heads: int) -> torch.nn.Module:
    """A packed KDA layer of the tiny model's shape with ``heads`` heads, seeded weights."""
    from transformers import AutoConfig
    from transformers.models.bailing_hybrid import modeling_bailing_hybrid

    from areal.models.bailing_packed import enable_packed_sequences

    config = AutoConfig.from_pretrained(model_dir)
    config.linear_num_heads = heads
    layer = modeling_bailing_hybrid.BailingHybridDeltaAttention(config, layer_idx=0)
    g = torch.Generator().manual_seed(heads)
    with torch.no_grad():
        for param in layer.parameters():
            param.copy_(torch.randn(param.shape, generator=g) * 0.2)
        layer.forget_gate.A_log.copy_(torch.rand(heads, generator=g) * 2)  # A in [1, e^2]
        layer.o_norm.weight.add_(1.0)
    enable_packed_sequences(layer)
    return layer.float()


def _layer_case(model_dir: str, heads: int, size: int, rank: int) -> dict[str, torch.Tensor]:
    from areal.engine.attention import packed_forward_kwargs

    layer = _kda_layer(model_dir, heads)
    g = torch.Generator().manual_seed(7)
    width = layer.hidden_size
    real = torch.randn(sum(LENGTHS), width, generator=g)
    out_weight = torch.randn(sum(LENGTHS), width, generator=g)
    if size == 1:
        x = real.clone().requires_grad_()
        out = layer(x[None], **packed_forward_kwargs(_bounds(LENGTHS), max(LENGTHS)))[0]
        (out * out_weight).sum().backward()
    else:
        cu, index = _padded_stream(LENGTHS, size)
        n_tokens = int(cu[-1])
        shard = plan_shard(cu, size, rank)
        filler = torch.randn(n_tokens, width, generator=g)
        x = shard.shard(_pad(real, index, n_tokens, filler)).requires_grad_()
        out = layer(x[None], **{CP_KWARG: shard})[0]
        weight = _pad(out_weight, index, n_tokens, torch.zeros(n_tokens, width))
        (out * shard.shard(weight)).sum().backward()
    result = {"out": out.detach(), "grad_x": x.grad}
    result |= {f"param_{n}": p.grad for n, p in layer.named_parameters()}
    return result


def _model_case(model_dir: str, size: int, rank: int) -> dict[str, Any]:
    from areal.engine.attention import packed_forward_kwargs

    model = _load_model(model_dir)
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randint(3, 1000, (n,), generator=g) for n in MODEL_LENGTHS]
    labels = torch.cat([torch.cat([s[1:], torch.tensor([-1])]) for s in seqs])  # -1: none
    if size == 1:
        ids = torch.cat(seqs)
        positions = torch.cat([torch.arange(n) for n in MODEL_LENGTHS])
        kwargs = packed_forward_kwargs(_bounds(MODEL_LENGTHS), max(MODEL_LENGTHS))
    else:
        cu, index = _padded_stream(MODEL_LENGTHS, size)
        n_tokens = int(cu[-1])
        shard = plan_shard(cu, size, rank)
        ids = shard.shard(_pad(torch.cat(seqs), index, n_tokens, torch.zeros(n_tokens).long()))
        labels = shard.shard(_pad(labels, index, n_tokens, torch.full((n_tokens,), -1)))
        positions = shard.positions
        chunks = shard.local_cu_seqlens
        kwargs = packed_forward_kwargs(chunks, int((chunks[1:] - chunks[:-1]).max()), shard)
    logits = model(input_ids=ids[None], position_ids=positions[None], **kwargs).logits[0]
    logprobs = torch.log_softmax(logits.float(), -1)
    target = labels.clamp(min=0)
    token_logprobs = logprobs.gather(-1, target[:, None])[:, 0] * (labels >= 0)
    loss = -token_logprobs.sum() / sum(n - 1 for n in MODEL_LENGTHS)  # this rank's share
    loss.backward()
    result = {"logprobs": token_logprobs.detach(), "loss": loss.detach()}
    result |= {f"param_{n}": p.grad for n, p in model.named_parameters() if p.grad is not None}
    return result


# --- running every case on one or more ranks ---


def _all_cases(model_dir: str, size: int, rank: int) -> dict[str, dict[str, Any]]:
    cases = {f"kda_h{h}": _kda_case(h, size, rank) for h in (4, 3)}
    cases |= {f"layer_h{h}": _layer_case(model_dir, h, size, rank) for h in (4, 3)}
    cases["model"] = _model_case(model_dir, size, rank)
    return cases


def _worker(rank: int, size: int, model_dir: str, out_dir: str) -> None:
    torch.set_num_threads(1)  # up to four ranks share the test machine's cores
    dist.init_process_group(
        "gloo", init_method=f"file://{out_dir}/store", rank=rank, world_size=size
    )
    try:
        torch.save(_all_cases(model_dir, size, rank), f"{out_dir}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _global_rows(per_rank: list[torch.Tensor], lengths: list[int], size: int) -> torch.Tensor:
    """Every rank's local rows -> the real tokens' rows, in global order."""
    cu, index = _padded_stream(lengths, size)
    shard = plan_shard(cu, size, 0)
    return shard.unshard(torch.cat(per_rank)).index_select(0, index)


@pytest.fixture(scope="module")
def reference(bailing_model_dir):
    return _all_cases(str(bailing_model_dir), 1, 0)


def _relative_diff(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Largest absolute difference over the largest magnitude of the expected tensor."""
    return float((got - expected).abs().max() / expected.abs().max().clamp(min=1.0))


@pytest.mark.parametrize("size", [2, 4])
def test_context_parallel_kda_equals_one_rank(size, reference, bailing_model_dir, tmp_path):
    mp.spawn(_worker, args=(size, str(bailing_model_dir), str(tmp_path)), nprocs=size)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(size)]
    diffs = {}
    for case, expected in reference.items():
        lengths = MODEL_LENGTHS if case == "model" else LENGTHS
        for name, want in expected.items():
            # an expert that none of a rank's tokens chose has no gradient there
            parts = [r[case].get(name, torch.zeros_like(want)) for r in ranks]
            if name.startswith(("param_", "grad_w")) or name == "loss":
                got = torch.stack(parts).sum(0)  # partial per rank: summed over the CP group
            else:
                got = _global_rows(parts, lengths, size)
            assert got.shape == want.shape, (case, name)
            diffs[f"{case}.{name}"] = _relative_diff(got, want)
    for case in reference:
        name = max((k for k in diffs if k.startswith(f"{case}.")), key=diffs.get)
        print(f"c{size} {case}: worst {name} {diffs[name]:.1e}")
    assert all(d < RTOL for d in diffs.values()), {k: v for k, v in diffs.items() if v >= RTOL}
