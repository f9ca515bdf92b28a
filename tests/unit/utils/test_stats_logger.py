"""StatsLogger backends (JSONL, TensorBoard, fake W&B) and the progress display."""

from __future__ import annotations

import io
import json
import os
import socket
import struct
import sys
import types
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console
from tensorboardX.proto import event_pb2

from areal.api.cli_args import BaseExperimentConfig, StatsLoggerConfig
from areal.api.io_struct import FinetuneSpec
from areal.utils.paths import get_log_path
from areal.utils.stats_logger import STATS_FILE, ProgressDisplay, StatsLogger
from tests.conftest import SECRET_SENTINEL

FT_SPEC = FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=2)


@pytest.fixture(autouse=True)
def no_network(monkeypatch):
    """Any attempt to open a connection fails the test."""

    def refuse(self, address):
        raise AssertionError(f"network access attempted: {address}")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    monkeypatch.delenv("RANK", raising=False)


def _config(tmp_path: Path, tensorboard: bool = False) -> StatsLoggerConfig:
    cfg = StatsLoggerConfig(experiment_name="exp", trial_name="trial", fileroot=str(tmp_path))
    if tensorboard:
        cfg.tensorboard.path = str(tmp_path / "tb")
    return cfg


def _rows(tmp_path: Path) -> list[dict[str, Any]]:
    path = get_log_path(str(tmp_path), "exp", "trial", create=False) / STATS_FILE
    return [json.loads(line) for line in path.read_text().splitlines()]


def _tensorboard_scalars(directory: Path) -> list[tuple[str, int, float]]:
    """(tag, step, value) of every scalar in the event files (TFRecord framing)."""
    out = []
    for file in sorted(directory.glob("events.out.tfevents.*")):
        data = file.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos : pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12 : pos + 12 + length])
            pos += 12 + length + 4  # length, its crc, payload, payload crc
            for value in event.summary.value:
                out.append((value.tag, event.step, round(value.simple_value, 6)))
    return out


def test_commit_writes_jsonl_rows_without_count_keys(tmp_path):
    logger = StatsLogger(_config(tmp_path), FT_SPEC)
    logger.commit(0, 0, 0, {"rollout/reward": 0.5, "rollout/reward__count": 4.0})
    logger.commit(0, 1, 1, {"rollout/reward": 0.75, "ppo_actor/update/actor_loss": -0.1})
    logger.close()
    rows = _rows(tmp_path)
    assert [{k: v for k, v in row.items() if k != "time"} for row in rows] == [
        {"epoch": 0, "step": 0, "global_step": 0, "rollout/reward": 0.5},
        {
            "epoch": 0,
            "step": 1,
            "global_step": 1,
            "rollout/reward": 0.75,
            "ppo_actor/update/actor_loss": -0.1,
        },
    ]
    assert all(isinstance(row["time"], float) for row in rows)


def test_non_finite_values_become_null(tmp_path):
    logger = StatsLogger(_config(tmp_path), FT_SPEC)
    logger.commit(0, 0, 0, {"loss": float("nan")})
    logger.close()
    assert _rows(tmp_path)[0]["loss"] is None


def test_tensorboard_events_and_monotonic_log_step(tmp_path):
    logger = StatsLogger(_config(tmp_path, tensorboard=True), FT_SPEC)
    logger.commit(0, 0, 0, {"rollout/reward": 1.0})
    logger.commit(0, 0, 0, {"rollout/reward": 2.0})  # replayed step: logged at 1
    logger.commit(0, 3, 3, {"rollout/reward": 3.0})
    assert logger.state_dict() == {"last_commit_step": 3}
    logger.close()
    assert _tensorboard_scalars(tmp_path / "tb") == [
        ("rollout/reward", 0, 1.0),
        ("rollout/reward", 1, 2.0),
        ("rollout/reward", 3, 3.0),
    ]


def test_state_round_trip_continues_after_last_commit(tmp_path):
    first = StatsLogger(_config(tmp_path), FT_SPEC)
    first.commit(0, 0, 5, {"x": 1.0})
    state = first.state_dict()
    first.close()

    # a fresh directory: two writers within one second would share an event file name
    resumed_config = _config(tmp_path)
    resumed_config.tensorboard.path = str(tmp_path / "tb_resumed")
    resumed = StatsLogger(resumed_config, FT_SPEC)
    resumed.load_state_dict(state)
    resumed.commit(0, 0, 2, {"x": 2.0})  # an earlier global step still logs after 5
    resumed.close()
    assert _tensorboard_scalars(tmp_path / "tb_resumed") == [("x", 6, 2.0)]
    assert len(_rows(tmp_path)) == 2  # appended, not truncated


def test_only_rank_zero_logs(tmp_path):
    logger = StatsLogger(_config(tmp_path), FT_SPEC, rank=1)
    logger.commit(0, 0, 0, {"x": 1.0})
    logger.close()
    assert not (tmp_path / "logs").exists()


def test_experiment_config_is_accepted(tmp_path):
    cfg = BaseExperimentConfig(experiment_name="exp", trial_name="trial")
    cfg.stats_logger = _config(tmp_path)
    logger = StatsLogger(cfg, FT_SPEC)
    logger.commit(0, 0, 0, {"x": 1.0})
    logger.close()
    assert _rows(tmp_path)[0]["x"] == 1.0


