"""Names that become paths stay one path part, and dumps are never written through links.

``experiment_name``, ``trial_name``, worker role names, Stream names and dump task ids end
up as directory or file names under ``fileroot``; ``../x`` or ``a/b`` in any of them
would write outside it. Trajectory dumps refuse a symlink planted anywhere under the dump
root instead of following it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch

from areal.api.cli_args import ConfigError, PPOConfig, load_expr_config
from areal.api.config.experiment import (
    BaseExperimentConfig,
    PerfTracerConfig,
    SaverConfig,
    StatsLoggerConfig,
)
from areal.api.config.fields import FieldError
from areal.utils import names
from areal.utils.paths import get_checkpoint_path, get_log_path
from areal.utils.trajectory_dump import DumpPathError, dump_trajectories
from examples.swe.arena_config import parse_arena_stream_config

BAD_NAMES = ["../evil", "a/b", "..", ".", "x\0y", ".hidden", "-rf", "a b", "", "x" * 129]

MINIMAL_YAML = """\
experiment_name: unit
trial_name: t0
cluster:
  fileroot: {fileroot}
  name_resolve: {{type: nfs, nfs_record_root: {fileroot}/name_resolve}}
train_dataset: {{path: /data/train.jsonl, type: rl}}
rollout: {{backend: "hf:d1"}}
actor: {{backend: "fsdp:d1", experiment_name: unit, trial_name: t0}}
saver: {{experiment_name: "${{experiment_name}}", trial_name: "${{trial_name}}", fileroot: x}}
evaluator: {{experiment_name: "${{experiment_name}}", trial_name: "${{trial_name}}", fileroot: x}}
recover: {{experiment_name: "${{experiment_name}}", trial_name: "${{trial_name}}", fileroot: x}}
stats_logger:
  experiment_name: "${{experiment_name}}"
  trial_name: "${{trial_name}}"
  fileroot: {fileroot}
"""


# --- experiment and trial names ---


@pytest.mark.parametrize("bad", BAD_NAMES)
@pytest.mark.parametrize("field", ["experiment_name", "trial_name"])
def test_config_nodes_refuse_unsafe_names(field, bad):
    good = {"experiment_name": "exp", "trial_name": "t0"}
    for node in (BaseExperimentConfig, StatsLoggerConfig, SaverConfig, PerfTracerConfig):
        extra = {} if node is BaseExperimentConfig else {"fileroot": "/tmp/x"}
        with pytest.raises(FieldError) as info:
            node(**{**good, field: bad}, **extra)
        assert info.value.field == field, node


@pytest.mark.parametrize("field", ["experiment_name", "trial_name"])
def test_load_refuses_a_trial_name_that_climbs_out_of_fileroot(tmp_path, monkeypatch, field):
    monkeypatch.delenv("RANK", raising=False)
    fileroot = tmp_path / "root" / "fileroot"
    config = tmp_path / "conf.yaml"
    config.write_text(MINIMAL_YAML.format(fileroot=fileroot))
    assert load_expr_config(["--config", str(config)], PPOConfig)[0].trial_name == "t0"
    with pytest.raises(ConfigError, match=rf"{field}: '\.\./\.\./\.\./escaped' must not contain"):
        load_expr_config(["--config", str(config), f"{field}=../../../escaped"], PPOConfig)
    assert not (tmp_path / "escaped").exists() and not (tmp_path / "root" / "escaped").exists()


@pytest.mark.parametrize("bad", ["../evil", "a/b", ".."])
def test_path_helpers_refuse_unsafe_names(tmp_path, bad):
    for helper in (get_log_path, get_checkpoint_path):
        with pytest.raises(ValueError, match="trial_name"):
            helper(str(tmp_path), "exp", bad)
        with pytest.raises(ValueError, match="experiment_name"):
            helper(str(tmp_path), bad, "t0")
    with pytest.raises(ValueError, match="trial_name"):
        names.gen_servers("exp", bad)
    assert list(tmp_path.iterdir()) == []


# --- role names, Stream names ---


@pytest.mark.parametrize("bad", ["../actor", "actor/../../x", "..", ""])
def test_worker_role_names_stay_one_key_part(bad):
    with pytest.raises(ValueError, match="role"):
        names.worker("exp", "t0", bad, 0)
    assert names.worker("exp", "t0", "eval-rollout", 1).endswith("/exp/t0/workers/eval-rollout/1")


@pytest.mark.parametrize("bad", ["..", "...", ".x", "-x", "x" * 129])
def test_stream_names_stay_one_path_part(bad):
    with pytest.raises(ValueError, match="Arena Stream name"):
        parse_arena_stream_config({"name": bad, "stream_id": "s"})
    assert parse_arena_stream_config({"name": "math.v2-a_b", "stream_id": "s"}).name


# --- trajectory dumps ---


def group() -> dict[str, torch.Tensor]:
    return {
        "input_ids": torch.tensor([[1, 2, 3]]),
        "attention_mask": torch.tensor([[1, 1, 1]]),
        "loss_mask": torch.tensor([[0, 1, 1]]),
        "versions": torch.tensor([[-1, 2, 2]]),
        "rewards": torch.tensor([1.0]),
    }


@pytest.mark.parametrize(
    ("role", "task_id", "field"),
    [("../rollout", "t", "role"), ("rollout", "../../t", "task_id"), ("a/b", "t", "role")],
)
def test_dump_names_stay_under_the_root(tmp_path, role, task_id, field):
    root = tmp_path / "dumps"
    with pytest.raises(DumpPathError, match=f"trajectory dump {field}: "):
        dump_trajectories(group(), None, root, role, task_id)
    assert set(os.listdir(tmp_path)) <= {"dumps"}


@pytest.mark.parametrize("planted", ["role", "version", "file"])
def test_dumps_refuse_planted_symlinks(tmp_path, planted):
    root, outside = tmp_path / "dumps", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    victim = outside / "victim.jsonl"
    victim.write_text("precious\n")
    if planted == "role":
        (root / "rollout").symlink_to(outside, target_is_directory=True)
    elif planted == "version":
        (root / "rollout").mkdir()
        (root / "rollout" / "2").symlink_to(outside, target_is_directory=True)
    else:
        (root / "rollout" / "2").mkdir(parents=True)
        (root / "rollout" / "2" / "t.jsonl").symlink_to(victim)
    with pytest.raises(DumpPathError, match="symbolic link"):
        dump_trajectories(group(), None, root, "rollout", "t")
    assert victim.read_text() == "precious\n"
    assert sorted(p.name for p in outside.iterdir()) == ["victim.jsonl"]


def test_dumps_refuse_a_hard_link_and_write_private_files(tmp_path):
    root = tmp_path / "dumps"
    (root / "rollout" / "2").mkdir(parents=True)
    victim = tmp_path / "victim.jsonl"
    victim.write_text("precious\n")
    os.link(victim, root / "rollout" / "2" / "t.jsonl")
    with pytest.raises(DumpPathError, match="hard link"):
        dump_trajectories(group(), None, root, "rollout", "t")
    assert victim.read_text() == "precious\n"
    written = dump_trajectories(group(), None, tmp_path / "fresh", "rollout", "t")
    assert written == tmp_path / "fresh" / "rollout" / "2" / "t.jsonl"
    assert stat.S_IMODE(os.stat(written).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(written.parent).st_mode) == 0o700
    assert Path(written).read_text().count("\n") == 1
