"""A rerun of a trial never duplicates steps in ``stats.jsonl``: it starts over or resumes."""

from __future__ import annotations

import json
from pathlib import Path

from areal.api.cli_args import StatsLoggerConfig
from areal.api.io_struct import FinetuneSpec
from areal.utils.paths import get_log_path
from areal.utils.stats_logger import STATS_FILE, StatsLogger

FT_SPEC = FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=2)


def _logger(root: Path) -> StatsLogger:
    config = StatsLoggerConfig(experiment_name="exp", trial_name="trial", fileroot=str(root))
    return StatsLogger(config, FT_SPEC, rank=0)


def _path(root: Path) -> Path:
    return get_log_path(str(root), "exp", "trial", create=False) / STATS_FILE


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["global_step"] for line in path.read_text().splitlines()]


def _run(root: Path, steps: range, resume_at: int | None = None, state=None) -> dict:
    logger = _logger(root)
    if state is not None:
        logger.load_state_dict(state)
    if resume_at is not None:
        logger.resume_at(resume_at)
    for step in steps:
        logger.commit(0, step, step, {"x": float(step)})
    state = logger.state_dict()
    logger.close()
    return state


def test_a_rerun_without_recover_starts_over_and_keeps_the_old_file_aside(tmp_path):
    _run(tmp_path, range(3))
    _run(tmp_path, range(2))  # `make demo` twice into the same directory
    assert _steps(_path(tmp_path)) == [0, 1]
    previous = _path(tmp_path).with_name("stats.jsonl.prev")
    assert _steps(previous) == [0, 1, 2]


def test_a_resumed_run_drops_the_rows_of_the_steps_it_runs_again(tmp_path):
    # the trainer dumps its recover point before committing the step, so the point of
    # step 1 holds the logger state after step 0; the run logged step 2 and was killed
    state_at_dump = _run(tmp_path, range(1))
    _run(tmp_path, range(1, 3), state=state_at_dump)
    _run(tmp_path, range(2, 4), resume_at=2, state=state_at_dump)
    assert _steps(_path(tmp_path)) == [0, 1, 2, 3]
