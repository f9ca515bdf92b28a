"""``make demo`` run twice into the same directory starts clean (or resumes, when asked)."""

from __future__ import annotations

import getpass

from examples.swe.demo import EXPERIMENT, clear_previous_run, recovers


def test_a_demo_rerun_removes_the_previous_run_of_its_trial_only(tmp_path):
    user = getpass.getuser()
    mine = [
        tmp_path / "logs" / user / EXPERIMENT / "demo",
        tmp_path / EXPERIMENT / "demo" / "arena_results",
        tmp_path / "checkpoints" / user / EXPERIMENT / "demo" / "recover_info",
        tmp_path / "local_arena" / EXPERIMENT / "demo",
    ]
    kept = [tmp_path / "logs" / user / EXPERIMENT / "other", tmp_path / "models" / "smollm2"]
    for path in mine + kept:
        path.mkdir(parents=True)
        (path / "stats.jsonl").write_text('{"global_step": 0}\n')

    removed = clear_previous_run(tmp_path, "demo")

    assert len(removed) == 4
    assert not any(path.exists() for path in mine)
    assert all((path / "stats.jsonl").exists() for path in kept)
    assert clear_previous_run(tmp_path, "demo") == []  # a first run has nothing to remove


def test_a_demo_rerun_with_recover_on_resumes_instead():
    assert recovers(["recover.mode=auto", "total_train_steps=5"])
    assert recovers(["recover.mode=on"])
    assert not recovers(["recover.mode=auto", "recover.mode=disabled"])  # the last one wins
    assert not recovers([])
