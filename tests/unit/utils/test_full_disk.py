"""Checkpoint writes on a really full disk (a small tmpfs): the error names the path and
``No space left on device``, and a recover point cut short is never loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from areal.api.cli_args import RecoverConfig
from areal.api.io_struct import FinetuneSpec, SaveLoadMeta
from areal.engine.checkpoint import write_error
from areal.utils.recover import RecoverHandler, RecoverWriteError, StepInfo
from tests.helpers.small_disk import small_tmpfs

FT_SPEC = FinetuneSpec(total_train_epochs=1, dataset_size=8, train_batch_size=2)


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs, unmounted afterwards."""
    with small_tmpfs(tmp_path / "disk", "1m") as mount_point:
        yield mount_point


class TinyEngine:
    """Saves a few bytes to ``<path>/weights.txt``."""

    def save(self, meta: SaveLoadMeta) -> None:
        (Path(meta.path) / "weights.txt").write_text("weights")

    def load(self, meta: SaveLoadMeta) -> None:
        pass


class BigState:
    """A dataloader whose state (about 2 MB of JSON) cannot fit the disk."""

    def state_dict(self) -> Any:
        return {"outstanding": list(range(300_000))}

    def load_state_dict(self, state: Any) -> None:
        pass


def test_recover_info_that_fills_the_disk_names_its_path_and_is_never_loaded(small_disk):
    config = RecoverConfig(experiment_name="e", trial_name="t", fileroot=str(small_disk))
    config.mode, config.freq_steps = "on", 1
    handler = RecoverHandler(config, FT_SPEC)
    with pytest.raises(RecoverWriteError) as failure:
        handler.dump(TinyEngine(), StepInfo(0, 0, 0, 4), None, None, None, BigState())
    message = str(failure.value)
    assert f"No space left on device: '{handler.info_dir()}.staging'" in message
    assert not list(small_disk.rglob("*.staging"))  # deleted, which gives the space back
    assert RecoverHandler(config, FT_SPEC).load(TinyEngine(), None, None, None, None) is None


def test_a_torch_write_that_fills_the_disk_is_named_no_space_left(small_disk):
    checkpoint = small_disk / "checkpoint"
    checkpoint.mkdir()
    # torch's own zip writer says only "unexpected pos ...", with no OS error attached
    with pytest.raises(RuntimeError, match="unexpected pos") as failure:
        torch.save(torch.zeros(500_000), checkpoint / "model.pt")
    error = write_error(failure.value, str(checkpoint), "hf")
    assert str(error) == f"[Errno 28] No space left on device: '{checkpoint}'"
