"""``submit_arena.sh --check-arena`` refuses configs the trainer cannot run, before Arena.

Each case composes a small YAML on a copy of ``arena_grpo.yaml`` (Hydra resolves
``defaults`` against the case file's own directory) and runs the whole chain of
``test_submit_arena.py``: stub sbatch running the controller job synchronously, the
container stand-in, and the python stub handing the run-mode step to this interpreter.
Arena is a socket that listens but never answers: an attempted request would show up as
a pending connection.
"""

from __future__ import annotations

import shutil
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from areal.api.cli_args import ConfigError
from tests.conftest import REPO_ROOT, SWE_DIR
from tests.unit.examples.test_submit_arena import CHECKOUT_SCRIPT, JOB_ID, Site

HEAD = "defaults:\n  - arena_grpo\n  - _self_\n"
# One case per check of areal/api/config/support.py (its variants are unit-tested in
# tests/unit/api/test_support.py): id -> (YAML on top of arena_grpo, field, fix phrase).
CASES = {
    "awex": (
        "actor:\n  weight_update_mode: awex\n",
        "actor.weight_update_mode",
        "set rollout.scheduling_strategy: {type: colocation, target: actor, fork: true}",
    ),
    "context-parallel-budget": (
        "actor:\n  backend: megatron:(attn:d1p1t2c4|ffn:d1e8)\n  mb_spec:\n"
        "    max_tokens_per_mb: 7\n",
        "actor.mb_spec.max_tokens_per_mb",
        "set actor.mb_spec.max_tokens_per_mb to at least 8",
    ),
    "fsdp-tp": (
        "actor:\n  backend: fsdp:d4t2\n",
        "actor.backend",
        "use 'fsdp:d8' (d and c only) or a megatron backend",
    ),
    "colocation-shape": (
        "rollout:\n  backend: sglang:d8p1t2\n  scheduling_strategy:\n    type: colocation\n"
        "    target: actor\n",
        "rollout.backend",
        "set rollout.backend: 'sglang:d4p1t2' or rollout.scheduling_strategy.type: separation",
    ),
    "lora": ("actor:\n  use_lora: true\n", "actor.use_lora", "set actor.use_lora: false"),
    "sglang-flag": (
        "sglang:\n  enable_ep_moe: true\n",
        "sglang.enable_ep_moe",
        "use sglang.ep_size for expert parallelism",
    ),
    "context-length": (
        "gconfig:\n  max_tokens: 32768\n",
        "gconfig.max_tokens",
        "set gconfig.max_tokens: 32767 (context_length - 1)",
    ),
    "consumer-batch": (
        "rollout:\n  consumer_batch_size: 4\n",
        "rollout.consumer_batch_size",
        "set rollout.consumer_batch_size: 8",
    ),
    "xccl-pp": (
        "rollout:\n  backend: sglang:d2p2t2\n",
        "actor.weight_update_mode",
        "set actor.weight_update_mode: disk, or p1 in rollout.backend",
    ),
    "batch-below-dp": (
        "train_dataset:\n  batch_size: 4\n",
        "train_dataset.batch_size",
        "set train_dataset.batch_size to at least 8",
    ),
}


@pytest.fixture
def site(tmp_path: Path) -> Site:
    site = Site(tmp_path)
    site.stub(
        "sbatch", stdout=f"{JOB_ID}\n", run_batch_job=True, spool=str(site.spool), job_id=JOB_ID
    )
    site.stub("python", passthrough=sys.executable)
    return site


