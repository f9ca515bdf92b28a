"""The toy GRPO example with a context-parallel actor: ``fsdp:d1c2`` and ``megatron:d1p1t1c2``.

Both actor ranks take the same batch and micro-batches, each its zigzag share of every
sequence, and gather their log-probs back so the loss function sees the one-rank
micro-batch. The first step must be the c1 run's (gradient norm and token-mean entropy to
1e-4, the actor's counts equal); a second step must train. Megatron runs on CPU through the
test worker (``tests.unit.engine.megatron_cpu_worker``), as the Flash V3 mini test runs it.

Sampling is made deterministic, so both runs train on the same first batch: the server
decodes one request at a time from its seeded generator, and one rollout group runs at a
time, so the draws follow the seeded dataloader's order (a group's samples share a prompt,
so their order within the group does not change what is drawn).
"""

from __future__ import annotations

import sys

import pytest

from tests.integration.test_trainer_e2e import _dumps, _run, _stats

pytestmark = pytest.mark.slow

MEGATRON_CPU = (
    "actor.dtype=float32",
    "actor.megatron.ddp.use_distributed_optimizer=false",
    f"actor.scheduling_spec.0.cmd={sys.executable} -m tests.unit.engine.megatron_cpu_worker",
)
DETERMINISTIC = ("sglang.max_running_requests=1", "rollout.max_concurrent_rollouts=1")
ENTROPY = "ppo_actor/update/entropy/avg"
GRAD_NORM = "ppo_actor/grad_norm"
# counts the actor records; under CP only one rank of the group may report them
COUNTS = ("ppo_actor/n_seqs", "ppo_actor/n_valid_tokens")


def train_two_steps(tmp_path, model_dir, backend: str) -> tuple[list[dict], list[dict]]:
    """Stats of each step and the first step's dumped rollouts."""
    trial = backend.replace(":", "-")
    engine = MEGATRON_CPU if backend.startswith("megatron") else ()
    _run(tmp_path, trial, f"actor.path={model_dir}", f"actor.backend={backend}",
         "total_train_steps=2", *engine, *DETERMINISTIC, timeout=900)  # fmt: skip
    return _stats(tmp_path, trial), _dumps(tmp_path, trial, steps=2).get(0, [])


def sampled(rollouts: list[dict]) -> list[tuple[str, str]]:
    return sorted((s["prompt"], s["completion"]) for s in rollouts)


@pytest.mark.parametrize(
    ("model", "c1", "c2"),
    [
        ("tiny_model_dir", "fsdp:d1", "fsdp:d1c2"),
        ("tiny_model_dir", "megatron:d1p1t1c1", "megatron:d1p1t1c2"),
        ("bailing_model_dir", "fsdp:d1", "fsdp:d1c2"),
        ("bailing_model_dir", "megatron:d1p1t1c1", "megatron:d1p1t1c2"),
    ],
    ids=["qwen3-fsdp", "qwen3-megatron", "ling3-fsdp", "ling3-megatron"],
)
def test_context_parallel_actor_takes_the_one_rank_step(request, tmp_path, model, c1, c2):
    """Qwen3-style and Ling 3 (KDA + MLA + MoE) tiny models."""
    model_dir = request.getfixturevalue(model)
    one, one_rollouts = train_two_steps(tmp_path / "c1", model_dir, c1)
    two, two_rollouts = train_two_steps(tmp_path / "c2", model_dir, c2)
    assert one_rollouts and sampled(one_rollouts) == sampled(two_rollouts), "different batches"
    assert [s["global_step"] for s in two] == [0, 1]
    first, reference = two[0], one[0]
    print(
        f"{c2} vs {c1} first step: grad norm {first[GRAD_NORM]:.8f} vs "
        f"{reference[GRAD_NORM]:.8f}, entropy {first[ENTROPY]:.8f} vs {reference[ENTROPY]:.8f}"
    )
    assert first[GRAD_NORM] > 0.0
    assert first[GRAD_NORM] == pytest.approx(reference[GRAD_NORM], rel=1e-4)
    assert first[ENTROPY] == pytest.approx(reference[ENTROPY], rel=1e-4)
    assert {k: first[k] for k in COUNTS} == {k: reference[k] for k in COUNTS}
    assert two[1]["ppo_actor/optimizer_steps"] >= 1.0 and two[1]["train/weight_version"] == 2.0
    assert two[1][GRAD_NORM] > 0.0
