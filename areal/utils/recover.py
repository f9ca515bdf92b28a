"""Recover points: a DCP checkpoint plus the loop state that a killed run resumes from.

A recover point is two directories under ``{fileroot}/checkpoints/{user}/{exp}/{trial}``:
``{name}/recover_checkpoint`` (the engine's DCP checkpoint) and ``recover_info/`` (JSON:
step, saver, evaluator, stats logger, frequency and dataloader states). A dump writes both
into ``.staging`` siblings, stamps each with the same ``recover_stamp.json``, then swaps
them in by renames; the stamp written last marks a directory complete. Whatever point a
crash interrupts, the newest pair with matching stamps is a complete recover point, and
``_settle`` moves it back under the final names before the next load or dump: a point
being written is never loaded. A dump that fails (a full disk) deletes its staging copies
at once and raises :class:`RecoverWriteError`, naming the path and the OS error.

The dataloader state includes the rows drawn but not yet trained when the point was
written (asynchronous rollouts run ahead of training); a resumed run trains them first,
so every row is trained exactly once (:mod:`areal.trainer.dataloader`).
"""

from __future__ import annotations

import base64
import dataclasses
import json
import shutil
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from areal.api import io_struct
from areal.api.io_struct import FinetuneSpec, SaveLoadMeta
from areal.utils import logging
from areal.utils.paths import get_checkpoint_path
from areal.utils.saver import Saver
from areal.utils.timeutil import FrequencyControl

__all__ = [
    "RecoverHandler",
    "RecoverInfo",
    "RecoverWriteError",
    "StepInfo",
    "from_jsonable",
    "to_jsonable",
]

logger = logging.getLogger("recover")

STAMP_FILE = "recover_stamp.json"
_STAGING = ".staging"
_PREVIOUS = ".prev"
# Modes that write and read recover points; "disabled" and "off" do neither.
_ACTIVE_MODES = ("on", "auto")


class StepInfo(io_struct.StepInfo):
    """Position in training: ``epoch``, ``epoch_step`` (step within it), ``global_step``."""

    def next(self) -> StepInfo:
        """The step after this one; the last step of an epoch is followed by step 0 of the next."""
        wraps = self.epoch_step >= self.steps_per_epoch - 1
        return StepInfo(
            epoch=self.epoch + 1 if wraps else self.epoch,
            epoch_step=0 if wraps else self.epoch_step + 1,
            global_step=self.global_step + 1,
            steps_per_epoch=self.steps_per_epoch,
        )


class RecoverWriteError(RuntimeError):
    """A recover point could not be written; the last complete one, if any, stays."""


@dataclass
class RecoverInfo:
    """Everything besides model and optimizer weights that a resumed run needs."""

    last_step_info: StepInfo
    saver_info: dict[str, Any] = field(default_factory=dict)
    evaluator_info: dict[str, Any] = field(default_factory=dict)
    stats_logger_info: dict[str, Any] = field(default_factory=dict)
    checkpoint_info: dict[str, Any] = field(default_factory=dict)
    dataloader_info: Any = None

    # file name -> attribute; the dataloader state goes through the tagged JSON codec
    _FILES: ClassVar[dict[str, str]] = {
        "step_info.json": "last_step_info",
        "saver_info.json": "saver_info",
        "evaluator_info.json": "evaluator_info",
        "stats_logger_info.json": "stats_logger_info",
        "checkpoint_info.json": "checkpoint_info",
        "dataloader_info.json": "dataloader_info",
    }

    def write(self, directory: Path) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        for filename, attr in self._FILES.items():
            value = getattr(self, attr)
            if attr == "last_step_info":
                value = dataclasses.asdict(value)
            text = json.dumps(to_jsonable(value), indent=None if attr == "dataloader_info" else 2)
            (directory / filename).write_text(text)

    @classmethod
    def read(cls, directory: Path) -> RecoverInfo:
        values = {
            attr: from_jsonable(json.loads((directory / filename).read_text()))
            for filename, attr in cls._FILES.items()
        }
        values["last_step_info"] = StepInfo(**values["last_step_info"])
        return cls(**values)


