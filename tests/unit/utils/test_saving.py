"""Save / recover / evaluate schedule: frequency control, HF save paths, recover points."""

from __future__ import annotations

import json
import logging as std_logging
from pathlib import Path
from typing import Any

import pytest
import torch

from areal.api.cli_args import EvaluatorConfig, RecoverConfig, SaverConfig
from areal.api.io_struct import FinetuneSpec, SaveLoadMeta, WeightUpdateMeta
from areal.utils.paths import get_checkpoint_path
from areal.utils.saving import (
    Evaluator,
    FrequencyControl,
    RecoverHandler,
    RecoverInfo,
    Saver,
    StepInfo,
)

# 2 epochs of 3 steps: dataset of 6 prompts, 2 per step.
FT_SPEC = FinetuneSpec(total_train_epochs=2, dataset_size=6, train_batch_size=2)
NAMES = {"experiment_name": "exp", "trial_name": "trial"}


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeEngine:
    """Saves its ``state`` string to ``<path>/weights.txt`` and loads it back."""

    def __init__(self, state: str = "", fail_on_save: bool = False):
        self.state = state
        self.fail_on_save = fail_on_save
        self.saved: list[SaveLoadMeta] = []
        self.loaded: list[SaveLoadMeta] = []
        self.updates: list[Any] = []
        self.version: int | None = None

    def save(self, meta: SaveLoadMeta) -> None:
        self.saved.append(meta)
        Path(meta.path).mkdir(parents=True, exist_ok=True)
        (Path(meta.path) / "weights.txt").write_text("partial")
        if self.fail_on_save:
            raise RuntimeError("disk full")
        (Path(meta.path) / "weights.txt").write_text(self.state)

    def load(self, meta: SaveLoadMeta) -> None:
        self.loaded.append(meta)
        self.state = (Path(meta.path) / "weights.txt").read_text()

    def update_weights(self, meta: Any) -> None:
        self.updates.append(meta)

    def set_version(self, version: int) -> None:
        self.version = version


class FakeStateful:
    def __init__(self, state: Any = None, fail: bool = False):
        self.state = state
        self.fail = fail

    def state_dict(self) -> Any:
        if self.fail:
            raise RuntimeError("state unavailable")
        return self.state

    def load_state_dict(self, state: Any) -> None:
        self.state = state


class FakeInferenceEngine:
    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def begin_weight_update(self, version: int) -> None:
        self.calls.append(("begin_weight_update", version))

    def end_weight_update(self, version: int) -> None:
        self.calls.append(("end_weight_update", version))


# --- FrequencyControl ---


def test_frequency_steps_fire_every_n_steps():
    ctl = FrequencyControl(freq_steps=3)
    assert [ctl.check(steps=1) for _ in range(7)] == [False, False, True] * 2 + [False]


def test_frequency_epochs_count_epoch_ends_only():
    ctl = FrequencyControl(freq_epochs=2)
    # 3 steps per epoch; the epoch ends on steps 2 and 5; the second end fires.
    fired = [ctl.check(epochs=int(s % 3 == 2), steps=1) for s in range(6)]
    assert fired == [False, False, False, False, False, True]


def test_frequency_secs_with_fake_clock():
    clock = FakeClock()
    ctl = FrequencyControl(freq_secs=10, clock=clock)
    fired = []
    for t in (5, 10, 15, 19.9, 20):  # seconds after creation
        clock.now = 1000.0 + t
        fired.append(ctl.check(steps=1))
    # fires at 10 (10 s since creation) and at 20 (10 s since the fire at 10)
    assert fired == [False, True, False, False, True]


def test_frequency_any_limit_fires_and_resets_all_counters():
    clock = FakeClock()
    ctl = FrequencyControl(freq_steps=2, freq_secs=100, clock=clock)
    assert not ctl.check(steps=1)
    clock.now += 100  # time fires first, which also resets the step count
    assert ctl.check(steps=0)
    assert not ctl.check(steps=1)
    assert ctl.check(steps=1)


def test_frequency_without_limits_never_fires():
    ctl = FrequencyControl()
    assert not ctl.enabled
    assert not any(ctl.check(epochs=1, steps=1) for _ in range(10))


def test_frequency_rejects_non_positive_limits():
    with pytest.raises(ValueError, match="freq_steps"):
        FrequencyControl(freq_steps=0)


