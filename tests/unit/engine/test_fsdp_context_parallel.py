"""FSDPEngine with context parallelism (``fsdp:dXcY``) on CPU gloo ranks, and its refusals.

Each run trains one SGD step at lr 1 (so the update is the gradient) on a batch that mixes
short and long rows, most of them not a multiple of 2c tokens, packed into several
micro-batches (tests.unit.engine.fsdp_cp_worker). c = 2 and c = 4, and d2 c2, must give
c = 1's log-probs, loss, gradient norm, tracked entropy and update to float32 rounding.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from areal.utils.network import find_free_port
from tests.unit.api.test_support import refused

REPO = Path(__file__).resolve().parents[3]


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    return {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(rank),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "PYTHONPATH": str(REPO),
    }


def run_ranks(model: Path, out: Path, backend: str, world: int, mb_tokens: int = 64) -> dict:
    port = find_free_port("127.0.0.1")
    procs = []
    for rank in range(world):
        env = rank_env(rank, world, port)
        argv = [sys.executable, "-m", "tests.unit.engine.fsdp_cp_worker", "--model", str(model),
                "--out", str(out), "--backend", backend, "--mb-tokens", str(mb_tokens)]  # fmt: skip
        procs.append(subprocess.Popen(argv, cwd=REPO, env=env))
    codes = [proc.wait(timeout=600) for proc in procs]
    assert codes == [0] * world, codes
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir, tmp_path_factory) -> dict:
    return run_ranks(tiny_model_dir, tmp_path_factory.mktemp("c1") / "c1.pt", "fsdp:d1", 1)


def assert_same_step(got: dict, expected: dict, may_stay: tuple[str, ...] = ()) -> None:
    """``may_stay``: name parts of parameters whose c1 update may round to nothing."""
    # c > 1 reorders float32 sums (attention over gathered keys, the gradient reduce-scatter):
    # seen at most 1e-6 on log-probs and 6e-8 on the update, whose entries are 1e-3 and up
    torch.testing.assert_close(got["logp"], expected["logp"], rtol=0, atol=1e-5)
    assert got["stats"]["loss"] == pytest.approx(expected["stats"]["loss"], rel=1e-6)
    assert got["stats"]["grad_norm"] == pytest.approx(expected["stats"]["grad_norm"], rel=1e-5)
    # every trained token counted once over the group, with c = 1's mean entropy
    assert got["tracked"]["n_trained"] == expected["tracked"]["n_trained"]
    assert got["tracked"]["entropy/avg"] == pytest.approx(expected["tracked"]["entropy/avg"])
    for name, after in expected["state"].items():
        update = after - expected["before"][name]
        assert update.any() or any(part in name for part in may_stay), name  # the step moved it
        got_update = got["state"][name] - got["before"][name]
        torch.testing.assert_close(got_update, update, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize(("backend", "world"), [("fsdp:d1c2", 2), ("fsdp:d1c4", 4)])
def test_context_parallel_ranks_step_like_one_rank(
    tiny_model_dir, tmp_path, one_rank, backend, world
):
    assert_same_step(run_ranks(tiny_model_dir, tmp_path / "cp.pt", backend, world), one_rank)


def test_data_and_context_parallel_ranks_step_like_one_rank(tiny_model_dir, tmp_path, one_rank):
    """d2 c2: two groups of two ranks, each group on half the rows."""
    got = run_ranks(tiny_model_dir, tmp_path / "d2c2.pt", "fsdp:d2c2", 4)
    assert_same_step(got, one_rank)


def test_a_world_size_that_c_does_not_divide_is_refused(tiny_model_dir, tmp_path):
    """Three ranks launched for c2: the engine names the field and the fix."""
    port = find_free_port("127.0.0.1")
    code = (
        "from areal.api.cli_args import TrainEngineConfig\n"
        "from areal.engine.fsdp_engine import FSDPEngine\n"
        "e = FSDPEngine(TrainEngineConfig(experiment_name='t', trial_name='t', "
        f"path={str(tiny_model_dir)!r}, backend='fsdp:d1c2'))\n"
        "try:\n"
        "    e.create_process_group()\n"
        "except ValueError as err:\n"
        "    print('REFUSED', err)\n"
    )
    argv = [sys.executable, "-c", code]
    procs = [
        subprocess.Popen(argv, env=rank_env(rank, 3, port), stdout=subprocess.PIPE, text=True)
        for rank in range(3)
    ]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    for out in outputs:
        assert "REFUSED actor.backend: context parallelism c2 does not divide the 3 ranks" in out


# --- refused at config load ---


def test_fsdp_context_parallelism_is_accepted():
    assert refused({"actor.backend": "fsdp:d1c2"}) == []
    assert refused({"actor.backend": "fsdp:d2c4", "actor.mb_spec.max_tokens_per_mb": 8}) == []


def test_a_token_budget_below_2c_is_refused():
    [(field, message)] = refused(
        {"actor.backend": "fsdp:d1c4", "actor.mb_spec.max_tokens_per_mb": 7}
    )
    assert field == "actor.mb_spec.max_tokens_per_mb"
    assert "padded to a multiple of 2c = 8 tokens" in message
    assert "set actor.mb_spec.max_tokens_per_mb to at least 8" in message


def test_a_context_parallel_group_straddling_nodes_is_refused():
    [(field, message)] = refused({"actor.backend": "fsdp:d2c3", "cluster.n_gpus_per_node": 8})
    assert field == "actor.backend"
    assert "c3 in 'fsdp:d2c3' does not fit cluster.n_gpus_per_node 8" in message
    assert refused({"actor.backend": "fsdp:d1c16", "cluster.n_gpus_per_node": 8}) == []


@pytest.mark.parametrize(
    ("hf_config", "kind"),
    [
        ({"sliding_window": 64, "use_sliding_window": True}, "sliding-window layers"),
        ({"sliding_window": 64}, "sliding-window layers"),  # Mistral: no switch, always on
        ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window layers"),
        ({"attn_logit_softcapping": 50.0}, "attention logit soft-capping"),
    ],
)
def test_attention_the_context_parallel_path_does_not_compute_is_refused(tmp_path, hf_config, kind):
    (tmp_path / "config.json").write_text(json.dumps(hf_config))
    [(field, message)] = refused({"actor.backend": "fsdp:d1c2", "actor.path": str(tmp_path)})
    assert field == "actor.backend"
    assert "covers full causal attention, but the model at actor.path" in message
    assert kind in message and "use 'fsdp:d2' (no c)" in message


def test_a_switched_off_sliding_window_is_full_attention(tmp_path):
    # Qwen2/Qwen3 configs carry a window size with use_sliding_window: false
    (tmp_path / "config.json").write_text(
        json.dumps({"sliding_window": 4096, "use_sliding_window": False})
    )
    assert refused({"actor.backend": "fsdp:d1c2", "actor.path": str(tmp_path)}) == []


def test_ling3_context_parallel_ranks_step_like_one_rank(bailing_model_dir, tmp_path):
    """The tiny BailingMoeV3 (KDA + MLA + MoE): KDA layers swap token for head sharding,
    MLA layers gather keys and values; c2 steps like one rank. (The first KDA layer's decay
    parameters get gradients near 1e-9 through a saturated gate, their update rounds away;
    the router's expert bias only selects experts and gets no gradient.)"""
    expected = run_ranks(bailing_model_dir, tmp_path / "c1.pt", "fsdp:d1", 1)
    got = run_ranks(bailing_model_dir, tmp_path / "c2.pt", "fsdp:d1c2", 2)
    assert_same_step(got, expected, may_stay=("A_log", "dt_bias", "e_score_correction_bias"))
