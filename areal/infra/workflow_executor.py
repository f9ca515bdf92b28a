"""Asynchronous rollout execution with staleness control.

``submit`` queues a rollout (one row, all its samples); a background thread with its own
event loop starts queued rollouts while the executor is not paused and the
:class:`StalenessManager` has capacity, runs them as asyncio tasks, and files each
result (``None`` when rejected). ``wait`` collects finished results; ``prepare_batch``
keeps the queue topped up from a dataloader until a full batch of accepted rollouts is
ready. An exception inside one rollout rejects it and is logged; it never stops the
runner. An error of the runner itself is raised by the next call.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from areal.api.cli_args import InferenceEngineConfig
from areal.api.scheduler_api import RPC_TOKEN_ENV
from areal.infra import workflow_context
from areal.infra.grouped_workflow import resolve_workflow
from areal.infra.rpc.auth import signed_headers
from areal.infra.staleness_manager import StalenessManager
from areal.utils import logging, stats_tracker
from areal.utils.data import concat_padded_tensors
from areal.utils.dynamic_import import import_from_string

__all__ = ["WorkflowExecutor"]

logger = logging.getLogger("rollout.executor")
CALLBACK_TIMEOUT = 30.0


@dataclass
class _Task:
    task_id: int
    data: Any
    workflow: Any
    should_accept_fn: Callable[[Any], bool] | None
    is_eval: bool
    callback_addr: str | None
    created: float = field(default_factory=time.monotonic)


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
        self.config = config
        self.engine = engine
        consumer = config.consumer_batch_size
        self.max_concurrent = config.max_concurrent_rollouts or consumer
        self.queue_size = config.queue_size or 16 * self.max_concurrent
        self.staleness = staleness_manager or StalenessManager(
            engine.get_version, self.max_concurrent, consumer, config.max_head_offpolicyness
        )
        self._pending: collections.deque[_Task] = collections.deque()
        self._running: set[int] = set()
        self._results: dict[int, _Result] = {}
        self._cond = threading.Condition()
        self._paused = threading.Event()
        self._ids = itertools.count()
        self._data_iterators: dict[int, Iterator[Any]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._error: BaseException | None = None
        self._callbacks: set[asyncio.Task] = set()

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
            while self._pending and not self._paused.is_set() and self.staleness.get_capacity() > 0:
                task = self._pending.popleft()
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

    async def _execute(self, task: _Task) -> None:
        workflow_context.set(
            workflow_context.WorkflowContext(is_eval=task.is_eval, task_id=task.task_id)
        )
        trajectory = None
        try:
            trajectory = to_trajectory(await task.workflow.arun_episode(self.engine, task.data))
            accept = task.should_accept_fn
            if trajectory is not None and accept is not None and not accept(trajectory):
                trajectory = None
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("rollout task %d failed; it is rejected", task.task_id)
            trajectory = None
        if trajectory is None:
            self.staleness.on_reject()
        else:
            self.staleness.on_accept()
        # Always the "rollout" tracker, even for evaluation tasks.
        stats_tracker.get("rollout").scalar(
            **{
                "rollout/accepted": float(trajectory is not None),
                "rollout/rejected": float(trajectory is None),
            }
        )
        with self._cond:
            self._running.discard(task.task_id)
            self._results[task.task_id] = _Result(task.task_id, task.created, trajectory)
            self._cond.notify_all()
        if task.callback_addr:
            callback = asyncio.create_task(self._callback(task.callback_addr, task.task_id))
            self._callbacks.add(callback)
            callback.add_done_callback(self._callbacks.discard)
        self._wake.set()

    async def _callback(self, addr: str, task_id: int) -> None:
        try:
            import aiohttp

            session = await workflow_context.get_aiohttp_session()
            url = addr if addr.startswith("http") else f"http://{addr}"
            # the controller's callback server admits only requests signed with the run's
            # RPC token (areal.infra.rpc.auth); the token itself is never sent
            token = os.environ.get(RPC_TOKEN_ENV, "")
            body = json.dumps({"task_id": task_id}).encode()
            headers = {"content-type": "application/json"}
            if token:
                headers.update(signed_headers(token, "POST", url, body))
            async with session.post(
                url,
                data=body,
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=CALLBACK_TIMEOUT),
            ) as response:
                response.raise_for_status()
        except Exception as e:  # the controller may also poll; a lost callback is not fatal
            logger.warning("completion callback to %s for task %d failed: %s", addr, task_id, e)

    # --- submitting and collecting ---

    def submit(
        self,
        data: Any,
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: Callable[[Any], bool] | str | None = None,
        group_size: int = 1,
        task_id: int | None = None,
        callback_addr: str | None = None,
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
            callback_addr=callback_addr,
        )
        self.staleness.on_enqueue()
        self._pending.append(task)
        self.notify()
        return task.task_id

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

    def poll_task(self, task_id: int) -> tuple[bool, Any]:
        """``(finished, trajectory)`` without waiting; a finished task's result is handed
        out once (``trajectory`` is ``None`` when it was rejected)."""
        self._check()
        with self._cond:
            result = self._results.pop(task_id, None)
        return (False, None) if result is None else (True, result.trajectory)

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
        while True:
            top_up = min(
                batch_size,
                self.staleness.pending_limit - len(self._pending),
                self.queue_size - len(self._running) - batch_size,
            )
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

    def pause(self) -> None:
        """Stop starting rollouts; running generations wait at their next request."""
        self._paused.set()

    def resume(self) -> None:
        self._paused.clear()
        self.notify()

    @property
    def is_paused(self) -> bool:
        return self._paused.is_set()

    def get_capacity(self) -> int:
        return self.staleness.get_capacity()
