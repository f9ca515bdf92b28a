"""Runs an evaluation function on the ``evaluator`` schedule."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from areal.api.io_struct import FinetuneSpec
from areal.utils import logging
from areal.utils.timeutil import FrequencyControl

__all__ = ["Evaluator"]

logger = logging.getLogger("evaluator")


class Evaluator:
    """``config`` is an ``EvaluatorConfig``; each ``evaluate`` call counts one finished step."""

    def __init__(
        self, config: Any, ft_spec: FinetuneSpec, clock: Callable[[], float] | None = None
    ):
        self.config = config
        self.ft_spec = ft_spec
        kwargs = {} if clock is None else {"clock": clock}
        self.freq_ctl = FrequencyControl.from_config(config, **kwargs)

    def evaluate(
        self, evaluate_fn: Callable[[], Any], epoch: int, step: int, global_step: int
    ) -> bool:
        """Call ``evaluate_fn()`` if evaluation is due after this step; whether it ran."""
        last_in_epoch = step == self.ft_spec.steps_per_epoch - 1
        if not self.freq_ctl.check(epochs=int(last_in_epoch), steps=1):
            return False
        logger.info("Evaluating at epoch %d step %d (global step %d)", epoch, step, global_step)
        evaluate_fn()
        return True

    def state_dict(self) -> dict[str, Any]:
        return {"freq_ctl": self.freq_ctl.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.freq_ctl.load_state_dict(state.get("freq_ctl", {}))
