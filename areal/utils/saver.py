"""HF-format checkpoints of a train engine, written on the ``saver`` schedule."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from areal.api.io_struct import FinetuneSpec, SaveLoadMeta
from areal.utils import logging
from areal.utils.paths import get_checkpoint_path
from areal.utils.timeutil import FrequencyControl

__all__ = ["Saver"]

logger = logging.getLogger("saver")


class Saver:
    """HF checkpoints at ``{checkpoint root}/{name}/epoch{E}epochstep{S}globalstep{G}``.

    The checkpoint root is ``{fileroot}/checkpoints/{user}/{exp}/{trial}``; ``config`` is a
    ``SaverConfig``. Every ``save`` call counts one finished step (and one finished epoch
    when it is the last step of an epoch) towards the frequency. Saves are synchronous
    whatever ``config.mode`` says: asynchronous saving exists only for an engine this port
    does not have.
    """

    def __init__(
        self, config: Any, ft_spec: FinetuneSpec, clock: Callable[[], float] | None = None
    ):
        self.config = config
        self.ft_spec = ft_spec
        kwargs = {} if clock is None else {"clock": clock}
        self.freq_ctl = FrequencyControl.from_config(config, **kwargs)
        if config.mode == "async":
            logger.info("saver.mode=async: HF checkpoints are written synchronously here")

    @staticmethod
    def get_save_root(config: Any, name: str = "default") -> Path:
        """``{fileroot}/checkpoints/{user}/{exp}/{trial}/{name}`` (created)."""
        root = get_checkpoint_path(config.fileroot, config.experiment_name, config.trial_name)
        path = root / name
        path.mkdir(parents=True, exist_ok=True)
        return path

    @staticmethod
    def get_save_path(
        config: Any, epoch: int, step: int, global_step: int, name: str = "default"
    ) -> Path:
        """The checkpoint directory of one step (not created)."""
        root = Saver.get_save_root(config, name)
        return root / f"epoch{epoch}epochstep{step}globalstep{global_step}"

    def save(
        self,
        engine: Any,
        epoch: int,
        step: int,
        global_step: int,
        tokenizer: Any = None,
        name: str = "default",
    ) -> Path | None:
        """Save ``engine`` as HF weights (no optimizer) if the schedule says so.

        ``step`` is the step within ``epoch``. Returns the checkpoint path, or ``None``
        when nothing was due.
        """
        last_in_epoch = step == self.ft_spec.steps_per_epoch - 1
        if not self.freq_ctl.check(epochs=int(last_in_epoch), steps=1):
            return None
        path = self.get_save_path(self.config, epoch, step, global_step, name)
        path.mkdir(parents=True, exist_ok=True)
        engine.save(SaveLoadMeta(str(path), "hf", with_optim=False, tokenizer=tokenizer))
        logger.info("Saved HF checkpoint of %s to %s", name, path)
        return path

    def finalize(self) -> None:
        """Wait for pending saves; a no-op, since every save completes before it returns."""

    def state_dict(self) -> dict[str, Any]:
        return {"freq_ctl": self.freq_ctl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.freq_ctl.load_state_dict(state.get("freq_ctl", {}))
