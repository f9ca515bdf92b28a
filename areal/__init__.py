"""AReaL Arena port: agentic RL (GRPO) against an external evaluation platform.

The reference's top-level names (``from areal import PPOTrainer, RolloutController``...)
are exported lazily: each pulls in torch and the HTTP stack, and ``import areal`` must
stay cheap for the CPU controller and the command-line tools.
"""

from __future__ import annotations

from areal.utils.lazy_exports import lazy_exports

__all__ = [
    "PPOTrainer",
    "RolloutController",
    "StalenessManager",
    "TrainController",
    "WorkflowExecutor",
    "current_platform",
    "workflow_context",
]

_LAZY_EXPORTS = {
    "PPOTrainer": "areal.trainer.rl_trainer",
    "RolloutController": "areal.infra.controller.rollout_controller",
    "StalenessManager": "areal.infra.staleness_manager",
    "TrainController": "areal.infra.controller.train_controller",
    "WorkflowExecutor": "areal.infra.workflow_executor",
    "workflow_context": "areal.infra.workflow_context:",
    "current_platform": "areal.platforms",
}


__getattr__, __dir__ = lazy_exports("areal", _LAZY_EXPORTS, __all__)
