"""The KL penalty's reference model and the evaluation pass (issue 20, items 1, 2 and 6).

Hand-checked KL arithmetic, the ref's config (built from the actor when ``ref`` is null,
refused at load when it cannot be built), the eval controller's ``rollout_batch`` and
stats scope, and the reference's positional order of ``PPOTrainer.train``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from areal.api.cli_args import (
    GRPOConfig,
    InferenceEngineConfig,
    PPOActorConfig,
    SchedulingSpec,
    load_expr_config,
)
from areal.api.config.fields import ConfigError, FieldError
from areal.api.config.support import refuse_unsupported, unsupported
from areal.api.scheduler_api import Job, Worker
from areal.infra.controller import rollout_controller
from areal.infra.controller.rollout_controller import RolloutController
from areal.trainer import evaluation, rl_trainer
from areal.trainer.ppo.functions import compute_advantages
from tests.unit.infra.fake_scheduler import SyncEngineCalls

REPO = Path(__file__).resolve().parents[3]
TOY = REPO / "examples" / "toy" / "toy_grpo.yaml"


def close(actual: torch.Tensor, expected: list, tol: float = 1e-6) -> None:
    torch.testing.assert_close(
        actual.double(), torch.tensor(expected, dtype=torch.float64), rtol=tol, atol=tol
    )


# --- the KL term against reference log-probs ---------------------------------------------------


def _zero_reward_row() -> dict[str, torch.Tensor]:
    """One row: 1 prompt token, 3 model tokens (n = L = 4), reward 0.

    Behaviour log-probs ``b = [0, -0.2, -0.3, -0.4]``; after the shift ``M = [1, 1, 1, 0]``
    and ``l_old = [-0.2, -0.3, -0.4, 0]`` (position t scores token t + 1).
    """
    return {
        "input_ids": torch.tensor([[10, 11, 12, 13]]),
        "attention_mask": torch.ones(1, 4, dtype=torch.bool),
        "loss_mask": torch.tensor([[0, 1, 1, 1]]),
        "logprobs": torch.tensor([[0.0, -0.2, -0.3, -0.4]]),
        "versions": torch.tensor([[-1, 0, 0, 0]]),
        "rewards": torch.tensor([0.0]),
    }


def test_the_default_kl_ctl_penalizes_drift_from_the_ref():
    cfg = PPOActorConfig()  # the default kl_ctl 0.1, k1, gamma = lambda = 1, no norms
    assert cfg.kl_ctl == 0.1
    row = _zero_reward_row()
    row["ref_logp"] = torch.full((1, 4), -0.5)  # the ref finds every sampled token less likely
    out = compute_advantages(row, cfg, [1])
    # delta = l_old - l_ref = [0.3, 0.2, 0.1, 0 (masked)]; k = -0.1 x delta
    close(out["kl_rewards"], [[-0.03, -0.02, -0.01, 0.0]])
    # the last real position (n - 1 = 3) gets no KL; the outcome (0) sits at n - 2 = 2
    close(out["tot_rewards"], [[-0.03, -0.02, -0.01, 0.0]])
    # GAE backwards: A_2 = -0.01, A_1 = -0.02 - 0.01 = -0.03, A_0 = -0.03 - 0.03 = -0.06
    close(out["advantages"], [[-0.06, -0.03, -0.01, 0.0]])
    close(out["ref_logp"], [[-0.5, -0.5, -0.5, 0.0]])  # masked like l_old


def test_a_zero_reward_batch_scored_by_its_own_policy_gets_no_bonus():
    # the first step: the ref is the policy that sampled, so KL = 0 and advantages are 0.
    # Scored against ref_logp = 0 (no ref), k would be -0.1 x l_old = [0.02, 0.03, 0.04]:
    # a positive advantage for every token of a zero-reward sample.
    row = _zero_reward_row()
    row["ref_logp"] = torch.tensor([[-0.2, -0.3, -0.4, -9.0]])  # aligned like l_old
    out = compute_advantages(row, PPOActorConfig(), [1])
    close(out["kl_rewards"], [[0.0, 0.0, 0.0, 0.0]])
    assert (out["advantages"] <= 0).all()
    close(out["advantages"], [[0.0, 0.0, 0.0, 0.0]])


def test_kl_ctl_without_reference_logprobs_is_an_error_not_a_bonus():
    with pytest.raises(ValueError, match=r"actor\.kl_ctl is 0\.1 .*ref_logp"):
        compute_advantages(_zero_reward_row(), PPOActorConfig(), [1])
    # kl_ctl 0 needs no ref
    out = compute_advantages(_zero_reward_row(), PPOActorConfig(kl_ctl=0.0), [1])
    close(out["advantages"], [[0.0, 0.0, 0.0, 0.0]])


def test_a_negative_kl_ctl_is_refused_at_load():
    with pytest.raises(FieldError, match="kl_ctl"):
        PPOActorConfig(kl_ctl=-0.1)


# --- the reference model's config --------------------------------------------------------------


@pytest.fixture
def toy_env(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_FILEROOT", str(tmp_path))
    return tmp_path


def _load(yaml_text: str | None = None, *overrides: str, tmp: Path) -> GRPOConfig:
    path = TOY
    if yaml_text is not None:
        path = tmp / "config.yaml"
        path.write_text(yaml_text)
    config, _ = load_expr_config(["--config", str(path), *overrides], GRPOConfig)
    return config


# a ref section must name what the loader requires (it has no defaults for these)
REF = "ref:\n  experiment_name: x\n  trial_name: y\n  backend: ${actor.backend}\n"


def _toy_without_kl_ctl() -> str:
    lines = TOY.read_text().splitlines()
    return "\n".join(line for line in lines if "kl_ctl" not in line) + "\n"


def test_a_yaml_without_kl_ctl_gets_a_ref_beside_the_actor(toy_env):
    config = _load(_toy_without_kl_ctl(), tmp=toy_env)
    assert config.actor.kl_ctl == 0.1 and config.ref is None
    ref = config.ref_config()
    assert ref is not None
    assert ref.path == config.actor.path and ref.backend == config.actor.backend
    assert ref.optimizer is None  # frozen
    assert ref.temperature == config.actor.temperature
    strategy = ref.scheduling_strategy
    assert (strategy.type, strategy.target, strategy.fork) == ("colocation", "actor", True)
    assert config.actor.optimizer is not None  # the actor's own config is untouched
    assert config.actor.scheduling_strategy.type == "separation"
    assert unsupported(config) == []


def test_kl_ctl_zero_builds_no_ref_even_with_a_ref_section(toy_env):
    text = TOY.read_text() + REF + "  path: ${actor.path}\n"
    config = _load(text, tmp=toy_env)
    assert config.actor.kl_ctl == 0.0 and config.ref is not None
    assert config.ref_config() is None


def test_a_ref_section_fills_from_the_actor_and_never_trains(toy_env):
    text = (
        TOY.read_text()
        + REF
        + (
            "  temperature: 0.5\n  optimizer:\n    type: adam\n    lr: 1.0e-3\n"
            "  scheduling_strategy:\n    type: colocation\n    target: actor\n"
        )
    )
    config = _load(text, "actor.kl_ctl=0.05", tmp=toy_env)
    ref = config.ref_config()
    assert ref.path == config.actor.path and ref.backend == "fsdp:d1"
    assert ref.optimizer is None and ref.temperature == config.actor.temperature
    assert unsupported(config) == []


@pytest.mark.parametrize(
    ("extra", "overrides", "field", "message"),
    [
        ("", ("actor.init_from_scratch=true",), "actor.kl_ctl", "init_from_scratch"),
        (
            REF + "  scheduling_strategy:\n    type: colocation\n    target: rollout\n",
            (),
            "ref.scheduling_strategy.target",
            "target: actor",
        ),
        (
            REF + "  scheduling_strategy:\n    type: colocation\n    target: actor\n"
            "    fork: false\n",
            (),
            "ref.scheduling_strategy.fork",
            "fork: true",
        ),
    ],
)
def test_a_ref_that_cannot_be_built_is_refused_at_load(toy_env, extra, overrides, field, message):
    config = _load(TOY.read_text() + extra, "actor.kl_ctl=0.1", *overrides, tmp=toy_env)
    errors = [e for e in unsupported(config) if e.field == field]
    assert errors and message in str(errors[0]), unsupported(config)
    with pytest.raises(ConfigError, match=r"actor\.kl_ctl: 0"):
        refuse_unsupported(config)


# --- the eval controller: every row once, its stats under its own scope ------------------------


class OneWorkerScheduler(SyncEngineCalls):
    """A rollout worker whose task ``i`` finishes at once, rejected when ``i`` is odd."""

    rpc_token = "fake-token-123456"

    def __init__(self):
        self.done: dict[int, Any] = {}
        self.submits: list[dict] = []
        self.lock = threading.Lock()

    def create_workers(self, job: Job) -> list[str]:
        self.job = job
        return [f"{job.role}/0"]

    def get_workers(self, role: str, timeout: float | None = None) -> list[Worker]:
        return [Worker(f"{role}/0", "127.0.0.1", ["1"])]

    async def create_engine(self, worker_id: str, engine: str, *args: Any, **kwargs: Any) -> str:
        return worker_id

    def delete_workers(self, role: str | None = None) -> None:
        pass

    def call_engine(self, worker_id: str, method: str, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("engine_name", None)
        if method == "submit":
            task_id = kwargs["task_id"]
            with self.lock:
                self.submits.append({"data": args[0], **kwargs})
                self.done[task_id] = None if args[0]["id"] % 2 else {"row": args[0]["id"]}
            return task_id
        if method == "collect_finished":  # the controller's long poll (ack, timeout)
            time.sleep(0.01)
            with self.lock:
                for task_id in args[0]:
                    self.done.pop(task_id, None)
                return list(self.done.items())
        if method == "export_stats":
            return {
                "rollout/accepted": 0.5,
                "rollout/accepted__count": 2.0,
                "eval-rollout/reward": 1.0,
                "eval-rollout/reward__count": 1.0,
            }
        return None


def test_rollout_batch_returns_every_row_in_order_and_stats_are_rescoped(monkeypatch):
    monkeypatch.setattr(rollout_controller, "RESCUE_AFTER", 0.05, raising=False)
    config = InferenceEngineConfig(
        backend="hf:d1",
        experiment_name="exp",
        trial_name="trial",
        consumer_batch_size=2,
        max_concurrent_rollouts=2,
        max_head_offpolicyness=None,  # no staleness bound: an eval controller's
        health_check_interval=0,
    )
    scheduler = OneWorkerScheduler()
    controller = RolloutController(config, scheduler, role="eval-rollout")
    controller.initialize(1, SchedulingSpec(), server_addrs=["127.0.0.1:9"])
    try:
        began = time.monotonic()
        rows = [{"id": i} for i in range(5)]
        results = controller.rollout_batch(rows, "w", {"temperature": 0.0}, is_eval=True)
        assert time.monotonic() - began < 10
        assert results == [{"row": 0}, None, {"row": 2}, None, {"row": 4}]
        assert [s["data"]["id"] for s in scheduler.submits] == [0, 1, 2, 3, 4]
        assert all(s["is_eval"] for s in scheduler.submits)
        stats = controller.export_stats()
        # the workers' rollout/ keys (e.g. the executor's accepted counts) are the eval's
        assert stats["eval-rollout/accepted"] == 0.5
        assert stats["eval-rollout/reward"] == 1.0
        assert not any(k.startswith("rollout/") for k in stats)
    finally:
        controller.destroy()


def test_eval_stats_count_rows_and_average_accepted_samples():
    results = [
        {"rewards": torch.tensor([1.0, 0.5])},  # a row of two samples
        None,  # rejected
        {"rewards": torch.tensor([0.0])},
    ]
    stats = evaluation.eval_stats(results)
    assert stats == {
        "eval-rollout/n_rows": 3.0,
        "eval-rollout/n_rejected": 1.0,
        "eval-rollout/n_samples": 3.0,
        "eval-rollout/reward_mean": 0.5,  # (1 + 0.5 + 0) / 3
    }
    before = evaluation.rescope(stats, "eval-rollout", "eval-rollout/before_train")
    assert before["eval-rollout/before_train/reward_mean"] == 0.5
    assert evaluation.rescope({"rollout/x": 1.0}, "eval-rollout", "y") == {"rollout/x": 1.0}


# --- train(): the reference's positional order ---------------------------------------------------


def test_train_takes_the_eval_workflow_second():
    names = list(rl_trainer.PPOTrainer.train.__code__.co_varnames[1:7])
    assert names == [
        "workflow",
        "eval_workflow",
        "workflow_kwargs",
        "eval_workflow_kwargs",
        "dynamic_filter_fn",
        "total_epochs",
    ]
    trainer = rl_trainer.PPOTrainer.__new__(rl_trainer.PPOTrainer)  # nothing started
    with pytest.raises(TypeError, match=r"workflow_kwargs=\.\.\. by keyword"):
        trainer.train("examples.toy.token_reward.TokenRewardWorkflow", {"target_start": 1})


# --- no eval worker without an evaluation to run (docs/design.md#lazy-evaluation-machinery) ---


class _NoWorkers(RolloutController):
    """Counts construction; an eval controller must not even be built in these cases."""

    built = 0

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        type(self).built += 1
        raise AssertionError("an eval-rollout controller was created")


@pytest.mark.parametrize(
    ("workflow", "rows", "freq_steps"),
    [
        (None, [{"x": 1}], 1),  # no eval workflow: never an eval worker
        ("examples.toy.token_reward.TokenRewardWorkflow", [], 1),  # no valid rows
        ("examples.toy.token_reward.TokenRewardWorkflow", None, 1),
        ("examples.toy.token_reward.TokenRewardWorkflow", [{"x": 1}], None),  # no schedule
    ],
    ids=["no-eval-workflow", "empty-valid-set", "no-valid-set", "no-schedule"],
)
def test_no_eval_controller_starts_without_an_evaluation(
    toy_env, monkeypatch, workflow, rows, freq_steps
):
    config = _load(None, tmp=toy_env)
    config.evaluator.freq_steps = freq_steps
    config.evaluator.freq_epochs = None
    config.evaluator.freq_secs = None
    config.evaluator.eval_before_train = False
    monkeypatch.setattr(evaluation, "RolloutController", _NoWorkers)
    trainer = rl_trainer.PPOTrainer.__new__(rl_trainer.PPOTrainer)  # nothing started
    trainer.config, trainer.valid_dataset, trainer.eval_rollout = config, rows, None
    assert trainer._eval_pass(workflow, None) is None
    assert trainer.eval_rollout is None and _NoWorkers.built == 0


def test_an_eval_controller_is_built_when_there_is_an_evaluation(toy_env, monkeypatch):
    # the positive case of the test above: the same setup with workflow, rows and schedule
    from types import SimpleNamespace

    config = _load(None, tmp=toy_env)
    config.evaluator.freq_steps = 1
    monkeypatch.setattr(evaluation, "RolloutController", _NoWorkers)
    monkeypatch.setattr(_NoWorkers, "built", 0)
    trainer = rl_trainer.PPOTrainer.__new__(rl_trainer.PPOTrainer)
    trainer.config, trainer.valid_dataset, trainer.eval_rollout = config, [{"x": 1}], None
    trainer.rollout, trainer.scheduler = SimpleNamespace(config=config.rollout), None
    with pytest.raises(AssertionError, match="eval-rollout controller was created"):
        trainer._eval_pass("examples.toy.token_reward.TokenRewardWorkflow", None)
    assert _NoWorkers.built == 1
