"""Context-parallel primitives (``areal.engine.context_parallel``) and the attention path.

Hand-checked layouts first (one process), then c = 2 and c = 4 gloo ranks: the gathered
tokens and their gradients, and causal attention of each rank's share over gathered keys
against the packed attention of the whole stream, forward and backward, with grouped
key/value heads and MLA-like values narrower than the keys.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from areal.engine.attention import (
    packed_causal_attention,
    packed_forward_kwargs,
    varlen_attention_forward,
)
from areal.engine.context_parallel import (
    CP_KWARG,
    gather_tokens,
    padded_length,
    plan_shard,
)
from areal.engine.logprobs import next_token_labels
from areal.engine.train_common import context_parallel_stream
from areal.utils.network import find_free_port

# --- layouts, one process ---


def test_padded_length_rounds_up_to_2c():
    assert [padded_length(n, 2) for n in (0, 1, 4, 5, 11)] == [0, 4, 4, 8, 12]
    assert [padded_length(n, 4) for n in (1, 8, 9)] == [8, 8, 16]


def test_zigzag_share_of_two_sequences():
    # c = 2: sequences of 8 and 4 tokens cut into 4 chunks each (2 and 1 tokens); rank 0
    # holds chunks 0 and 3, rank 1 chunks 1 and 2.
    cu = torch.tensor([0, 8, 12])
    zero, one = (plan_shard(cu, 2, r) for r in (0, 1))
    assert zero.local_index.tolist() == [0, 1, 6, 7, 8, 11]
    assert one.local_index.tolist() == [2, 3, 4, 5, 9, 10]
    assert zero.positions.tolist() == [0, 1, 6, 7, 0, 3]
    assert one.positions.tolist() == [2, 3, 4, 5, 1, 2]
    assert zero.local_cu_seqlens.tolist() == [0, 2, 4, 5, 6]
    x = torch.arange(12) * 10
    gathered = torch.cat([zero.shard(x), one.shard(x)])  # what an all-gather returns
    assert torch.equal(zero.unshard(gathered), x)


def test_a_micro_batch_stream_is_padded_per_sequence_and_maps_back():
    # A stream of rows 3 and 5 tokens plus a 2-token padding tail; c = 2 pads the rows to 4
    # and 8 (CP stream of 12, the tail dropped); rank 0 holds chunks 0 and 3 of each.
    ids = torch.tensor([11, 12, 13, 21, 22, 23, 24, 25, 0, 0])
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    labels = next_token_labels(ids, cu)  # [12, 13, 0, 22, 23, 24, 25, 0, 0, 0]
    stream = context_parallel_stream(ids, cu, 2, labels, size=2, rank=0, group=None)
    # CP stream: [11 12 13 0 | 21 22 23 24 25 0 0 0]; rank 0: chunks [0:1] [3:4] [4:6] [10:12]
    assert stream.input_ids.tolist() == [[11, 0, 21, 22, 0, 0]]
    assert stream.position_ids.tolist() == [[0, 3, 0, 1, 6, 7]]
    assert stream.labels.tolist() == [12, 0, 22, 23, 0, 0]
    assert stream.stream_index.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 12, 12]
    cp_values = torch.arange(12.0) + 1
    assert stream.to_stream(cp_values).tolist() == [1, 2, 3, 5, 6, 7, 8, 9, 0, 0]


def test_packed_forward_kwargs_carry_the_shard_only_when_given():
    cu = torch.tensor([0, 4])
    assert CP_KWARG not in packed_forward_kwargs(cu, 4)
    shard = plan_shard(cu, 1, 0)
    assert packed_forward_kwargs(cu, 4, shard)[CP_KWARG] is shard


# --- c ranks over gloo ---

# real lengths; each is padded to a multiple of 2c, most of them change
LENGTHS = (7, 1, 12, 5, 3)


def _padded_stream(size: int) -> torch.Tensor:
    lengths = [padded_length(n, size) for n in LENGTHS]
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])


def _inputs(n_tokens: int, heads: tuple[int, int], dims: tuple[int, int]):
    g = torch.Generator().manual_seed(5)
    (hq, hkv), (d, dv) = heads, dims
    q = torch.randn(n_tokens, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(n_tokens, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(n_tokens, hkv, dv, generator=g, dtype=torch.float64)
    upstream = torch.randn(n_tokens, hq, dv, generator=g, dtype=torch.float64)
    return q, k, v, upstream


def _attention_diffs(size: int, rank: int, heads, dims, via_hf: bool) -> list[float]:
    """Max |difference| of output, dq, dk, dv between the share and the whole stream."""
    cu = _padded_stream(size)
    q, k, v, upstream = _inputs(int(cu[-1]), heads, dims)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    expected = packed_causal_attention(*leaves, cu, int((cu[1:] - cu[:-1]).max()), scale=0.3)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), leaves)

    shard = plan_shard(cu, size, rank, group=dist.group.WORLD)
    local = [shard.shard(x).detach().requires_grad_() for x in (q, k, v)]
    if via_hf:  # as transformers calls it: [1, H, S, D] in, [1, S, H, D] out
        kwargs = packed_forward_kwargs(shard.local_cu_seqlens, shard.max_seqlen, shard)
        del kwargs["use_cache"]
        bhsd = [x.transpose(0, 1).unsqueeze(0) for x in local]
        out = varlen_attention_forward(None, *bhsd, None, scaling=0.3, **kwargs)[0][0]
    else:
        from areal.engine.context_parallel import context_parallel_attention

        out = context_parallel_attention(*local, shard, scale=0.3)
    grads = torch.autograd.grad((out * shard.shard(upstream)).sum(), local)
    # every rank's output and gradients, back in global order
    got = [gather_tokens(x.detach(), shard) for x in (out, *grads)]
    return [float((a - b).abs().max()) for a, b in zip(got, [expected, *expected_grads])]


def _gather_diffs(size: int, rank: int) -> list[float]:
    """gather_tokens returns the global tensor; its gradient is the sum over ranks."""
    cu = _padded_stream(size)
    n = int(cu[-1])
    x = torch.arange(n * 3, dtype=torch.float64).reshape(n, 3)
    shard = plan_shard(cu, size, rank, group=dist.group.WORLD)
    local = shard.shard(x).requires_grad_()
    full = gather_tokens(local, shard)
    weights = torch.arange(n, dtype=torch.float64)[:, None] + 1  # the same on every rank
    (grad,) = torch.autograd.grad((full * weights).sum(), local)
    # each of the `size` ranks' losses reads every token once: the gradient is size x weight
    return [float((full - x).abs().max()), float((grad - size * shard.shard(weights)).abs().max())]


def _rank(rank: int, size: int, port: int, results) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size
    )
    try:
        out = {"gather": _gather_diffs(size, rank)}
        cases = {
            "mha": ((4, 4), (8, 8), False),
            "gqa": ((4, 2), (8, 8), False),
            "mla": ((4, 4), (12, 8), False),  # values narrower than queries and keys
            "hf": ((4, 2), (8, 8), True),
        }
        for name, (heads, dims, via_hf) in cases.items():
            out[name] = _attention_diffs(size, rank, heads, dims, via_hf)
        results[rank] = out
    finally:
        dist.destroy_process_group()


def _run_ranks(size: int) -> dict:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        port = find_free_port("127.0.0.1")
        procs = [ctx.Process(target=_rank, args=(r, size, port, results)) for r in range(size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=300)
        assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
        return dict(results)


def test_two_and_four_ranks_equal_the_whole_stream():
    # float64 throughout: the share differs from the whole stream only by summation order
    for size in (2, 4):
        results = _run_ranks(size)
        for rank, diffs in results.items():
            for case, values in diffs.items():
                assert max(values) < 1e-12, (size, rank, case, values)
