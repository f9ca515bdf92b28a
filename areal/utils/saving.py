"""The trainer's save, recover and evaluation schedule, importable from one place."""

from __future__ import annotations

from areal.utils.evaluator import Evaluator
from areal.utils.recover import RecoverHandler, RecoverInfo, StepInfo
from areal.utils.saver import Saver
from areal.utils.timeutil import FrequencyControl

__all__ = ["Evaluator", "FrequencyControl", "RecoverHandler", "RecoverInfo", "Saver", "StepInfo"]