def test_frequency_state_round_trip_keeps_elapsed_time():
    clock = FakeClock()
    ctl = FrequencyControl(freq_steps=5, freq_secs=60, clock=clock)
    ctl.check(steps=3)
    clock.now += 40
    state = ctl.state_dict()
    assert state == {"epochs": 0, "steps": 3, "elapsed_secs": 40.0}

    other_clock = FakeClock()
    other_clock.now = 5.0  # a new process: a different monotonic origin
    restored = FrequencyControl(freq_steps=5, freq_secs=60, clock=other_clock)
    restored.load_state_dict(state)
    other_clock.now += 19
    assert not restored.check()  # 59 s, 3 steps
    other_clock.now += 1
    assert restored.check()  # 60 s


# --- StepInfo ---


def test_step_info_next_wraps_at_epoch_end():
    info = StepInfo(epoch=0, epoch_step=0, global_step=0, steps_per_epoch=3)
    seen = []
    for _ in range(4):
        info = info.next()
        seen.append((info.epoch, info.epoch_step, info.global_step))
    assert seen == [(0, 1, 1), (0, 2, 2), (1, 0, 3), (1, 1, 4)]


# --- Saver and Evaluator ---


def _saver_config(tmp_path: Path, **kwargs: Any) -> SaverConfig:
    return SaverConfig(fileroot=str(tmp_path), **NAMES, **kwargs)


