"""A recover checkpoint that fills the disk fails the step naming the path and the OS
error, within seconds, and a resumed run loads the last complete recover point instead.

Real pieces: an FSDP actor (the tiny model) on a worker of the local scheduler, the
recover handler the trainer uses, and a real full disk (a small tmpfs, filled up).
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest

from areal.api.cli_args import (
    BaseExperimentConfig,
    ClusterSpecConfig,
    NameResolveConfig,
    OptimizerConfig,
    PPOActorConfig,
    RecoverConfig,
    SchedulingSpec,
)
from areal.api.io_struct import FinetuneSpec
from areal.api.scheduler_api import RPC_TOKEN_ENV
from areal.infra.controller.train_controller import TrainController
from areal.infra.scheduler.local import LocalScheduler
from areal.utils import name_resolve
from areal.utils.recover import RecoverHandler, StepInfo
from tests.helpers.small_disk import small_tmpfs

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]
ACTOR = "areal.trainer.ppo.actor.FSDPPPOActor"
FT_SPEC = FinetuneSpec(total_train_epochs=1, dataset_size=16, train_batch_size=4)
REPORTED_WITHIN = 30.0  # seconds from the start of the save to the error


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs, unmounted afterwards."""
    with small_tmpfs(tmp_path / "disk", "4m") as mount_point:
        yield mount_point


@pytest.fixture
def actor(tmp_path, tiny_model_dir, monkeypatch):
    """One FSDP rank of the tiny model on a real worker."""
    monkeypatch.delenv(RPC_TOKEN_ENV, raising=False)
    monkeypatch.chdir(REPO_ROOT)
    experiment = BaseExperimentConfig(
        experiment_name="faults",
        trial_name="disk",
        cluster=ClusterSpecConfig(
            fileroot=str(tmp_path / "files"),
            name_resolve=NameResolveConfig(nfs_record_root=str(tmp_path / "name_resolve")),
        ),
    )
    scheduler = LocalScheduler(experiment, gpu_devices=[], stop_grace=5.0)
    config = PPOActorConfig(
        experiment_name="faults",
        trial_name="disk",
        path=str(tiny_model_dir),
        dtype="float32",
        optimizer=OptimizerConfig(type="adam", lr=1e-3),
    )
    controller = TrainController(ACTOR, config, scheduler, role="actor")
    try:
        controller.initialize(1, SchedulingSpec(cpu=1, mem=4, port_count=2), FT_SPEC)
        yield controller
    finally:
        controller.destroy()
        scheduler.delete_workers()
        name_resolve.reconfigure("memory")


def test_a_full_disk_names_the_path_and_resume_skips_the_partial_point(small_disk, actor):
    config = RecoverConfig(
        experiment_name="faults", trial_name="disk", fileroot=str(small_disk), mode="on"
    )
    config.freq_steps = 1
    handler = RecoverHandler(config, FT_SPEC)
    assert handler.dump(actor, StepInfo(0, 0, 0, 4), None, None, None, None)
    checkpoint = handler.checkpoint_dir()
    size = sum(f.stat().st_size for f in checkpoint.rglob("*") if f.is_file())
    # another file takes the disk but for half a checkpoint: the next save cannot fit
    ballast = small_disk / "ballast"
    ballast.write_bytes(b"\0" * (shutil.disk_usage(small_disk).free - size // 2))

    began = time.monotonic()
    with pytest.raises(Exception) as failure:
        handler.dump(actor, StepInfo(0, 1, 1, 4), None, None, None, None)
    seconds = time.monotonic() - began
    message = str(failure.value)
    print(f"reported {seconds:.1f} s after the save began: {message}")
    assert f"{checkpoint}.staging" in message and "No space left on device" in message
    assert seconds < REPORTED_WITHIN

    # --- the point being written is never loaded: a resumed run gets step 0's ---
    info = RecoverHandler(config, FT_SPEC).load(actor, None, None, None, None)
    assert info is not None and info.last_step_info.global_step == 0
    assert not list(small_disk.rglob("*.staging"))
