"""Exact resume: rows drawn ahead of training when a checkpoint is taken are trained after
the resume, exactly once each (the dataloader alone, then through the rollout controller)."""

from __future__ import annotations

import json
import time

import pytest

from areal.api.cli_args import InferenceEngineConfig, SchedulingSpec
from areal.infra.controller.rollout_controller import RolloutController
from areal.trainer.dataloader import StatefulDataLoader
from tests.unit.infra.fake_rollout import FakeRolloutScheduler, FakeServer

ROWS = [{"id": i} for i in range(24)]


def _checkpoint(loader: StatefulDataLoader) -> dict:
    return json.loads(json.dumps(loader.state_dict()))  # what a recover point stores


def test_tracked_rows_stay_outstanding_until_settled():
    loader = StatefulDataLoader(ROWS, batch_size=4, shuffle=False)
    batches = loader.tracked()
    first, second = next(batches), next(batches)
    assert [row["id"] for _, row in first] == [0, 1, 2, 3]
    loader.settle([key for key, _ in first])
    loader.settle([second[0][0]])
    assert loader.outstanding() == [(0, 5), (0, 6), (0, 7)]
    state = _checkpoint(loader)
    assert state["position"] == 2 and state["outstanding"] == [[0, 5], [0, 6], [0, 7]]


def test_a_restored_loader_hands_out_rows_drawn_ahead_first_then_the_rest_of_the_epoch():
    loader = StatefulDataLoader(ROWS, batch_size=4, shuffle=True, seed=3)
    batches = loader.tracked()
    drawn = [item for _ in range(3) for item in next(batches)]  # 12 rows drawn ahead
    trained = [row["id"] for _, row in drawn[:5]]  # training consumed 5 of them
    loader.settle([key for key, _ in drawn[:5]])
    state = _checkpoint(loader)

    resumed = StatefulDataLoader(ROWS, batch_size=4, shuffle=True, seed=3)
    resumed.load_state_dict(state)
    after = [row["id"] for batch in resumed.tracked() for _, row in batch]
    # the 7 rows in flight come back first, then the 3 batches never drawn
    assert after[:7] == [row["id"] for _, row in drawn[5:]]
    assert sorted(trained + after) == list(range(24))  # the epoch, each row exactly once
    assert resumed.epoch == 1 and resumed.position == 0


def test_rows_drawn_ahead_by_the_rollout_are_trained_after_resume_exactly_once():
    server, worker_rpc = FakeServer(), FakeServer()
    trained: list[int] = []

    def controller_for(loader_state: dict | None, version: int):
        scheduler = FakeRolloutScheduler(
            server.address, worker_rpc.address, lambda data: {"row": data["id"]}, 0.05
        )
        config = InferenceEngineConfig(
            backend="hf:d1",
            experiment_name="exp",
            trial_name="trial",
            consumer_batch_size=4,
            max_head_offpolicyness=1,  # asynchronous: one batch may be drawn ahead
            max_concurrent_rollouts=8,
        )
        loader = StatefulDataLoader(ROWS, batch_size=4, shuffle=True, seed=0)
        if loader_state is not None:
            loader.load_state_dict(loader_state)
        controller = RolloutController(config, scheduler)
        controller.initialize(1, SchedulingSpec(), server_args={})
        controller.staleness.on_version_recovered(version)
        controller.set_version(version)
        return controller, loader

    def train_steps(controller, loader, steps: range) -> None:
        for step in steps:
            batch = controller.prepare_batch(loader, workflow="w", batch_size=4)
            trained.extend(t["row"] for t in batch)
            # as the trainer: one barrier around the weight update and checkpoint
            controller.begin_weight_update(step + 1)
            controller.end_weight_update(step + 1)

    try:
        controller, loader = controller_for(None, 0)
        try:
            train_steps(controller, loader, range(2))
            deadline = time.monotonic() + 10  # until the rollout has drawn ahead of training
            while not loader.outstanding() and time.monotonic() < deadline:
                time.sleep(0.01)
            controller.begin_weight_update(2)
            state = _checkpoint(loader)  # the recover point after step 1
        finally:
            controller.destroy()  # the controller is killed here
        assert state["outstanding"], "nothing was drawn ahead; the test proves nothing"
        assert len(trained) == 8

        controller, loader = controller_for(state, 2)
        try:
            train_steps(controller, loader, range(2, 6))
        finally:
            controller.destroy()
    finally:
        server.kill()
        worker_rpc.kill()
    assert sorted(trained) == list(range(24))  # every row of the epoch, exactly once


def test_a_checkpoint_that_does_not_fit_the_dataset_is_refused():
    loader = StatefulDataLoader(ROWS, batch_size=4)
    with pytest.raises(ValueError, match="outstanding rows do not fit"):
        loader.load_state_dict({"epoch": 0, "position": 1, "seed": 0, "outstanding": [[0, 99]]})
