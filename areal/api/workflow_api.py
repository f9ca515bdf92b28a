"""Rollout workflows: how one dataset row becomes a trajectory."""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from areal.api.engine_api import InferenceEngine

__all__ = ["RolloutWorkflow", "WorkflowLike"]


class RolloutWorkflow(abc.ABC):
    """Runs one episode for one dataset row on an inference engine.

    ``arun_episode`` returns a trajectory (a dict of ``[1, seq]`` tensors, or a dict of
    recorded interactions), or ``None`` to reject the sample.
    """

    @abc.abstractmethod
    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Any:
        """One episode; ``None`` rejects it."""


# A workflow given to submit(): an instance, a RolloutWorkflow class, or an import path.
WorkflowLike = RolloutWorkflow | type | str
