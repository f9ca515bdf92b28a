"""Asynchronous rollout execution on an inference engine.

``submit`` queues a rollout (one row, all its samples); a background thread with its own
event loop starts queued rollouts while the barrier is open (and, when the executor has a
gate, while its :class:`StalenessManager` has capacity), runs them as asyncio tasks, and
files each result (``None`` when rejected). A rollout worker's executor has no gate: its
rollout controller holds the run's one staleness gate and dispatches only what it allows,
so the worker starts every rollout it is sent. Rollouts run in-process, without a
controller, pass a gate. ``wait`` collects finished results; ``prepare_batch``
keeps the queue topped up from a dataloader until a full batch of accepted rollouts is
ready. An exception inside one rollout rejects it and is logged; it never stops the
runner. A rollout still running after its deadline (:meth:`WorkflowExecutor.task_deadline`)
is cancelled and rejected, which frees its staleness slot. An error of the runner itself
is raised by the next call.

No rollout starts while the engine's weight-update barrier
(:class:`~areal.infra.weight_barrier.BarrierState`) is closed. The rollout controller
collects finished rollouts by long-polling :meth:`WorkflowExecutor.collect_finished`; a
result stays here until the controller acknowledges it, so an answer lost on the way is
delivered again. With ``rollout.dump_to_file`` every group that produced a trajectory,
accepted or rejected, is written as JSONL (:mod:`areal.utils.trajectory_dump`).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import itertools
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from areal.api.cli_args import InferenceEngineConfig
from areal.infra import workflow_context
from areal.infra.grouped_workflow import resolve_workflow
from areal.infra.staleness_manager import StalenessManager
from areal.infra.weight_barrier import BarrierState
from areal.utils import logging, stats_tracker
from areal.utils.data import concat_padded_tensors
from areal.utils.dynamic_import import import_from_string
from areal.utils.trajectory_dump import RolloutDumper

__all__ = ["WorkflowExecutor"]

logger = logging.getLogger("rollout.executor")
DEADLINE_GRACE_S = 60.0
"""Added to a workflow's own ``timeout`` kwarg, so that its timeout handling runs first."""


@dataclass
class _Task:
    task_id: int
    data: Any
    workflow: Any
    should_accept_fn: Callable[[Any], bool] | None
    is_eval: bool
    created: float = field(default_factory=time.monotonic)
    deadline_s: float | None = None  # seconds from start; past it the task is cancelled


@dataclass
class _Result:
    task_id: int
    created: float
    trajectory: Any  # None when rejected


def to_trajectory(result: Any) -> Any:
    """A workflow result as a training trajectory; ``None`` when there is nothing to train.

    A dict of recorded interactions becomes one tensor batch (one row per interaction).
    """
    if result is None or (isinstance(result, dict) and not result):
        return None
    if isinstance(result, dict) and all(hasattr(v, "to_tensor_dict") for v in result.values()):
        return concat_padded_tensors([v.to_tensor_dict() for v in result.values()]) or None
    return result


