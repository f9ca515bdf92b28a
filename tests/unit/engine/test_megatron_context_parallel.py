"""Context parallelism (``c``) in the Megatron engine, on CPU over gloo, against ``c1``.

Each rank holds a zigzag share of every packed sequence (:mod:`areal.engine.context_parallel`);
attention gathers keys and values, KDA swaps tokens for heads, rotary embeddings take global
positions, and the shares' log-probs are gathered back so the loss function sees c1's
micro-batch: the same loss, gradient, entropy and counts. The multi-rank runs are
:mod:`tests.unit.engine.megatron_context_parallel_worker` processes, compared with the same
worker on one rank.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.unit.engine import megatron_cpu_shim

available, reason = megatron_cpu_shim.megatron_available()
pytestmark = pytest.mark.skipif(not available, reason=reason)

# the same float32 maths in another order (attention over gathered keys, partial gradients
# summed over ranks): log-probs within a few ulps of 7, the step within float32 rounding
LOGP_ATOL = 1e-5
STEP_RTOL = 1e-5
UPDATE_ATOL = 1e-6


# --- one rank's share of a micro-batch (no process group needed) ---


def test_sequence_parallel_pads_the_stream_so_each_share_splits_over_tp_ranks():
    from areal.engine.logprobs import next_token_labels
    from areal.engine.train_common import context_parallel_stream

    # rows of 3 and 5 tokens and a 2-token padding tail (ids 1..8, then 0 0). c2 pads the
    # rows to 4 and 8: 12 tokens, a share of 6. t2 splits 6 evenly: nothing added. t4
    # needs a share that is a multiple of 4, so a stream that is a multiple of 8: a 4-token
    # padding segment makes it 16. Padded stream (0 = CP padding):
    #   [1 2 3 0 | 4 5 6 7 8 0 0 0 | 0 0 0 0]
    # rank 1 holds chunks 1 and 2 of each: [2 | 3] [6 7 | 8 0] [0 | 0]
    ids = torch.tensor([1, 2, 3, 4, 5, 6, 7, 8, 0, 0])
    cu = torch.tensor([0, 3, 8, 10], dtype=torch.int32)
    labels = next_token_labels(ids, cu)  # [2, 3, 0, 5, 6, 7, 8, 0, 0, 0]

    def stream(multiple: int):
        return context_parallel_stream(ids, cu, 2, labels, 2, 1, None, multiple=multiple)

    assert stream(2).shard.cu_seqlens.tolist() == [0, 4, 12]
    t4 = stream(4)
    assert t4.shard.cu_seqlens.tolist() == [0, 4, 12, 16]
    assert t4.input_ids.tolist() == [[2, 3, 6, 7, 8, 0, 0, 0]]
    assert t4.labels.tolist() == [3, 0, 7, 8, 0, 0, 0, 0]
    assert t4.position_ids.tolist() == [[1, 2, 2, 3, 4, 5, 1, 2]]
    # the micro-batch's tokens in the CP stream; its padding tail points one past the end
    assert t4.stream_index.tolist() == [0, 1, 2, 4, 5, 6, 7, 8, 16, 16]


def test_rotary_positions_on_the_device_match_the_plan():
    from areal.engine.context_parallel import plan_shard
    from areal.engine.megatron_compat import _zigzag_positions

    cu = torch.tensor([0, 8, 12, 36, 36, 44], dtype=torch.int32)  # an empty segment too
    for rank in range(2):
        shard = plan_shard(cu, 2, rank)
        found = _zigzag_positions(shard.n_local, cu, 2, rank, "cpu")
        assert torch.equal(found, shard.positions), rank


class _CPGroup:
    """What Megatron's THD rotary embedding asks of a context-parallel group."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


