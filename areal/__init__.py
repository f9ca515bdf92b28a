"""AReaL Arena port: agentic RL (GRPO) against an external evaluation platform.

Heavy entry points are exported lazily so that ``import areal`` stays cheap for the
CPU controller and the command-line tools.
"""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["PPOTrainer"]

_LAZY_EXPORTS = {
    "PPOTrainer": "areal.trainer.rl_trainer",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY_EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'areal' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)