@pytest.fixture
def silent_arena(site: Site) -> Iterator[socket.socket]:
    """A listening socket that never accepts, as ARENA_OPENAPI_BASE of the credentials."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        sock.setblocking(False)
        site.write_credentials(ARENA_OPENAPI_BASE=f"http://127.0.0.1:{sock.getsockname()[1]}")
        yield sock


def case_file(root: Path, name: str) -> Path:
    directory = root / "configs"
    directory.mkdir(exist_ok=True)
    shutil.copy(SWE_DIR / "arena_grpo.yaml", directory)
    path = directory / f"{name}.yaml"
    path.write_text(HEAD + CASES[name][0])
    return path


def assert_refused_before_arena(site: Site, arena: socket.socket, config: str) -> str:
    """The controller job failed in the run-mode step; nothing else ran. Returns its log."""
    assert (site.spool / "exit_code").read_text() != "0"
    [submit] = site.calls("sbatch")  # the controller job only, no worker job
    assert submit["argv"][-2:] == [CHECKOUT_SCRIPT, "--controller"]
    [step] = site.calls("python")  # the config step; no trainer
    assert step["argv"] == ["-", config]
    with pytest.raises(BlockingIOError):
        arena.accept()  # no connection was ever made to Arena
    assert not (site.submission_dir / "preflight.json").exists()
    log = (site.submission_dir / f"controller-{JOB_ID}.log").read_text()
    assert "this port's trainer cannot run this config" in log
    assert "Arena preflight passed" not in log
    return log


@pytest.mark.parametrize("name", list(CASES))
def test_check_arena_refuses_before_preflight(site, silent_arena, name):
    config = str(case_file(site.root, name))
    _, field, fix = CASES[name]
    done = site.run("--check-arena", CONFIG_PATH=config)
    assert done.returncode == 0, done.stderr  # sbatch took the controller job
    log = assert_refused_before_arena(site, silent_arena, config)
    [line] = [line for line in log.splitlines() if line.startswith(f"  {field}: ")]
    assert fix in line


def test_full_submission_never_starts_the_trainer(site, silent_arena):
    config = str(case_file(site.root, "awex"))
    done = site.run(CONFIG_PATH=config)  # no --check-arena: training would follow
    assert done.returncode == 0, done.stderr
    log = assert_refused_before_arena(site, silent_arena, config)
    assert "  actor.weight_update_mode: awex hands tensors to the servers by handle" in log


def test_flash_v3_check_arena_passes_the_config_checks(site):
    """Nothing of the full profile is refused any more: the controller job goes on to the
    Arena preflight (here an address where nobody listens, so that step fails fast)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    site.write_credentials(ARENA_OPENAPI_BASE=f"http://127.0.0.1:{port}")
    awex, fla = site.root / "src" / "awex", site.root / "src" / "fla"
    awex.mkdir(parents=True)
    fla.mkdir()
    done = site.run(
        "--check-arena",
        script=SWE_DIR / "submit_arena_flash_v3.sh",
        CONFIG_PATH=None,  # the wrapper's default, examples/swe/arena_flash_v3.yaml
        ROLLOUT_IMAGE=str(site.image),
        AWEX_ROOT=str(awex),
        FLASH_LINEAR_ATTENTION_ROOT=str(fla),
    )
    assert done.returncode == 0, done.stderr
    log = (site.submission_dir / f"controller-{JOB_ID}.log").read_text()
    assert "this port's trainer cannot run this config" not in log, log[-3000:]
    assert "Arena preflight GET /streams/" in log, log[-3000:]  # it went on to ask Arena
    assert "(ConnectError)" in log


# --- the training entry points refuse before anything starts ---


def test_train_swe_rl_refuses_before_the_local_arena_and_the_trainer(profile_env, monkeypatch):
    from examples.swe import train_swe_rl

    def must_not_run(*args, **kwargs):
        raise AssertionError("reached past the config check")

    monkeypatch.setattr(train_swe_rl, "local_arena_if_requested", must_not_run)
    monkeypatch.setattr(train_swe_rl, "PPOTrainer", must_not_run)
    argv = ["--config", str(SWE_DIR / "arena_multi_stream.yaml"), "actor.use_lora=true"]
    with pytest.raises(ConfigError, match=r"\n  actor\.use_lora: .*set actor\.use_lora: false"):
        train_swe_rl.main(argv)


def test_toy_train_refuses_before_building_the_model(profile_env, monkeypatch):
    from examples.toy import train

    monkeypatch.setattr(train, "build_inputs", lambda config: pytest.fail("built the inputs"))
    argv = ["--config", str(REPO_ROOT / "examples" / "toy" / "toy_grpo.yaml")]
    with pytest.raises(ConfigError, match=r"\n  rollout\.consumer_batch_size: 2 is smaller"):
        train.main([*argv, "rollout.consumer_batch_size=2"])