class WorkflowExecutor:
    """Runs rollout workflows for an inference engine (see the module docstring)."""

    def __init__(
        self,
        config: InferenceEngineConfig,
        engine: Any,
        staleness_manager: StalenessManager | None = None,
    ):
        """``staleness_manager`` gates the start of queued rollouts; ``None`` (a rollout
        worker's executor) starts each one as soon as the barrier is open."""
        self.config = config
        self.engine = engine
        max_concurrent = config.max_concurrent_rollouts or config.consumer_batch_size
        self.queue_size = config.queue_size or 16 * max_concurrent  # prepare_batch's top-up
        self.staleness = staleness_manager
        self._pending: collections.deque[_Task] = collections.deque()
        self._running: set[int] = set()
        self._results: dict[int, _Result] = {}
        self._cond = threading.Condition()
        barrier = getattr(engine, "barrier", None)
        self._own_barrier = not isinstance(barrier, BarrierState)
        self.barrier: BarrierState = BarrierState() if self._own_barrier else barrier
        self._ids = itertools.count()
        self._data_iterators: dict[int, Iterator[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        # rollout.dump_to_file: each group with a trajectory, accepted or rejected, is
        # written off the event loop (decoding long sequences takes a while)
        self._dumper = RolloutDumper(config) if config.dump_to_file else None
        self._dumps = concurrent.futures.ThreadPoolExecutor(1, "rollout-dump")

    # --- lifecycle ---

    def initialize(self) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._run_loop, args=(ready,), name="rollout-runner", daemon=True
        )
        self._thread.start()
        ready.wait()

    def destroy(self) -> None:
        self._stopping = True
        self.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._dumps.shutdown(wait=True)  # the dumps of finished groups are complete
        if self._own_barrier:
            self.barrier.close()

    def _run_loop(self, ready: threading.Event) -> None:
        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._wake = asyncio.Event()
        ready.set()
        try:
            self._loop.run_until_complete(self._pump())
        except BaseException as e:  # surfaced by the next API call
            self._error = e
            logger.exception("rollout runner stopped")
        finally:
            self._loop.run_until_complete(workflow_context.close_clients())
            self._loop.close()

    def notify(self) -> None:
        """Re-check the queue (after submit, resume or a version change)."""
        if self._loop is not None and self._wake is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._wake.set)

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError("the rollout runner has stopped") from self._error
        if self._thread is None:
            raise RuntimeError("WorkflowExecutor.initialize() was not called")

    # --- the runner (event-loop thread) ---

    async def _pump(self) -> None:
        tasks: set[asyncio.Task] = set()
        while not self._stopping:
            while self._pending and not self.barrier.closed and self._has_capacity():
                task = self._pending.popleft()
                if self.staleness is not None:
                    self.staleness.on_submit()
                self._running.add(task.task_id)
                job = asyncio.create_task(self._execute(task))
                tasks.add(job)
                job.add_done_callback(tasks.discard)
            self._wake.clear()
            # Capacity also changes with the weight version: re-check now and then.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=0.5)
        for job in tasks:
            job.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _has_capacity(self) -> bool:
        return self.staleness is None or self.staleness.get_capacity() > 0

    async def _execute(self, task: _Task) -> None:
        workflow_context.set(
            workflow_context.WorkflowContext(is_eval=task.is_eval, task_id=task.task_id)
        )
        trajectory = None
        deadline = asyncio.timeout(task.deadline_s)
        try:
            async with deadline:
                result = await task.workflow.arun_episode(self.engine, task.data)
            trajectory = to_trajectory(result)
            self._dump(task, trajectory)
            accept = task.should_accept_fn
            if trajectory is not None and accept is not None and not accept(trajectory):
                trajectory = None
        except asyncio.CancelledError:
            raise
        except TimeoutError:
            if not deadline.expired():
                logger.exception("rollout task %d failed; it is rejected", task.task_id)
            else:  # the workflow was cancelled (its sessions ended, its slot is freed)
                logger.warning(
                    "rollout task %d ran past its deadline of %gs (rollout.request_timeout, "
                    "or the workflow's timeout plus %gs); it is cancelled and rejected",
                    task.task_id,
                    task.deadline_s,
                    DEADLINE_GRACE_S,
                )
                stats_tracker.get("rollout").scalar(timed_out=1.0)
            trajectory = None
        except Exception:
            logger.exception("rollout task %d failed; it is rejected", task.task_id)
            trajectory = None
        if self.staleness is not None:
            if trajectory is None:
                self.staleness.on_reject()
            else:
                self.staleness.on_accept()
        # Always the "rollout" tracker, even for evaluation tasks.
        stats_tracker.get("rollout").scalar(
            accepted=float(trajectory is not None), rejected=float(trajectory is None)
        )
        with self._cond:
            self._running.discard(task.task_id)
            self._results[task.task_id] = _Result(task.task_id, task.created, trajectory)
            self._cond.notify_all()
        self._wake.set()

    def _dump(self, task: _Task, trajectory: Any) -> None:
        if self._dumper is None or trajectory is None:
            return

        def write() -> None:
            try:
                self._dumper.dump(trajectory, task.task_id, task.is_eval)
            except Exception:
                logger.exception("dumping rollout task %d failed", task.task_id)

        self._dumps.submit(write)

    # --- submitting and collecting ---

    def submit(
        self,
        data: Any,
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Callable[[Any], bool] | str | None = None,
        group_size: int = 1,
        task_id: int | None = None,
        is_eval: bool = False,
        proxy_addr: str | None = None,
        reward_normalization: bool = False,
        drop_incomplete_group: bool = False,
    ) -> int:
        """Queue one rollout (a row with ``group_size`` samples); returns its task id."""
        self._check()
        resolved = resolve_workflow(
            workflow,
            workflow_kwargs,
            group_size=group_size,
            drop_incomplete_group=drop_incomplete_group,
            reward_normalization=reward_normalization,
            proxy_addr=proxy_addr,
            agent_config=self.config.agent,
        )
        if isinstance(should_accept_fn, str):
            should_accept_fn = import_from_string(should_accept_fn)
        task = _Task(
            task_id=next(self._ids) if task_id is None else task_id,
            data=data,
            workflow=resolved,
            should_accept_fn=should_accept_fn,
            is_eval=is_eval,
        )
        task.deadline_s = self.task_deadline(workflow_kwargs)
        if self.staleness is not None:
            self.staleness.on_enqueue()
        self._pending.append(task)
        self.notify()
        return task.task_id

    def task_deadline(self, workflow_kwargs: dict[str, Any] | None) -> float:
        """Seconds a task may run: ``rollout.request_timeout``, or a workflow's own
        ``timeout`` kwarg plus :data:`DEADLINE_GRACE_S` when that is longer."""
        deadline = float(self.config.request_timeout)
        own = (workflow_kwargs or {}).get("timeout")
        if isinstance(own, (int, float)) and not isinstance(own, bool) and own > 0:
            deadline = max(deadline, float(own) + DEADLINE_GRACE_S)
        return deadline

    def wait(
        self, count: int, timeout: float | None = None, raise_timeout: bool = True
    ) -> list[Any]:
        """``count`` finished rollouts (oldest first, returned shuffled); ``None`` = rejected."""
        self._check()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while len(self._results) < count:
                self._check()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    if raise_timeout:
                        raise TimeoutError(
                            f"{len(self._results)} of {count} rollouts finished within {timeout}s"
                        )
                    return []
                self._cond.wait(timeout=0.5 if remaining is None else min(remaining, 0.5))
            chosen = sorted(self._results.values(), key=lambda r: r.created)[:count]
            for result in chosen:
                del self._results[result.task_id]
        random.shuffle(chosen)
        return [r.trajectory for r in chosen]

    def collect_finished(
        self, ack: Iterable[int] = (), timeout: float = 1.0
    ) -> list[tuple[int, Any]]:
        """Finished rollouts for the rollout controller: ``[(task_id, trajectory)]``.

        Forgets the results of ``ack`` (delivered before and received), then waits up to
        ``timeout`` seconds for at least one finished task and returns every finished one,
        delivered or not: a result stays here until acknowledged, so one lost on its way
        to the controller comes again (the controller ignores repeats). ``trajectory`` is
        ``None`` for a rejected rollout.
        """
        self._check()
        deadline = time.monotonic() + timeout
        with self._cond:
            for task_id in ack:
                self._results.pop(task_id, None)
            while not self._results:
                self._check()
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return []
                self._cond.wait(timeout=min(remaining, 0.5))
            return [(r.task_id, r.trajectory) for r in self._results.values()]

    def wait_for_task(
        self, task_id: int, timeout: float | None = None, raise_timeout: bool = True
    ) -> Any:
        """The result of one task (``None`` if rejected, or if it timed out quietly)."""
        self._check()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while task_id not in self._results:
                self._check()
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    if raise_timeout:
                        raise TimeoutError(f"rollout task {task_id} did not finish in {timeout}s")
                    return None
                self._cond.wait(timeout=0.5 if remaining is None else min(remaining, 0.5))
            return self._results.pop(task_id).trajectory

    def rollout_batch(
        self,
        data: Iterable[Any],
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        **submit_kwargs: Any,
    ) -> list[Any]:
        """Submit every row and wait for all of them (results in row order)."""
        ids = [self.submit(row, workflow, workflow_kwargs, **submit_kwargs) for row in data]
        return [self.wait_for_task(task_id) for task_id in ids]

    def _rows(self, dataloader: Iterable[Any]) -> Iterator[Any]:
        """Rows of the dataloader forever (epoch after epoch)."""
        epoch = 0
        while True:
            if hasattr(getattr(dataloader, "sampler", None), "set_epoch"):
                dataloader.sampler.set_epoch(epoch)
            empty = True
            for batch in dataloader:
                for row in batch if isinstance(batch, (list, tuple)) else [batch]:
                    empty = False
                    yield row
            if empty:
                raise ValueError("the dataloader yields no rows")
            epoch += 1

    def prepare_batch(
        self,
        dataloader: Iterable[Any],
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Callable[[Any], bool] | str | None = None,
        group_size: int = 1,
        dynamic_bs: bool = False,
        reward_normalization: bool = False,
        drop_incomplete_group: bool = False,
        batch_size: int | None = None,
    ) -> list[Any]:
        """A batch of accepted rollouts, keeping the queue topped up from ``dataloader``.

        With ``dynamic_bs`` it returns after ``batch_size`` finished rollouts, with only
        the accepted ones.
        """
        batch_size = (
            batch_size or getattr(dataloader, "batch_size", None) or self.config.consumer_batch_size
        )
        if self.queue_size < batch_size:
            raise ValueError(f"rollout queue_size {self.queue_size} < batch size {batch_size}")
        rows = self._data_iterators.setdefault(id(dataloader), self._rows(dataloader))
        accepted: list[Any] = []
        finished = 0
        pending_limit = self.staleness.pending_limit if self.staleness is not None else None
        while True:
            top_up = min(batch_size, self.queue_size - len(self._running) - batch_size)
            if pending_limit is not None:
                top_up = min(top_up, pending_limit - len(self._pending))
            for _ in range(max(0, top_up)):
                self.submit(
                    next(rows),
                    workflow,
                    workflow_kwargs,
                    should_accept_fn,
                    group_size,
                    reward_normalization=reward_normalization,
                    drop_incomplete_group=drop_incomplete_group,
                )
            missing = batch_size - (finished if dynamic_bs else len(accepted))
            for trajectory in self.wait(missing, timeout=1.0, raise_timeout=False):
                finished += 1
                if trajectory is not None:
                    accepted.append(trajectory)
            if (finished if dynamic_bs else len(accepted)) >= batch_size:
                return accepted

    # --- control ---

    @property
    def is_paused(self) -> bool:
        """The barrier is closed: a weight update is in progress."""
        return self.barrier.closed

    def get_capacity(self) -> int | None:
        """Rollouts the gate would start now; ``None`` without a gate."""
        return None if self.staleness is None else self.staleness.get_capacity()
