"""Colocated in-place (``awex``) weight updates on one GPU, through the toy GRPO example.

The actor (``fsdp:d1``) and the embedded server forked beside it share one GPU; after each
of two PPO steps the actor shares its weights as CUDA IPC handles, the server copies them
in through ``/update_weights_from_tensor``, and ``actor.weight_sync_check`` compares the
server's greedy log-probs with the actor's. float32 on the GPU agrees to about 1e-5 (the
same kernels on both sides); bfloat16 to the bf16 tolerance of the other GPU tests.
"""

from __future__ import annotations

import pytest
import torch

from tests.integration.test_trainer_e2e import _run, _stats, _trial_dir

pytestmark = pytest.mark.gpu

ON_ONE_GPU = (
    "cluster.n_gpus_per_node=1",
    "actor.scheduling_spec.0.gpu=1",
    "total_train_steps=2",
    "actor.weight_update_mode=awex",
    "actor.weight_sync_check=true",
    "rollout.scheduling_strategy.type=colocation",
    "rollout.scheduling_strategy.target=actor",
    "rollout.scheduling_strategy.fork=true",
)


@pytest.mark.parametrize(("dtype", "tolerance"), [("float32", 1e-3), ("bfloat16", 0.1)])
def test_colocated_awex_on_one_gpu_keeps_the_server_equal_to_the_actor(tmp_path, dtype, tolerance):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    trial = f"awex-gpu-{dtype}"
    _run(
        tmp_path,
        trial,
        *ON_ONE_GPU,
        f"actor.dtype={dtype}",
        f"sglang.dtype={dtype}",
        f"actor.weight_sync_check_tolerance={tolerance}",
        timeout=600,
    )
    stats = _stats(tmp_path, trial)
    assert [s["train/weight_version"] for s in stats] == [1.0, 2.0]
    diffs = [s["weight_sync/server0_max_abs_logp_diff"] for s in stats]
    print(f"awex on {torch.cuda.get_device_name()} {dtype}: max |logp diff| per step {diffs}")
    assert all(d <= tolerance for d in diffs), diffs
    rollout_log = (_trial_dir(tmp_path, trial) / "rollout.log").read_text()
    assert rollout_log.count("handed over by handle for 1 TP rank(s)") == 2
    assert "(cuda)" in rollout_log  # the server ran on the GPU
