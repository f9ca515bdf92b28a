"""The toy GRPO example trains a tiny BailingMoeV3 (Ling 3) checkpoint, changing only
``actor.path``: two steps, and after each weight update every inference server's
log-probs equal the actor's (``actor.weight_sync_check`` with a tolerance, so a mismatch
fails the run).

The checkpoint is the ``bailing_model_dir`` fixture: ``BailingMoeV3ForCausalLM`` in
config.json, official weight names on disk, the Ling 3 tokenizer. Megatron runs on CPU
through the test worker (``tests.unit.engine.megatron_cpu_worker``), as the Flash V3 mini
test runs it.
"""

from __future__ import annotations

import sys

import pytest

from tests.integration.test_trainer_e2e import _run, _stats

pytestmark = pytest.mark.slow

MEGATRON_CPU = (
    "actor.dtype=float32",
    "actor.megatron.ddp.use_distributed_optimizer=false",
    f"actor.scheduling_spec.0.cmd={sys.executable} -m tests.unit.engine.megatron_cpu_worker",
)


def train_two_steps(tmp_path, model_dir, backend: str, *overrides: str) -> list[dict]:
    trial = backend.replace(":", "-")
    _run(
        tmp_path,
        trial,
        f"actor.path={model_dir}",
        f"actor.backend={backend}",
        "total_train_steps=2",
        "actor.weight_sync_check=true",
        "actor.weight_sync_check_tolerance=1e-4",
        *overrides,
        timeout=900,
    )
    return _stats(tmp_path, trial)


def check_synced(stats: list[dict]) -> None:
    assert [s["global_step"] for s in stats] == [0, 1]
    assert [s["train/weight_version"] for s in stats] == [1.0, 2.0]
    for step in stats:
        servers = [k for k in step if k.startswith("weight_sync/server")]
        assert servers, step
        assert all(step[k] <= 1e-4 for k in servers), {k: step[k] for k in servers}
        assert "rollout/reward_mean" in step


@pytest.mark.parametrize("mode", ["xccl", "disk"])
def test_fsdp_trains_the_tiny_bailing_model(tmp_path, bailing_model_dir, mode):
    stats = train_two_steps(
        tmp_path, bailing_model_dir, "fsdp:d1", f"actor.weight_update_mode={mode}"
    )
    check_synced(stats)


@pytest.mark.parametrize("backend", ["megatron:d1p1t1", "megatron:d1p1t2"])
def test_megatron_trains_the_tiny_bailing_model(tmp_path, bailing_model_dir, backend):
    """t2 runs sequence-parallel (Megatron's MoE under tensor parallelism needs it)."""
    stats = train_two_steps(tmp_path, bailing_model_dir, backend, *MEGATRON_CPU)
    check_synced(stats)
