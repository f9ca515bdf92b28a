"""Runs the rollouts sent to a rollout worker, on a :class:`WorkflowExecutor` of its own."""

from __future__ import annotations

import concurrent.futures
from typing import Any

from areal.api.cli_args import InferenceEngineConfig
from areal.infra.staleness_manager import StalenessManager
from areal.infra.workflow_executor import WorkflowExecutor

__all__ = ["WorkflowRunner"]


class WorkflowRunner:
    """The rollout side of one worker's engine: submit, wait and collect rollouts.

    ``staleness`` is the gate on starting rollouts. A rollout worker has none (``None``):
    its rollout controller holds the run's one gate and sends only what it allows. Code
    that runs rollouts in-process, with no controller, passes one to bound them.
    """

    def __init__(
        self,
        config: InferenceEngineConfig,
        pool: concurrent.futures.ThreadPoolExecutor,
        staleness: StalenessManager | None = None,
    ):
        self.config = config
        self.staleness = staleness
        self.executor: WorkflowExecutor | None = None
        self._pool = pool

    def start(self, engine: Any) -> None:
        """Start the executor; its workflows generate with ``engine`` and follow its barrier."""
        self.executor = WorkflowExecutor(self.config, engine, self.staleness)
        self.executor.initialize()

    def stop(self) -> None:
        """Cancel what runs (cancelled rollouts release what they hold) and stop."""
        if self.executor is not None:
            self.executor.destroy()
            self.executor = None

    def notify(self) -> None:
        """Re-check the queue (after a version change)."""
        if self.executor is not None:
            self.executor.notify()

    def _started(self) -> WorkflowExecutor:
        if self.executor is None:
            raise RuntimeError("initialize() the inference engine first")
        return self.executor

    # --- rollouts ---

    def submit(
        self, data: Any, workflow: Any, workflow_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> int:
        return self._started().submit(data, workflow, workflow_kwargs, **kwargs)

    def wait(
        self, count: int, timeout: float | None = None, raise_timeout: bool = True
    ) -> list[Any]:
        return self._started().wait(count, timeout=timeout, raise_timeout=raise_timeout)

    def wait_for_task(
        self, task_id: int, timeout: float | None = None, raise_timeout: bool = True
    ) -> Any:
        return self._started().wait_for_task(task_id, timeout=timeout, raise_timeout=raise_timeout)

    def collect_finished(
        self, ack: list[int] | None = None, timeout: float = 1.0
    ) -> concurrent.futures.Future:
        """Finished rollouts, long-polled by the rollout controller (see
        :meth:`WorkflowExecutor.collect_finished`). A future, so the RPC server waits for
        it off its engine thread and other calls to this worker go on meanwhile."""
        executor = self._started()
        return self._pool.submit(executor.collect_finished, list(ack or ()), timeout)

    def rollout_batch(
        self,
        data: list[Any],
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        return self._started().rollout_batch(data, workflow, workflow_kwargs, **kwargs)

    def prepare_batch(
        self,
        dataloader: Any,
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        return self._started().prepare_batch(dataloader, workflow, workflow_kwargs, **kwargs)