class FakeWandb(types.ModuleType):
    def __init__(self) -> None:
        super().__init__("wandb")
        self.calls: list[tuple[str, Any]] = []

    def login(self, **kwargs: Any) -> None:
        self.calls.append(("login", kwargs))

    def init(self, **kwargs: Any) -> None:
        self.calls.append(("init", kwargs))

    def log(self, data: dict, step: int) -> None:
        self.calls.append(("log", (data, step)))

    def finish(self) -> None:
        self.calls.append(("finish", None))


def test_wandb_offline_never_logs_in_and_gets_a_redacted_config(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    monkeypatch.setenv("WANDB_API_KEY", "placeholder")  # restored after the test
    cfg = BaseExperimentConfig(experiment_name="exp", trial_name="trial")
    cfg.stats_logger = _config(tmp_path)
    cfg.stats_logger.wandb.mode = "offline"
    cfg.stats_logger.wandb.wandb_api_key = SECRET_SENTINEL

    logger = StatsLogger(cfg, FT_SPEC)
    logger.commit(0, 0, 0, {"x": 1.0, "x__count": 2.0})
    logger.close()

    names = [name for name, _ in fake.calls]
    assert names == ["init", "log", "finish"]  # no login in offline mode
    init = fake.calls[0][1]
    assert init["mode"] == "offline" and "force" not in init
    assert init["project"] == "exp" and init["name"] == "trial"
    assert init["id"] == "exp_trial_train" and init["group"] == "exp_trial"
    assert SECRET_SENTINEL not in json.dumps(init["config"], default=str)
    assert init["config"]["stats_logger"]["wandb"]["wandb_api_key"] == "<redacted>"
    assert fake.calls[1][1] == ({"x": 1.0}, 0)
    assert os.environ["WANDB_API_KEY"] == SECRET_SENTINEL


def test_wandb_online_logs_in(tmp_path, monkeypatch):
    fake = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = _config(tmp_path)
    cfg.wandb.mode = "online"
    StatsLogger(cfg, FT_SPEC).close()
    assert [name for name, _ in fake.calls][:2] == ["login", "init"]
    assert fake.calls[1][1]["force"] is True


def test_missing_backend_package_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` fail
    cfg = _config(tmp_path)
    cfg.wandb.mode = "online"
    with pytest.raises(RuntimeError, match=r"stats_logger.wandb.mode=online needs the 'wandb'"):
        StatsLogger(cfg, FT_SPEC)


def test_disabled_backends_are_not_imported(tmp_path, monkeypatch):
    for name in ("wandb", "swanlab", "trackio"):
        monkeypatch.setitem(sys.modules, name, None)
    StatsLogger(_config(tmp_path), FT_SPEC).close()  # would raise if any were imported


# --- progress display ---


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_progress_plain_lines_when_not_a_terminal(tmp_path):
    clock = FakeClock()
    console = Console(file=io.StringIO())
    assert not console.is_terminal
    display = ProgressDisplay(10, console=console, clock=clock)
    clock.now = 10.0
    line = display.update(1, {"rollout/reward": 0.5, "ppo_actor/n_valid_tokens": 1000.0})
    # 1000 tokens in 10 s = 100 tok/s; 10 s per step x 9 steps left = 90 s = 1:30
    assert line == "step 1/10 | reward 0.500 | 100 tok/s | ETA 1:30"
    clock.now = 40.0
    line = display.update(2, {"ppo_actor/n_seqs": 4.0})
    # 4 samples in 30 s = 8 per minute; mean 20 s per step x 8 left = 160 s = 2:40
    assert line == "step 2/10 | 8.0 samples/min | ETA 2:40"
    display.close()
    assert console.file.getvalue() == ""  # plain mode goes to the log, not the console


def test_progress_uses_the_step_time_the_trainer_measured():
    clock = FakeClock()
    display = ProgressDisplay(5, console=Console(file=io.StringIO()), clock=clock)
    clock.now = 50.0  # an evaluation before training (30 s) and the first step (20 s)
    stats = {"rollout/reward_mean": 0.25, "ppo_actor/n_valid_tokens": 500.0}
    line = display.update(1, {**stats, "perf/step_seconds": 20.0})
    # 500 tokens in the step's 20 s = 25 tok/s; 20 s per step x 4 steps left = 1:20
    assert line == "step 1/5 | reward 0.250 | 25 tok/s | ETA 1:20"
    clock.now = 60.0
    # no measured time: the 10 s since the last update; mean (20 + 10) / 2 x 3 left = 45 s
    assert display.update(2, {}).endswith("ETA 0:45")


def test_progress_resumed_run_counts_from_start_step():
    clock = FakeClock()
    display = ProgressDisplay(100, start_step=50, console=Console(file=io.StringIO()), clock=clock)
    clock.now = 3600.0
    # one step took an hour; 49 steps remain
    assert display.update(51, {}).endswith("ETA 49:00:00")


def test_progress_bar_on_a_terminal():
    console = Console(file=io.StringIO(), force_terminal=True, width=120)
    clock = FakeClock()
    with ProgressDisplay(4, console=console, clock=clock) as display:
        clock.now = 1.0
        display.update(1, {"rollout/reward": 0.25})
    output = console.file.getvalue()
    assert "1/4" in output and "reward 0.250" in output