def test_saver_writes_hf_checkpoints_on_schedule(tmp_path):
    saver = Saver(_saver_config(tmp_path, freq_steps=2), FT_SPEC)
    engine = FakeEngine("w")
    tokenizer = object()
    paths = [
        saver.save(engine, epoch=g // 3, step=g % 3, global_step=g, tokenizer=tokenizer)
        for g in range(4)
    ]
    root = get_checkpoint_path(str(tmp_path), "exp", "trial") / "default"
    assert paths == [
        None,
        root / "epoch0epochstep1globalstep1",
        None,
        root / "epoch1epochstep0globalstep3",
    ]
    assert [(m.path, m.weight_format, m.with_optim) for m in engine.saved] == [
        (str(paths[1]), "hf", False),
        (str(paths[3]), "hf", False),
    ]
    assert engine.saved[0].tokenizer is tokenizer


def test_saver_epoch_frequency_saves_last_step_of_each_epoch(tmp_path):
    saver = Saver(_saver_config(tmp_path, freq_epochs=1), FT_SPEC)
    engine = FakeEngine()
    saved = [g for g in range(6) if saver.save(engine, g // 3, g % 3, g, name="critic")]
    assert saved == [2, 5]
    assert Path(engine.saved[0].path).parent.name == "critic"


def test_saver_without_frequency_never_saves(tmp_path):
    saver = Saver(_saver_config(tmp_path), FT_SPEC)
    engine = FakeEngine()
    assert all(saver.save(engine, 0, s, s) is None for s in range(3))
    assert engine.saved == []


def test_saver_state_round_trip(tmp_path):
    saver = Saver(_saver_config(tmp_path, freq_steps=3), FT_SPEC)
    saver.save(FakeEngine(), 0, 0, 0)
    restored = Saver(_saver_config(tmp_path, freq_steps=3), FT_SPEC)
    restored.load_state_dict(json.loads(json.dumps(saver.state_dict())))
    engine = FakeEngine()
    # one step already counted: the third step overall saves
    assert restored.save(engine, 0, 1, 1) is None
    assert restored.save(engine, 0, 2, 2) is not None


def test_evaluator_runs_function_when_due():
    config = EvaluatorConfig(fileroot="/unused", **NAMES, freq_steps=2)
    evaluator = Evaluator(config, FT_SPEC)
    calls = []
    ran = [evaluator.evaluate(lambda g=g: calls.append(g), g // 3, g % 3, g) for g in range(4)]
    assert ran == [False, True, False, True]
    assert calls == [1, 3]
    assert evaluator.state_dict()["freq_ctl"]["steps"] == 0


# --- RecoverHandler ---


def _recover_config(tmp_path: Path, mode: str = "auto", **kwargs: Any) -> RecoverConfig:
    return RecoverConfig(fileroot=str(tmp_path), **NAMES, mode=mode, freq_steps=1, **kwargs)


DATALOADER_STATE = {
    "_num_yielded": 4,
    "_sampler_iter_state": {"epoch": 1, "seen": (2, 3)},
    "generator": torch.tensor([1, 2, 3], dtype=torch.uint8),
    0: "an int key",
    "raw": b"\x00\xff",
}


def _dump(handler: RecoverHandler, engine: FakeEngine, global_step: int, **kwargs: Any) -> bool:
    step = StepInfo(global_step // 3, global_step % 3, global_step, FT_SPEC.steps_per_epoch)
    return handler.dump(
        engine,
        step,
        kwargs.get("saver", FakeStateful({"saver": global_step})),
        kwargs.get("evaluator", FakeStateful({"evaluator": global_step})),
        kwargs.get("stats_logger", FakeStateful({"last_commit_step": global_step})),
        kwargs.get("dataloader", FakeStateful(DATALOADER_STATE)),
    )


def _load(handler: RecoverHandler, engine: FakeEngine, **kwargs: Any):
    objs = {name: FakeStateful() for name in ("saver", "evaluator", "stats_logger", "dataloader")}
    info = handler.load(engine, **objs, **kwargs)
    return info, objs


def test_recover_round_trip(tmp_path):
    handler = RecoverHandler(_recover_config(tmp_path), FT_SPEC)
    engine = FakeEngine("weights at step 4")
    assert _dump(handler, engine, global_step=4)
    assert engine.saved[0].weight_format == "dcp" and engine.saved[0].with_optim

    root = get_checkpoint_path(str(tmp_path), "exp", "trial")
    info_dir = root / "recover_info"
    assert sorted(p.name for p in info_dir.iterdir()) == [
        "checkpoint_info.json",
        "dataloader_info.json",
        "evaluator_info.json",
        "recover_stamp.json",
        "saver_info.json",
        "stats_logger_info.json",
        "step_info.json",
    ]
    assert json.loads((info_dir / "step_info.json").read_text()) == {
        "epoch": 1,
        "epoch_step": 1,
        "global_step": 4,
        "steps_per_epoch": 3,
    }
    json.loads((info_dir / "dataloader_info.json").read_text())  # plain JSON, no pickle
    assert sorted(p.name for p in (root / "default").iterdir()) == ["recover_checkpoint"]

    fresh_engine = FakeEngine()
    info, objs = _load(RecoverHandler(_recover_config(tmp_path), FT_SPEC), fresh_engine)
    assert isinstance(info, RecoverInfo)
    assert info.last_step_info == StepInfo(1, 1, 4, 3)
    assert info.last_step_info.next().global_step == 5
    assert fresh_engine.state == "weights at step 4"
    assert fresh_engine.loaded[0].weight_format == "dcp" and fresh_engine.loaded[0].with_optim
    assert fresh_engine.version == 5
    assert objs["saver"].state == {"saver": 4}
    assert objs["evaluator"].state == {"evaluator": 4}
    assert objs["stats_logger"].state == {"last_commit_step": 4}
    loaded = objs["dataloader"].state
    assert loaded["_sampler_iter_state"] == {"epoch": 1, "seen": (2, 3)}
    assert torch.equal(loaded["generator"], DATALOADER_STATE["generator"])
    assert loaded["generator"].dtype == torch.uint8
    assert loaded[0] == "an int key" and loaded["raw"] == b"\x00\xff"


def test_recover_optimizer_flags(tmp_path):
    config = _recover_config(tmp_path, no_save_optim=True, no_load_optim=True)
    engine = FakeEngine("w")
    _dump(RecoverHandler(config, FT_SPEC), engine, 0)
    assert engine.saved[0].with_optim is False
    _load(RecoverHandler(config, FT_SPEC), engine)
    assert engine.loaded[0].with_optim is False


def test_recover_frequency_and_checkpoint_info(tmp_path):
    config = RecoverConfig(fileroot=str(tmp_path), **NAMES, mode="on", freq_steps=2)
    handler = RecoverHandler(config, FT_SPEC)
    engine = FakeEngine()
    assert [_dump(handler, engine, g) for g in range(4)] == [False, True, False, True]
    restored = RecoverHandler(config, FT_SPEC)
    info, _ = _load(restored, FakeEngine())
    assert info.last_step_info.global_step == 3
    assert info.checkpoint_info["steps"] == 0
    assert restored.freq_ctl.state_dict()["steps"] == 0


@pytest.mark.parametrize("mode", ["disabled", "off"])
def test_recover_inactive_modes_neither_dump_nor_load(tmp_path, mode):
    handler = RecoverHandler(_recover_config(tmp_path, mode=mode), FT_SPEC)
    engine = FakeEngine()
    assert not _dump(handler, engine, 0)
    assert engine.saved == []
    _dump(RecoverHandler(_recover_config(tmp_path), FT_SPEC), engine, 0)
    assert _load(handler, FakeEngine())[0] is None


@pytest.mark.parametrize(("mode", "level"), [("on", "WARNING"), ("auto", "INFO")])
def test_recover_without_info_starts_fresh(tmp_path, mode, level):
    records: list[std_logging.LogRecord] = []
    handler_obj = std_logging.Handler()
    handler_obj.emit = records.append  # type: ignore[method-assign]
    log = std_logging.getLogger("areal.recover")
    log.addHandler(handler_obj)
    try:
        info, objs = _load(RecoverHandler(_recover_config(tmp_path, mode=mode), FT_SPEC), None)
    finally:
        log.removeHandler(handler_obj)
    assert info is None
    assert objs["saver"].state is None
    assert [r.levelname for r in records] == [level]
    assert "starting from scratch" in records[0].getMessage()


def test_recover_pushes_weights_to_inference_engine(tmp_path):
    config = _recover_config(tmp_path)
    _dump(RecoverHandler(config, FT_SPEC), FakeEngine("w"), 6)
    engine, rollout = FakeEngine(), FakeInferenceEngine()
    meta = WeightUpdateMeta(type="disk", path=str(tmp_path / "weight_update"))
    info, _ = _load(
        RecoverHandler(config, FT_SPEC),
        engine,
        inference_engine=rollout,
        weight_update_meta=meta,
    )
    assert info.last_step_info.global_step == 6
    assert rollout.calls == [("begin_weight_update", 7), ("end_weight_update", 7)]
    assert [(m.version, m.path) for m in engine.updates] == [
        (7, str(tmp_path / "weight_update_v7"))
    ]
    assert engine.version == 7


def test_recover_with_inference_engine_needs_meta(tmp_path):
    config = _recover_config(tmp_path)
    _dump(RecoverHandler(config, FT_SPEC), FakeEngine("w"), 0)
    with pytest.raises(ValueError, match="weight_update_meta"):
        _load(RecoverHandler(config, FT_SPEC), FakeEngine(), inference_engine=object())


# --- crash consistency ---


def _listing(tmp_path: Path) -> list[str]:
    root = get_checkpoint_path(str(tmp_path), "exp", "trial")
    return sorted(
        str(p.relative_to(root)) for p in [*root.iterdir(), *(root / "default").iterdir()]
    )


@pytest.mark.parametrize("failing", ["engine", "dataloader"])
def test_failed_dump_keeps_previous_recover_point(tmp_path, failing):
    config = _recover_config(tmp_path)
    _dump(RecoverHandler(config, FT_SPEC), FakeEngine("old"), 1)

    handler = RecoverHandler(config, FT_SPEC)
    engine = FakeEngine("new", fail_on_save=failing == "engine")
    dataloader = FakeStateful(DATALOADER_STATE, fail=failing == "dataloader")
    with pytest.raises(RuntimeError):
        _dump(handler, engine, 2, dataloader=dataloader)

    restored_engine = FakeEngine()
    info, objs = _load(RecoverHandler(config, FT_SPEC), restored_engine)
    assert info.last_step_info.global_step == 1
    assert restored_engine.state == "old"
    assert objs["saver"].state == {"saver": 1}
    assert _listing(tmp_path) == ["default", "default/recover_checkpoint", "recover_info"]


# Renames of a dump's commit: 1 ckpt final->prev, 2 ckpt staging->final,
# 3 info final->prev, 4 info staging->final. Both new directories are stamped before
# the first rename, so whichever rename a crash hits, the new point is complete and wins.
@pytest.mark.parametrize("failing_rename", [1, 2, 3, 4])
def test_crash_during_commit_leaves_one_complete_point(tmp_path, monkeypatch, failing_rename):
    config = _recover_config(tmp_path)
    _dump(RecoverHandler(config, FT_SPEC), FakeEngine("old"), 1)

    real_rename = Path.rename
    count = 0

    def crashing_rename(self: Path, target: Any) -> Path:
        nonlocal count
        count += 1
        if count == failing_rename:
            raise OSError("killed")
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", crashing_rename)
    with pytest.raises(OSError, match="killed"):
        _dump(RecoverHandler(config, FT_SPEC), FakeEngine("new"), 2)
    monkeypatch.setattr(Path, "rename", real_rename)

    engine = FakeEngine()
    info, _ = _load(RecoverHandler(config, FT_SPEC), engine)
    assert info.last_step_info.global_step == 2
    assert engine.state == "new"
    assert _listing(tmp_path) == ["default", "default/recover_checkpoint", "recover_info"]