@pytest.mark.parametrize("size", [2, 4])
def test_packed_rope_of_a_share_equals_megatrons_context_parallel_rope(size):
    """The engine's sync-free rotary embedding of a rank's share gives Megatron's own
    THD context-parallel rotary embedding, for GQA and MLA layouts."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    from areal.engine.megatron_compat import _packed_rope

    g = torch.Generator().manual_seed(0)
    lengths = [8 * size, 2 * size, 6 * size]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    freqs = torch.randn(max(lengths), 1, 1, 8, generator=g)
    for mla in (False, True):
        for rank in range(size):
            t = torch.randn(sum(lengths) // size, 2, 8, generator=g)
            megatron = _apply_rotary_pos_emb_thd(t, cu, freqs, multi_latent_attention=mla,
                                                 cp_group=_CPGroup(size, rank))  # fmt: skip
            ours = _packed_rope(t, freqs, cu, False, mla, context_share=(size, rank))
            torch.testing.assert_close(ours, megatron, rtol=0, atol=0)


# --- c2 against c1, over gloo ---


def run_ranks(model_dir, out, backend: str, world: int, batch: str = "fixed",
              mb_tokens: int = 32) -> dict:  # fmt: skip
    """:mod:`tests.unit.engine.megatron_context_parallel_worker` on ``world`` gloo ranks."""
    from tests.unit.engine.test_fsdp_engine import REPO, find_free_port

    port = find_free_port("127.0.0.1")
    procs = []
    for rank in range(world):
        env = {
            **os.environ,
            "RANK": str(rank),
            "WORLD_SIZE": str(world),
            "LOCAL_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
        }
        argv = [sys.executable, "-m", "tests.unit.engine.megatron_context_parallel_worker",
                "--model", str(model_dir), "--out", str(out), "--backend", backend,
                "--batch", batch, "--mb-tokens", str(mb_tokens)]  # fmt: skip
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env))
    try:
        for proc in procs:
            assert proc.wait(timeout=900) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return torch.load(out, weights_only=False)


# name -> (model fixture, backend, ranks, batch, micro-batch tokens); each is compared with
# the same model and batch at c1. "fixed": rows of 6..20 tokens, none a multiple of 2c, in
# 32-token micro-batches; "mixed": rows of 1..70 tokens packed into one micro-batch
LAYOUTS = {
    "qwen-c2": ("tiny_model_dir", "megatron:d1p1t1c2", 2, "fixed", 32),
    "qwen-c2-mixed": ("tiny_model_dir", "megatron:d1p1t1c2", 2, "mixed", 256),
    "qwen-t2c2": ("tiny_model_dir", "megatron:d1p1t2c2", 4, "fixed", 32),
    "ling3-c2": ("bailing_model_dir", "megatron:d1p1t1c2", 2, "fixed", 32),
    # sequence-parallel (Ling 3 at t > 1): each CP share is split again over the TP ranks
    "ling3-t2c2": ("bailing_model_dir", "megatron:d1p1t2c2", 4, "fixed", 32),
    "ling3-hybrid-c2e2": (
        "bailing_model_dir",
        "megatron:(attn:d1p1t1c2|ffn:d1p1t1e2)",
        2,
        "fixed",
        32,
    ),
}


@pytest.fixture(scope="module")
def runs(request, tmp_path_factory):
    out = tmp_path_factory.mktemp("context-parallel")
    cache: dict = {}

    def get(name: str) -> tuple[dict, dict]:
        fixture, backend, world, batch, mb_tokens = LAYOUTS[name]
        model_dir = request.getfixturevalue(fixture)
        one_key = (fixture, batch, mb_tokens)
        if one_key not in cache:
            cache[one_key] = run_ranks(model_dir, out / f"{fixture}-{batch}-c1.pt",
                                       "megatron:d1p1t1c1", 1, batch, mb_tokens)  # fmt: skip
        if name not in cache:
            cache[name] = run_ranks(model_dir, out / f"{name}.pt", backend, world, batch, mb_tokens)
        return cache[name], cache[one_key]

    return get


def _entropy(run: dict) -> float:
    return run["exported"]["entropy/avg"]


# counts recorded per batch (n_seqs, on every rank) and by the loss function (whole sequences)
COUNTS = ("n_seqs", "n_loss_tokens", "n_loss_seqs")


@pytest.mark.slow
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_step_equals_the_one_rank_step(runs, name):
    """Log-probs of whole sequences in order, the loss, the entropy and the counts and
    per-sequence sums the loss function records, the gradient norm and the SGD update
    (minus the gradient) all match c1."""
    run, one = runs(name)
    logp_diff = float((run["logp"] - one["logp"]).abs().max())
    worst = 0.0
    for key, after in one["after"].items():
        update = after - one["before"][key]
        theirs = run["after"][key] - run["before"][key]
        worst = max(worst, float((theirs - update).abs().max()))
    print(f"{name} ({run['parallel']}): max |logp diff| {logp_diff:.2e}, grad norm "
          f"{run['stats']['grad_norm']:.6f} vs {one['stats']['grad_norm']:.6f}, "
          f"max |update diff| {worst:.2e}")  # fmt: skip
    assert logp_diff < LOGP_ATOL
    assert run["stats"]["update_successful"] == 1.0
    assert run["stats"]["loss"] == pytest.approx(one["stats"]["loss"], rel=STEP_RTOL)
    assert run["stats"]["grad_norm"] == pytest.approx(one["stats"]["grad_norm"], rel=STEP_RTOL)
    assert _entropy(run) == pytest.approx(_entropy(one), rel=STEP_RTOL)
    assert {k: run["exported"][k] for k in COUNTS} == {k: one["exported"][k] for k in COUNTS}
    assert run["exported"]["seq_nll/avg"] == pytest.approx(one["exported"]["seq_nll/avg"],
                                                           rel=STEP_RTOL)  # fmt: skip
    assert worst < UPDATE_ATOL
