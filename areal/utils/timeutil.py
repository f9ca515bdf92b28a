"""When periodic work (HF saves, recover dumps, evaluation) is due: epochs, steps or seconds."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

__all__ = ["FrequencyControl"]


class FrequencyControl:
    """Fires when any of its limits is reached since it last fired.

    Each ``check(epochs, steps)`` adds the epochs and steps finished since the previous
    call; the control fires when the accumulated epochs reach ``freq_epochs``, the
    accumulated steps reach ``freq_steps``, or ``freq_secs`` seconds have passed since it
    last fired (or was created). A limit of ``None`` never fires; with all three ``None``
    the control never fires. Firing resets all three counters.

    ``clock`` returns seconds (``time.monotonic`` by default); tests pass a fake one.
    """

    def __init__(
        self,
        freq_epochs: int | None = None,
        freq_steps: int | None = None,
        freq_secs: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        for name, value in (
            ("freq_epochs", freq_epochs),
            ("freq_steps", freq_steps),
            ("freq_secs", freq_secs),
        ):
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or None (got {value})")
        self.freq_epochs = freq_epochs
        self.freq_steps = freq_steps
        self.freq_secs = freq_secs
        self._clock = clock
        self._epochs = 0
        self._steps = 0
        self._last_fire = clock()

    @classmethod
    def from_config(cls, config: Any, clock: Callable[[], float] = time.monotonic):
        """From any config with ``freq_epochs``, ``freq_steps`` and ``freq_secs``."""
        return cls(config.freq_epochs, config.freq_steps, config.freq_secs, clock=clock)

    @property
    def enabled(self) -> bool:
        return any(f is not None for f in (self.freq_epochs, self.freq_steps, self.freq_secs))

    def check(self, epochs: int = 0, steps: int = 0) -> bool:
        """Count ``epochs`` and ``steps`` more; whether the work is due now."""
        self._epochs += epochs
        self._steps += steps
        now = self._clock()
        due = (
            (self.freq_epochs is not None and self._epochs >= self.freq_epochs)
            or (self.freq_steps is not None and self._steps >= self.freq_steps)
            or (self.freq_secs is not None and now - self._last_fire >= self.freq_secs)
        )
        if due:
            self._epochs = 0
            self._steps = 0
            self._last_fire = now
        return due

    def state_dict(self) -> dict[str, Any]:
        """Counters since the last fire; time is stored as elapsed seconds, not a clock value."""
        return {
            "epochs": self._epochs,
            "steps": self._steps,
            "elapsed_secs": self._clock() - self._last_fire,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epochs = int(state.get("epochs", 0))
        self._steps = int(state.get("steps", 0))
        self._last_fire = self._clock() - float(state.get("elapsed_secs", 0.0))
