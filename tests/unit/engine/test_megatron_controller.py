"""One PPO step of the Megatron actor through ``TrainController``: t2 / p2 / d2 equal d1.

Workers come from the local scheduler and run the RPC server through
:mod:`tests.unit.engine.megatron_cpu_worker` (the CPU shim, then the unchanged server),
on gloo in float32. Each layout recomputes the log-probs of one fixed batch of four
rollout groups, computes advantages, takes one SGD step and recomputes the log-probs;
everything must match the single-rank run. With t2 and p2 both ranks of the one
model-parallel group must get the same data (only rank 0 is sent it); with d2 each rank
gets two whole groups and the result must still be the global-batch token mean.
"""

from __future__ import annotations

import importlib.util
import time
from pathlib import Path

import pytest
import torch

# only looked up here: the workers import megatron-core, the controller never does
available = all(importlib.util.find_spec(name) for name in ("megatron.core", "mbridge"))
pytestmark = [
    pytest.mark.skipif(not available, reason="megatron-core / mbridge not installed"),
    pytest.mark.slow,
]

REPO_ROOT = Path(__file__).resolve().parents[3]
ACTOR = "areal.trainer.ppo.actor.MegatronPPOActor"
WORKER_CMD = "python -m tests.unit.engine.megatron_cpu_worker"
N_GROUPS, GROUP_SIZE = 4, 2

# float32 throughout. TP splits the attention heads, MLP width and vocabulary in two and
# sums the halves with an all-reduce; PP and DP only move the same per-layer math to
# other processes (DP packs different micro-batches and all-reduces the gradients). Each
# reorders float32 sums of at most a few thousand terms, so results agree to ~1e-6
# relative; the log-probs (about -7 for a 1024-token vocabulary) to well under 1e-5.
LOGP_ATOL = 1e-5
LOSS_RTOL = 1e-5
GRAD_NORM_RTOL = 1e-4


def make_batch() -> list[dict[str, torch.Tensor]]:
    """Four groups of two completions; in group ``g`` completion ``s`` has ``4 + 2s + g``
    tokens after a prompt of ``3 + g``, and the longer completion wins (reward 1)."""
    g = torch.Generator().manual_seed(11)
    batch = []
    for group in range(N_GROUPS):
        prompt_len = 3 + group
        lengths = [prompt_len + 4 + 2 * s + group for s in range(GROUP_SIZE)]
        width = max(lengths)
        mask = torch.arange(width)[None] < torch.tensor(lengths)[:, None]
        ids = torch.randint(3, 1000, (GROUP_SIZE, width), generator=g) * mask
        loss_mask = mask.clone()
        loss_mask[:, :prompt_len] = False
        batch.append(
            {
                "input_ids": ids,
                "attention_mask": mask,
                "loss_mask": loss_mask.long(),
                "logprobs": torch.zeros(GROUP_SIZE, width),  # set on-policy in run_layout
                "versions": torch.where(loss_mask, 0, -1),
                "rewards": torch.tensor([0.0, 1.0]),
            }
        )
    return batch


def actor_config(model_dir: Path, backend: str):
    from areal.api.cli_args import (
        MegatronDDPConfig,
        MegatronEngineConfig,
        MicroBatchSpec,
        NormConfig,
        OptimizerConfig,
        PPOActorConfig,
    )

    return PPOActorConfig(
        experiment_name="mp-controller",
        trial_name=backend.replace(":", "-"),
        backend=backend,
        path=str(model_dir),
        dtype="float32",
        mb_spec=MicroBatchSpec(max_tokens_per_mb=32),  # several packed micro-batches
        # SGD, no clipping: the step is exactly -lr x the gradient, so equal gradients
        # give equal weights
        optimizer=OptimizerConfig(
            type="sgd", lr=1.0, weight_decay=0.0, gradient_clipping=0.0, warmup_steps_proportion=0.0
        ),
        megatron=MegatronEngineConfig(ddp=MegatronDDPConfig(use_distributed_optimizer=False)),
        ppo_n_minibatches=1,  # one global minibatch: the same objective for every DP split
        eps_clip=0.2,
        kl_ctl=0.0,
        reward_norm=NormConfig(mean_level="group", std_level="group", group_size=GROUP_SIZE),
        adv_norm=None,  # batch-normalized advantages would make the loss ~0
        use_decoupled_loss=True,
        prox_logp_method="recompute",
    )