class RecoverHandler:
    """Dumps recover points on the ``recover`` schedule and loads the latest one.

    ``config`` is a ``RecoverConfig``. The engine is anything with ``save(meta)`` and
    ``load(meta)`` taking a :class:`SaveLoadMeta`; saver, evaluator, stats logger and
    dataloader are anything with ``state_dict()`` and ``load_state_dict(state)`` (or
    ``None``). The dataloader state is stored as tagged JSON, so tensors, tuples and
    non-string keys survive the round trip.
    """

    def __init__(
        self, config: Any, ft_spec: FinetuneSpec, clock: Callable[[], float] | None = None
    ):
        self.config = config
        self.ft_spec = ft_spec
        kwargs = {} if clock is None else {"clock": clock}
        self.freq_ctl = FrequencyControl.from_config(config, **kwargs)

    @property
    def enabled(self) -> bool:
        return self.config.mode in _ACTIVE_MODES

    def info_dir(self) -> Path:
        """``{fileroot}/checkpoints/{user}/{exp}/{trial}/recover_info``."""
        c = self.config
        return get_checkpoint_path(c.fileroot, c.experiment_name, c.trial_name) / "recover_info"

    def checkpoint_dir(self, name: str = "default") -> Path:
        """``{fileroot}/checkpoints/{user}/{exp}/{trial}/{name}/recover_checkpoint``."""
        return Saver.get_save_root(self.config, name) / "recover_checkpoint"

    # --- dump ---

    def dump(
        self,
        engine: Any,
        step_info: StepInfo,
        saver: Any,
        evaluator: Any,
        stats_logger: Any,
        dataloader: Any,
        tokenizer: Any = None,
        name: str = "default",
    ) -> bool:
        """Write a recover point after ``step_info``'s step if one is due; whether it did."""
        if not self.enabled:
            return False
        last_in_epoch = step_info.epoch_step == step_info.steps_per_epoch - 1
        if not self.freq_ctl.check(epochs=int(last_in_epoch), steps=1):
            return False
        ckpt, info_dir = self.checkpoint_dir(name), self.info_dir()
        self._settle(ckpt, info_dir)
        info = RecoverInfo(
            last_step_info=StepInfo(**dataclasses.asdict(step_info)),
            saver_info=_state(saver),
            evaluator_info=_state(evaluator),
            stats_logger_info=_state(stats_logger),
            checkpoint_info=self.freq_ctl.state_dict(),
            dataloader_info=_state(dataloader),
        )
        stamp = {"global_step": step_info.global_step, "time": time.time(), "id": uuid.uuid4().hex}
        ckpt_staging, info_staging = _sibling(ckpt, _STAGING), _sibling(info_dir, _STAGING)

        with_optim = not self.config.no_save_optim
        writing = ckpt_staging
        try:
            ckpt_staging.mkdir(parents=True)
            engine.save(SaveLoadMeta(str(ckpt_staging), "dcp", with_optim, tokenizer))
            _write_stamp(ckpt_staging, stamp)
            writing = info_staging
            info.write(info_staging)
            _write_stamp(info_staging, stamp)
        except Exception as error:
            # unstamped, so never loaded; deleted now to give back the space it took
            for staging in (ckpt_staging, info_staging):
                shutil.rmtree(staging, ignore_errors=True)
            cause: Exception = error
            if isinstance(error, OSError) and error.errno and error.filename is None:
                cause = OSError(error.errno, error.strerror, str(writing))  # name the path
            raise RecoverWriteError(
                f"the recover point of global step {step_info.global_step} was not written: "
                f"{cause}; it was deleted, and a resumed run starts from the last complete "
                f"recover point in {ckpt.parent.parent} (if any)"
            ) from error

        for final in (ckpt, info_dir):
            if final.exists():
                final.rename(_sibling(final, _PREVIOUS))
            _sibling(final, _STAGING).rename(final)
        self._settle(ckpt, info_dir)
        logger.info(
            "Recover point written at global step %d (%s, %s)",
            step_info.global_step,
            ckpt,
            info_dir,
        )
        return True

    # --- load ---

    def load(
        self,
        engine: Any,
        saver: Any,
        evaluator: Any,
        stats_logger: Any,
        dataloader: Any,
        inference_engine: Any = None,
        weight_update_meta: Any = None,
        name: str = "default",
    ) -> RecoverInfo | None:
        """Restore the latest recover point into the given objects, or ``None`` if none.

        With an ``inference_engine`` (connected to ``engine`` in this process), the
        restored weights are pushed to it through ``engine.update_weights(weight_update_meta)``
        inside its weight-update barrier, and both sides are set to version
        ``global_step + 1``.
        """
        if not self.enabled:
            return None
        ckpt, info_dir = self.checkpoint_dir(name), self.info_dir()
        if not self._settle(ckpt, info_dir):
            message = "no recover point at %s; starting from scratch"
            if self.config.mode == "on":
                logger.warning("recover.mode=on but " + message, info_dir)
            else:
                logger.info("recover.mode=auto: " + message, info_dir)
            return None
        if inference_engine is not None and weight_update_meta is None:
            raise ValueError("recovering with an inference engine needs weight_update_meta")

        info = RecoverInfo.read(info_dir)
        with_optim = not self.config.no_load_optim
        engine.load(SaveLoadMeta(str(ckpt), "dcp", with_optim=with_optim))
        for obj, state in (
            (saver, info.saver_info),
            (evaluator, info.evaluator_info),
            (stats_logger, info.stats_logger_info),
            (dataloader, info.dataloader_info),
        ):
            if obj is not None:
                obj.load_state_dict(state)
        self.freq_ctl.load_state_dict(info.checkpoint_info)

        version = info.last_step_info.global_step + 1
        if inference_engine is not None:
            inference_engine.begin_weight_update(version)
            engine.update_weights(_meta_with_version(weight_update_meta, version))
            inference_engine.end_weight_update(version)
        if hasattr(engine, "set_version"):
            engine.set_version(version)
        logger.info(
            "Recovered from global step %d; resuming at global step %d",
            info.last_step_info.global_step,
            info.last_step_info.next().global_step,
        )
        return info

    def state_dict(self) -> dict[str, Any]:
        return {"freq_ctl": self.freq_ctl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.freq_ctl.load_state_dict(state.get("freq_ctl", {}))

    # --- crash consistency ---

    @staticmethod
    def _settle(ckpt: Path, info_dir: Path) -> bool:
        """Keep only the newest complete recover point, under the final names.

        Returns whether one exists. Complete means a checkpoint directory and an info
        directory carrying the same stamp; staging and previous copies left by an
        interrupted dump are promoted or removed.
        """
        ckpt_candidates = _stamped(ckpt)
        info_candidates = _stamped(info_dir)
        common = set(ckpt_candidates) & set(info_candidates)
        keep = max(common, default=None)
        for final, candidates in ((ckpt, ckpt_candidates), (info_dir, info_candidates)):
            chosen = candidates.get(keep) if keep is not None else None
            for path in (final, _sibling(final, _STAGING), _sibling(final, _PREVIOUS)):
                if path.exists() and path != chosen:
                    if path == final and chosen is None:
                        continue  # an unmatched final directory is left for a person to inspect
                    _remove(path)
            if chosen is not None and chosen != final:
                chosen.rename(final)
        return keep is not None


# --- helpers ---


def _sibling(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def _state(obj: Any) -> Any:
    return {} if obj is None else obj.state_dict()


def _write_stamp(directory: Path, stamp: dict[str, Any]) -> None:
    (directory / STAMP_FILE).write_text(json.dumps(stamp))


def _stamped(final: Path) -> dict[tuple[int, float, str], Path]:
    """Stamp key -> directory, over the final, staging and previous copies that have one."""
    found = {}
    for path in (final, _sibling(final, _STAGING), _sibling(final, _PREVIOUS)):
        try:
            stamp = json.loads((path / STAMP_FILE).read_text())
            found[(int(stamp["global_step"]), float(stamp["time"]), str(stamp["id"]))] = path
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return found


def _remove(path: Path) -> None:
    # The stamp goes first, so a half-removed directory never looks complete.
    (path / STAMP_FILE).unlink(missing_ok=True)
    shutil.rmtree(path)


def _meta_with_version(meta: Any, version: int) -> Any:
    """``meta`` for weight version ``version`` (disk updates go to ``{path}_v{version}``)."""
    with_version = getattr(meta, "with_version", None)
    if callable(with_version):
        return with_version(version)
    path = meta.path
    if meta.type == "disk" and path:
        path = f"{path}_v{version}"
    return dataclasses.replace(meta, version=version, path=path)


# --- tagged JSON for arbitrary state dicts ---

_TAG = "__type__"


def to_jsonable(value: Any) -> Any:
    """``value`` as JSON-safe data; tensors, arrays, tuples, bytes and non-str keys are tagged."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and _TAG not in value:
            return {k: to_jsonable(v) for k, v in value.items()}
        return {_TAG: "dict", "items": [[to_jsonable(k), to_jsonable(v)] for k, v in value.items()]}
    if isinstance(value, list):
        return [to_jsonable(v) for v in value]
    if isinstance(value, tuple):
        return {_TAG: "tuple", "items": [to_jsonable(v) for v in value]}
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu()
        return {
            _TAG: "tensor",
            "dtype": str(t.dtype).removeprefix("torch."),
            "shape": list(t.shape),
            "data": t.reshape(-1).tolist(),
        }
    if isinstance(value, np.ndarray):
        return {
            _TAG: "ndarray",
            "dtype": str(value.dtype),
            "shape": list(value.shape),
            "data": value.reshape(-1).tolist(),
        }
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (bytes, bytearray)):
        return {_TAG: "bytes", "b64": base64.b64encode(bytes(value)).decode("ascii")}
    raise TypeError(f"cannot store a {type(value).__name__} in a recover point")


def from_jsonable(value: Any) -> Any:
    """The inverse of :func:`to_jsonable`."""
    if isinstance(value, list):
        return [from_jsonable(v) for v in value]
    if not isinstance(value, dict):
        return value
    kind = value.get(_TAG)
    if kind is None:
        return {k: from_jsonable(v) for k, v in value.items()}
    if kind == "dict":
        return {from_jsonable(k): from_jsonable(v) for k, v in value["items"]}
    if kind == "tuple":
        return tuple(from_jsonable(v) for v in value["items"])
    if kind == "tensor":
        dtype = getattr(torch, value["dtype"])
        return torch.tensor(value["data"], dtype=dtype).reshape(value["shape"])
    if kind == "ndarray":
        return np.asarray(value["data"], dtype=value["dtype"]).reshape(value["shape"])
    if kind == "bytes":
        return base64.b64decode(value["b64"])
    raise ValueError(f"unknown tagged value {kind!r} in recover info")
