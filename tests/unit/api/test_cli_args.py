"""load_expr_config: Hydra composition, overrides, key checking, env resolution, saving."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from areal.api.cli_args import (
    ConfigError,
    GRPOConfig,
    PPOConfig,
    SGLangConfig,
    conf_as_dict,
    get_py_cmd,
    load_expr_config,
    parse_cli_args,
    save_config,
)
from areal.utils.paths import get_log_path
from tests.conftest import REPO_ROOT, SECRET_SENTINEL

BASE_YAML = """\
experiment_name: unit
trial_name: t0
cluster:
  fileroot: {fileroot}
  name_resolve:
    type: nfs
    nfs_record_root: {fileroot}/name_resolve
train_dataset:
  path: /data/train.jsonl
  type: rl
  batch_size: 4
gconfig:
  n_samples: 2
rollout:
  backend: hf:d1
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
actor:
  backend: fsdp:d1
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  eps_clip: 0.3
  optimizer:
    lr: "1e-5"
  scheduling_spec:
    - cpu: 2
      mem: 4
    - cpu: 1
      mem: 2
saver:
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
evaluator:
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
recover:
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
stats_logger:
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
"""


@pytest.fixture
def conf_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("RANK", raising=False)
    d = tmp_path / "conf"
    d.mkdir()
    (d / "base.yaml").write_text(BASE_YAML.format(fileroot=tmp_path / "fileroot"))
    return d


def write(conf_dir: Path, name: str, text: str) -> Path:
    path = conf_dir / f"{name}.yaml"
    path.write_text(text)
    return path


def load(path: Path, *overrides: str, cls: type = PPOConfig):
    cfg, _ = load_expr_config(["--config", str(path), *overrides], cls)
    return cfg


# --- basic loading and typing ---


def test_loads_typed_dataclasses(conf_dir):
    cfg = load(conf_dir / "base.yaml")
    assert isinstance(cfg, PPOConfig)
    assert cfg.actor.eps_clip == 0.3
    assert cfg.actor.optimizer.lr == pytest.approx(1e-5)  # "1e-5" coerced to float
    assert isinstance(cfg.actor.scheduling_spec, tuple)
    assert [s.cpu for s in cfg.actor.scheduling_spec] == [2, 1]
    assert cfg.actor.scheduling_spec[0].gpu == 0  # dataclass default for omitted keys
    assert cfg.rollout.experiment_name == "unit"
    assert cfg.eval_gconfig == cfg.gconfig and cfg.eval_gconfig is not cfg.gconfig
    assert cfg.ref is None


def test_grpo_config_is_ppo_config(conf_dir):
    cfg = load(conf_dir / "base.yaml", cls=GRPOConfig)
    assert isinstance(cfg, GRPOConfig) and isinstance(cfg, PPOConfig)


def test_returns_absolute_config_path(conf_dir, monkeypatch):
    monkeypatch.chdir(conf_dir)
    _, path = load_expr_config(["--config", "base.yaml"], PPOConfig)
    assert path == str(conf_dir / "base.yaml")


def test_missing_config_file(conf_dir):
    with pytest.raises(ConfigError, match="no such file"):
        load(conf_dir / "nope.yaml")


def test_config_flag_is_required(conf_dir):
    with pytest.raises(SystemExit):
        load_expr_config(["actor.eps_clip=1"], PPOConfig)


# --- unknown keys are errors naming the dotted path ---


def test_unknown_top_level_key(conf_dir):
    path = write(conf_dir, "typo", "defaults: [base, _self_]\nexperimnt_name: x\n")
    with pytest.raises(
        ConfigError, match=r"unknown config key 'experimnt_name'.*did you mean 'experiment_name'"
    ):
        load(path)


def test_unknown_nested_key_names_full_path(conf_dir):
    path = write(conf_dir, "typo", "defaults: [base, _self_]\nactor:\n  optimizer:\n    lrr: 1\n")
    with pytest.raises(
        ConfigError, match=r"'actor\.optimizer\.lrr'.*OptimizerConfig.*did you mean 'lr'"
    ):
        load(path)


def test_unknown_key_inside_list_item(conf_dir):
    path = write(
        conf_dir, "typo", "defaults: [base, _self_]\nactor:\n  scheduling_spec:\n    - cpuu: 1\n"
    )
    with pytest.raises(ConfigError, match=r"'actor\.scheduling_spec\[0\]\.cpuu'"):
        load(path)


def test_removed_launcher_section(conf_dir):
    path = write(conf_dir, "legacy", "defaults: [base, _self_]\nlauncher:\n  trainer_port: 1\n")
    with pytest.raises(ConfigError, match=r"'launcher' was removed.*scheduling_spec"):
        load(path)


def test_legacy_behave_imp_weight_keys(conf_dir):
    path = write(
        conf_dir, "legacy", "defaults: [base, _self_]\nactor:\n  behave_imp_weight_cap: 5\n"
    )
    with pytest.raises(ConfigError, match=r"actor\.behave_imp_weight_cap.*rejection_sampling"):
        load(path)


def test_bad_value_type_names_path(conf_dir):
    with pytest.raises(ConfigError, match=r"'actor\.eps_clip'.*could not be converted"):
        load(conf_dir / "base.yaml", "actor.eps_clip=wide")


def test_validation_error_names_nested_path(conf_dir):
    with pytest.raises(ConfigError, match=r"^actor\.rejection_sampling\.upper: must be > 1\.0"):
        load(conf_dir / "base.yaml", "+actor.rejection_sampling.upper=0.5")


@pytest.mark.parametrize("field", ["tool_call_parser", "reasoning_parser"])
def test_unknown_parser_name_is_refused_at_load(conf_dir, field):
    pattern = rf"^rollout\.agent\.{field}: 'ling-3' is not a .* parser.*native: .*ling3"
    with pytest.raises(ConfigError, match=pattern):
        load(conf_dir / "base.yaml", f"rollout.agent.{field}=ling-3")
    cfg = load(conf_dir / "base.yaml", f"rollout.agent.{field}=ling3")
    assert getattr(cfg.rollout.agent, field) == "ling3"


def test_missing_required_value(conf_dir):
    with pytest.raises(ConfigError, match=r"'actor\.backend' is required"):
        load(conf_dir / "base.yaml", "~actor.backend")


# --- environment interpolation ---


def test_missing_env_var_names_it(conf_dir, monkeypatch):
    monkeypatch.delenv("UNIT_MODEL_DIR", raising=False)
    path = write(
        conf_dir, "env", "defaults: [base, _self_]\nactor:\n  path: ${oc.env:UNIT_MODEL_DIR}\n"
    )
    with pytest.raises(ConfigError, match=r"'actor\.path'.*environment variable UNIT_MODEL_DIR"):
        load(path)


def test_env_var_with_default_and_typing(conf_dir, monkeypatch):
    path = write(
        conf_dir,
        "env",
        "defaults: [base, _self_]\n"
        "train_dataset:\n  batch_size: ${oc.env:UNIT_BS,16}\n  shuffle: ${oc.env:UNIT_SHUF,true}\n"
        'actor:\n  path: ${oc.env:UNIT_MODEL_DIR,""}\n',
    )
    monkeypatch.delenv("UNIT_BS", raising=False)
    monkeypatch.delenv("UNIT_MODEL_DIR", raising=False)
    monkeypatch.setenv("UNIT_SHUF", "false")
    cfg = load(path)
    assert cfg.train_dataset.batch_size == 16 and type(cfg.train_dataset.batch_size) is int
    assert cfg.train_dataset.shuffle is False
    assert cfg.actor.path == ""
    monkeypatch.setenv("UNIT_BS", "64")
    assert load(path).train_dataset.batch_size == 64


def test_shell_style_dollar_is_left_for_the_worker(conf_dir):
    path = write(
        conf_dir,
        "shell",
        "defaults: [base, _self_]\nactor:\n  scheduling_spec:\n"
        "    - additional_bash_cmds: ['source \"$ARENA_CREDENTIALS_FILE\"']\n",
    )
    cfg = load(path)
    assert cfg.actor.scheduling_spec[0].additional_bash_cmds == ['source "$ARENA_CREDENTIALS_FILE"']


# --- Hydra defaults and overrides ---


def test_defaults_list_merges_maps_and_replaces_lists(conf_dir):
    path = write(
        conf_dir,
        "child",
        "defaults:\n  - base\n  - _self_\n"
        "actor:\n  eps_clip: 0.25\n  scheduling_spec:\n    - cpu: 7\n",
    )
    cfg = load(path)
    assert cfg.actor.eps_clip == 0.25
    assert cfg.actor.optimizer.lr == pytest.approx(1e-5)  # inherited key of a merged map
    assert [s.cpu for s in cfg.actor.scheduling_spec] == [7]  # list replaced wholesale


def test_override_existing_key(conf_dir):
    assert load(conf_dir / "base.yaml", "actor.eps_clip=0.1").actor.eps_clip == 0.1


def test_override_list_index(conf_dir):
    cfg = load(conf_dir / "base.yaml", "actor.scheduling_spec.1.cpu=9")
    assert [s.cpu for s in cfg.actor.scheduling_spec] == [2, 9]


def test_plus_adds_a_key_absent_from_yaml(conf_dir):
    assert load(conf_dir / "base.yaml", "+actor.c_clip=3").actor.c_clip == 3.0


def test_plain_override_of_field_absent_from_yaml(conf_dir):
    # Hydra alone demands '+'; a dataclass field is accepted without it.
    assert load(conf_dir / "base.yaml", "actor.c_clip=3").actor.c_clip == 3.0
    cfg = load(conf_dir / "base.yaml", "actor.rejection_sampling.upper=4")
    assert cfg.actor.rejection_sampling.upper == 4.0


def test_tilde_deletes_back_to_default(conf_dir):
    assert load(conf_dir / "base.yaml", "~actor.eps_clip").actor.eps_clip == 0.2


def test_list_override_syntax(conf_dir):
    cfg = load(conf_dir / "base.yaml", "gconfig.stop_token_ids=[5,6]")
    assert cfg.gconfig.stop_token_ids == [5, 6]


def test_plus_of_unknown_key_is_rejected(conf_dir):
    with pytest.raises(ConfigError, match=r"unknown config key 'actor\.eps_clipp'.*'eps_clip'"):
        load(conf_dir / "base.yaml", "+actor.eps_clipp=0.1")


def test_plain_override_of_unknown_key_is_rejected(conf_dir):
    with pytest.raises(ConfigError, match=r"unknown config key 'gconfig\.n_sample'.*'n_samples'"):
        load(conf_dir / "base.yaml", "gconfig.n_sample=3")


def test_unparseable_override(conf_dir):
    with pytest.raises(ConfigError, match="override"):
        load(conf_dir / "base.yaml", "actor.eps_clip=[1")


# --- argv forms ---


def test_leading_script_path_is_dropped(conf_dir):
    composed, path = parse_cli_args(["train.py", "--config", str(conf_dir / "base.yaml")])
    assert path == conf_dir / "base.yaml"
    assert composed.experiment_name == "unit"


@pytest.mark.parametrize("form", ["module", "script"])
def test_real_command_lines(conf_dir, form):
    prefix = (
        [sys.executable, "-m", "tests.helpers.print_config"]
        if form == "module"
        else [sys.executable, str(REPO_ROOT / "tests" / "helpers" / "print_config.py")]
    )
    env = {**os.environ, "RANK": "0"}
    out = subprocess.run(
        [*prefix, "--config", str(conf_dir / "base.yaml"), "actor.eps_clip=0.11", "trial_name=t9"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"path": str(conf_dir / "base.yaml"), "eps_clip": 0.11, "trial": "t9"}


# --- saving and dict conversion ---


def test_saved_config_contains_no_planted_secret(conf_dir):
    cfg = load(
        conf_dir / "base.yaml",
        f"rollout.agent.admin_api_key={SECRET_SENTINEL}",
        f"stats_logger.swanlab.api_key={SECRET_SENTINEL}",
        f"+scheduler.reward_functioncall_config.auth_token={SECRET_SENTINEL}",
    )
    saved = get_log_path(str(conf_dir.parent / "fileroot"), "unit", "t0") / "config.yaml"
    text = saved.read_text()
    assert SECRET_SENTINEL not in text
    data = yaml.safe_load(text)
    assert data["rollout"]["agent"]["admin_api_key"] == "<redacted>"
    assert data["stats_logger"]["swanlab"]["api_key"] == "<redacted>"
    assert data["scheduler"]["reward_functioncall_config"]["auth_token"] == "<redacted>"
    assert cfg.rollout.agent.admin_api_key == SECRET_SENTINEL


def test_save_config_round_trips_through_the_loader(conf_dir, tmp_path):
    cfg = load(conf_dir / "base.yaml")
    out = save_config(cfg, tmp_path / "saved")
    reloaded, _ = load_expr_config(["--config", str(out)], PPOConfig)
    assert reloaded.actor == cfg.actor
    assert reloaded.gconfig == cfg.gconfig


def test_conf_as_dict(conf_dir):
    cfg = load(conf_dir / "base.yaml")
    d = conf_as_dict(cfg)
    assert d["actor"]["eps_clip"] == 0.3
    assert isinstance(d["actor"]["scheduling_spec"], list)
    assert conf_as_dict(OmegaConf.create({"a": 1, "b": "${a}"})) == {"a": 1, "b": 1}


# --- command helpers ---


def test_get_py_cmd():
    cmd = get_py_cmd(
        "pkg.server",
        {
            "model_path": "/m",
            "tp_size": 2,
            "flag_on": True,
            "flag_off": False,
            "none": None,
            "empty": "",
            "no_items": [],
            "items": [1, 2],
        },
    )
    assert cmd == [
        "python3",
        "-m",
        "pkg.server",
        "--model-path",
        "/m",
        "--tp-size",
        "2",
        "--flag-on",
        "--items",
        "1",
        "2",
    ]


def test_sglang_build_cmd():
    cfg = SGLangConfig(
        model_path="/m",
        skip_tokenizer_init=True,
        context_length=32768,
        enable_multithread_load=True,
    )
    args = SGLangConfig.build_args(cfg, tp_size=2, base_gpu_id=4, host="10.0.0.1", port=3000)
    assert args["tokenizer_path"] == "/m" and args["tp_size"] == 2 and args["base_gpu_id"] == 4
    assert args["trust_remote_code"] is True and args["is_embedding"] is False
    assert args["nnodes"] == 1 and args["node_rank"] == 0
    assert json.loads(args["model_loader_extra_config"]) == {"enable_multithread_load": True}
    assert "enable_multithread_load" not in args and "pp_size" not in args
    cmd = SGLangConfig.build_cmd(
        cfg, tp_size=2, base_gpu_id=4, host="10.0.0.1", port=3000, pp_size=2
    )
    assert cmd[:3] == ["python3", "-m", "sglang.launch_server"]
    joined = " ".join(cmd)
    assert "--skip-tokenizer-init" in cmd and "--disable-radix-cache" in cmd
    assert "--tp-size 2" in joined and "--pp-size 2" in joined and "--port 3000" in joined
    assert "--host 10.0.0.1" in joined and "--context-length 32768" in joined
    assert "--dist-init-addr" not in joined  # None values are omitted
    assert "--enable-torch-compile" not in joined  # False values are omitted
    no_host = SGLangConfig.build_args(cfg, tp_size=1, base_gpu_id=0)
    assert "host" not in no_host and "port" not in no_host