def run_layout(backend: str, world: int, model_dir: Path, root: Path) -> dict:
    """One PPO step through TrainController on ``world`` local workers."""
    from areal.api.cli_args import (
        BaseExperimentConfig,
        ClusterSpecConfig,
        NameResolveConfig,
        SchedulingSpec,
    )
    from areal.api.io_struct import FinetuneSpec
    from areal.infra.controller.train_controller import TrainController
    from areal.infra.scheduler.local import LocalScheduler
    from areal.utils import name_resolve

    began = time.monotonic()
    config = BaseExperimentConfig(
        experiment_name="mp-controller",
        trial_name=backend.replace(":", "-"),
        cluster=ClusterSpecConfig(
            fileroot=str(root / "files"),
            name_resolve=NameResolveConfig(nfs_record_root=str(root / "name_resolve")),
        ),
    )
    scheduler = LocalScheduler(config, gpu_devices=[], stop_grace=5.0)
    ctl = TrainController(ACTOR, actor_config(model_dir, backend), scheduler)
    batch = make_batch()
    try:
        spec = SchedulingSpec(cpu=1, mem=1, cmd=WORKER_CMD)
        ctl.initialize(world, spec, FinetuneSpec(1, N_GROUPS, N_GROUPS))
        assert ctl.should_compute_prox_logp()
        before = ctl.compute_logp(batch)
        for trajectory, logp in zip(batch, before, strict=True):
            # on-policy: the behaviour log-probs are the current ones, in the token
            # convention (position t holds log p(token t)); the proximal ones shifted
            trajectory["logprobs"] = torch.roll(logp, 1, dims=1)
            trajectory["prox_logp"] = logp
        advantaged = ctl.compute_advantages(batch)
        stats = ctl.ppo_update(advantaged)
        ctl.step_lr_scheduler()
        after = ctl.compute_logp(batch)
        ctl.set_version(1)
        run = {
            "dp_size": ctl.dp_size,
            "heads": [w.id for w in ctl.dp_heads],
            "before": before,
            "advantages": [t["advantages"] for t in advantaged],
            "stats": stats,
            "after": after,
            "version": ctl.get_version(),
            "exported": ctl.export_stats(),
        }
    finally:
        ctl.destroy()
        scheduler.delete_workers()
        name_resolve.reconfigure("memory")
    run["seconds"] = time.monotonic() - began
    return run


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    from areal.api.scheduler_api import RPC_TOKEN_ENV

    mp.delenv(RPC_TOKEN_ENV, raising=False)
    mp.chdir(REPO_ROOT)  # workers import tests.* through the controller's cwd
    yield tmp_path_factory.mktemp("megatron-controller")
    mp.undo()


@pytest.fixture(scope="module")
def d1_run(workdir, tiny_model_dir):
    return run_layout("megatron:d1p1t1", 1, tiny_model_dir, workdir / "d1")


def real_tokens(batch_logp: list[torch.Tensor], batch: list[dict]) -> torch.Tensor:
    """The log-probs of every real (unpadded) position, flattened in batch order."""
    return torch.cat(
        [logp[group["attention_mask"]] for logp, group in zip(batch_logp, batch, strict=True)]
    )


def test_d1_step_trains_and_reports(d1_run):
    batch = make_batch()
    assert d1_run["dp_size"] == 1 and d1_run["heads"] == ["actor/0"]
    assert [tuple(t.shape) for t in d1_run["before"]] == [
        tuple(g["input_ids"].shape) for g in batch
    ]
    # rewards [0, 1] per group, group-normalized with the unbiased std sqrt(0.5):
    # A = -+0.5 / (sqrt(0.5) + 1e-5) on every trained token (discount 1, lambda 1, no KL)
    a = 0.5 / (0.5**0.5 + 1e-5)
    for group, adv in zip(batch, d1_run["advantages"], strict=True):
        trained = torch.roll(group["loss_mask"], -1, dims=1).bool()
        assert torch.allclose(adv[0][trained[0]], torch.tensor(-a))
        assert torch.allclose(adv[1][trained[1]], torch.tensor(a))
    # on-policy, so every ratio is 1 and the loss is -mean(A) over trained tokens: in
    # group g the rows train 4 + g and 6 + g tokens, so sum(A) = 4 x 2a over 52 tokens
    (step,) = d1_run["stats"]  # one minibatch, one optimizer step
    assert step["update_successful"] == 1.0
    assert step["loss"] == pytest.approx(-8 * a / 52, rel=LOSS_RTOL)
    moved = real_tokens(d1_run["after"], batch) - real_tokens(d1_run["before"], batch)
    assert moved.abs().max() > 1e-2  # the step changed the policy
    assert d1_run["version"] == 1
    assert "ppo_actor/update/actor_loss" in d1_run["exported"]


@pytest.mark.parametrize(
    ("backend", "world", "heads"),
    [
        ("megatron:d1p1t2", 2, ["actor/0"]),
        ("megatron:d1p2t1", 2, ["actor/0"]),
        ("megatron:d2p1t1", 2, ["actor/0", "actor/1"]),
    ],
)
def test_parallel_layout_step_equals_the_single_rank_step(
    d1_run, workdir, tiny_model_dir, backend, world, heads
):
    run = run_layout(backend, world, tiny_model_dir, workdir / backend.split(":")[1])
    batch = make_batch()
    assert run["heads"] == heads and run["dp_size"] == len(heads)
    before, after = real_tokens(run["before"], batch), real_tokens(run["after"], batch)
    assert (before - real_tokens(d1_run["before"], batch)).abs().max() < LOGP_ATOL
    for got, want in zip(run["advantages"], d1_run["advantages"], strict=True):
        assert torch.allclose(got, want, atol=1e-5)
    (step,), (ref,) = run["stats"], d1_run["stats"]
    print(
        f"{backend}: loss {step['loss']:.9f} grad_norm {step['grad_norm']:.7f} "
        f"({run['seconds']:.1f} s); d1: loss {ref['loss']:.9f} grad_norm "
        f"{ref['grad_norm']:.7f} ({d1_run['seconds']:.1f} s)"
    )
    assert step["update_successful"] == 1.0
    assert step["loss"] == pytest.approx(ref["loss"], rel=LOSS_RTOL)
    assert step["grad_norm"] == pytest.approx(ref["grad_norm"], rel=GRAD_NORM_RTOL)
    assert (after - real_tokens(d1_run["after"], batch)).abs().max() < LOGP_ATOL
    assert run["version"] == 1
    # the workers' token-weighted statistics are reduced over DP: the same global means
    for key in ("ppo_actor/update/new_logp/avg", "ppo_actor/advantages/avg"):
        assert run["exported"][key] == pytest.approx(d1_run["exported"][key], rel=LOSS_RTOL)
    if run["dp_size"] == 1:  # a plain mean of micro-batch losses: depends on the packing
        key = "ppo_actor/update/actor_loss"
        assert run["exported"][key] == pytest.approx(d1_run["exported"][key], rel=LOSS_RTOL)
