"""Rollout infrastructure: workflow execution, staleness control, execution context,
controllers and schedulers.

The classes (``from areal.infra import LocalScheduler``...) resolve lazily; submodules
such as ``areal.infra.workflow_context`` import as usual.
"""

from __future__ import annotations

from areal.utils.lazy_exports import lazy_exports

__all__ = [
    "LocalScheduler",
    "RolloutController",
    "SlurmScheduler",
    "StalenessManager",
    "TrainController",
    "WorkflowExecutor",
]

_LAZY_EXPORTS = {
    "LocalScheduler": "areal.infra.scheduler.local",
    "RolloutController": "areal.infra.controller.rollout_controller",
    "SlurmScheduler": "areal.infra.scheduler.slurm",
    "StalenessManager": "areal.infra.staleness_manager",
    "TrainController": "areal.infra.controller.train_controller",
    "WorkflowExecutor": "areal.infra.workflow_executor",
}


__getattr__, __dir__ = lazy_exports("areal.infra", _LAZY_EXPORTS, __all__)
