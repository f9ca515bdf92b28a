"""The toy GRPO example with colocated rollout and in-place (``awex``) weight updates.

The rollout worker is forked beside the actor's first worker (``rollout.scheduling_strategy``
colocation, fork); after each PPO step every actor rank shares its full weights by handle
(CPU shared memory here, CUDA IPC on GPUs) and the server copies them in through SGLang's
``/update_weights_from_tensor`` contract, inside a ``/begin_weight_update`` ..
``/end_weight_update`` session. ``actor.weight_sync_check`` then compares every server's
log-probs with the actor's (float32, tolerance 1e-5), so a wrong or missed update fails.

(a) one TP-1 server ``hf:d1`` on ``fsdp:d1``; (b) one TP-2 server ``hf:d1p1t2`` spanning
the two workers of ``fsdp:d2``: each actor rank fills one TP rank's entry; (c) the same
server on ``megatron:d1p1t2`` (Megatron on CPU through the test worker): both tensor-parallel
ranks export the full HF weights, and the rank off the data-parallel head answers too.
"""

from __future__ import annotations

import pytest

from tests.integration.test_toy_bailing import MEGATRON_CPU
from tests.integration.test_trainer_e2e import _run, _stats, _trial_dir

pytestmark = pytest.mark.slow

COLOCATED_AWEX = (
    "total_train_steps=2",
    "actor.weight_update_mode=awex",
    "actor.weight_sync_check=true",
    "actor.weight_sync_check_tolerance=1e-5",
    "rollout.scheduling_strategy.type=colocation",
    "rollout.scheduling_strategy.target=actor",
    "rollout.scheduling_strategy.fork=true",
)


@pytest.mark.parametrize(
    ("actor", "rollout", "tp", "extra"),
    [
        ("fsdp:d1", "hf:d1", 1, ()),
        ("fsdp:d2", "hf:d1p1t2", 2, ()),
        ("megatron:d1p1t2", "hf:d1p1t2", 2, MEGATRON_CPU),
    ],
    ids=["hf-d1-on-fsdp-d1", "hf-d1p1t2-on-fsdp-d2", "hf-d1p1t2-on-megatron-d1p1t2"],
)
def test_colocated_awex_trains_two_steps_with_every_server_equal_to_the_actor(
    tmp_path, actor, rollout, tp, extra
):
    trial = f"awex-{actor}-{rollout}".replace(":", "-")
    backends = (f"actor.backend={actor}", f"rollout.backend={rollout}")
    _run(tmp_path, trial, *backends, *COLOCATED_AWEX, *extra, timeout=900)
    stats = _stats(tmp_path, trial)
    assert [s["global_step"] for s in stats] == [0, 1]
    assert [s["train/weight_version"] for s in stats] == [1.0, 2.0]
    for step in stats:
        assert step["weight_sync/server0_max_abs_logp_diff"] <= 1e-5, step
        assert "timeperf/offload_rollout" in step and "timeperf/onload_rollout" in step
    logs = _trial_dir(tmp_path, trial)
    # the rollout worker (and its server) was forked by the actor's first worker only
    assert (logs / "actor.log").read_text().count("Forked rollout/") == 1
    # both updates went by handle, one entry per TP rank
    loads = (logs / "rollout.log").read_text().count(f"handed over by handle for {tp} TP rank(s)")
    assert loads == 2, loads
