"""``RolloutController``: rollout workers driven from the CPU controller.

Each rollout worker hosts a :class:`RemoteSGLangEngine` and (unless servers are given)
its own inference server. The controller keeps the single :class:`StalenessManager` of
the run: a dispatcher thread sends a task to a worker (round robin) only while the
staleness bound and the concurrency limit leave room, and rows are drawn from the
dataloader only when they can be dispatched, so in synchronous mode the dataloader
position after step ``k`` is exactly ``(k + 1) x batch_size`` rows. One fetcher thread
per worker long-polls it for finished tasks (``collect_finished``, over the signed worker
RPC); a result stays on the worker until the next poll acknowledges it, so one lost on
the way comes again and no task is left waiting (nothing listens on the controller).

Rows drawn from a :class:`~areal.trainer.dataloader.StatefulDataLoader` stay outstanding
in it until their group is handed to the trainer or rejected, so a recover checkpoint
knows which rows were drawn ahead (asynchronous mode) and a resumed run trains them.

A :class:`~areal.infra.controller.health.HealthSupervisor` probes every worker, server
and proxy (``rollout.health_check_*``); when one is dead, dispatching stops at once and
:meth:`wait`, :meth:`prepare_batch` and every call to the workers raise its error, which
names the worker when its servers and proxies died with it.

Every call to a worker goes through a typed proxy of its engine's interface
(:class:`~areal.api.engine_api.RolloutWorkerEngine`, see
:mod:`areal.infra.controller.rollout_workers`); calls to every worker at once are
gathered on the RPC loop.

Weight updates go through one barrier:
:meth:`RolloutController.begin_weight_update` stops dispatching and closes every worker's
barrier (no rollout starts, no generation request is sent there or by its proxies) and
pauses the servers, aborting what is in flight; an interrupted generation keeps its
partial output and goes on after the update, on the new weights.
:meth:`~RolloutController.receive_weights` is the rollout side of the controller's
weight-sync handshake (:mod:`areal.engine.weight_sync`), after which the servers serve
again; :meth:`~RolloutController.end_weight_update` sets the version on every worker, its
servers and proxies and resumes.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import shutil
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from areal.api.cli_args import InferenceEngineConfig, SchedulingSpec, SchedulingStrategy
from areal.api.io_struct import ParamSpec, WeightUpdateMeta
from areal.api.scheduler_api import Job, Scheduler, Worker
from areal.infra.controller.health import (
    ROLLOUT_WORKER,
    HealthSupervisor,
    HealthTarget,
    RolloutHealthError,
)
from areal.infra.controller.rollout_workers import RolloutWorkers, WorkerEngine
from areal.infra.scheduler.exceptions import WorkerFailedError
from areal.infra.staleness_manager import StalenessManager
from areal.utils import logging, stats_tracker

__all__ = ["RolloutController", "merge_worker_stats"]

logger = logging.getLogger("rollout.controller")

ENGINE_CLASS = "areal.engine.sglang_remote.RemoteSGLangEngine"
COLLECT_TIMEOUT = 1.0  # seconds a fetcher's long poll waits on its worker


@dataclass
class _Task:
    task_id: int
    data: Any
    submit_kwargs: dict[str, Any]
    worker: int = -1  # the index of the worker it was sent to
    started: float = 0.0
    row_key: Any = None  # the dataloader's key of the row (None: submitted directly)


def merge_worker_stats(per_worker: list[dict[str, float]]) -> dict[str, float]:
    """The rollout workers' stats as one: means weighted by their counts, denominators
    summed, minima and maxima taken over the workers (see ``stats_tracker.merge_exports``)."""
    return stats_tracker.merge_exports(per_worker)


class RolloutController:
    def __init__(self, config: InferenceEngineConfig, scheduler: Scheduler, role: str = "rollout"):
        self.config = config
        self.scheduler = scheduler
        self.role = role
        self.workers: list[Worker] = []
        self._remote: RolloutWorkers | None = None  # calls to the workers' engines
        self.server_addrs: list[str] = []
        self._version = 0
        self._ids = itertools.count()
        self._lock = threading.Condition()
        self._pending: collections.deque[_Task] = collections.deque()
        self._inflight: dict[int, _Task] = {}
        self._results: dict[int, Any] = {}
        self._barrier_closed = False  # between begin_weight_update and end_weight_update
        self._stopping = False
        self._error: Exception | None = None
        self._rejected_in_a_row = 0
        self._health: HealthSupervisor | None = None
        self._health_error: RolloutHealthError | None = None
        self._source: Iterator[tuple[Any, Any, dict[str, Any]]] | None = None
        self._settle: Callable[[list[Any]], None] | None = None
        self._row_keys: dict[int, Any] = {}  # task id -> row key, until settled
        self._threads: list[threading.Thread] = []
        self.staleness: StalenessManager | None = None
        self._rr = itertools.count()
        self.proxy_addrs: list[str] = []
        self.clear_checkpoint_after_load = True

    # --- lifecycle ---

    def initialize(
        self,
        n_workers: int,
        spec: SchedulingSpec,
        server_args: dict[str, Any] | None = None,
        server_addrs: list[str] | None = None,
        strategy: SchedulingStrategy | None = None,
    ) -> None:
        """Start ``n_workers`` workers, each with its own server (``server_args``) or
        connected to ``server_addrs`` (one per worker, e.g. for an eval controller)."""
        job = Job(self.role, n_workers, [spec] * n_workers, strategy, secrets="rollout")
        self.scheduler.create_workers(job)
        self.workers = self.scheduler.get_workers(self.role)
        self._remote = RolloutWorkers(self.scheduler, self.workers, self.check_health)

        async def connect(i: int, engine: WorkerEngine) -> str:
            """Create worker ``i``'s engine, its server unless given; its server address."""
            worker_id = self.workers[i].id
            # a worker's engine has no gate of its own: it runs what this controller sends
            await self.scheduler.create_engine(worker_id, ENGINE_CLASS, worker_id, self.config)
            if server_addrs:
                addr = server_addrs[i % len(server_addrs)]
            else:
                addr = await engine.launch_local_server.acall(server_args or {})
            await engine.initialize.acall(addr=addr)
            return addr

        self.server_addrs = self._remote.on_each(connect)
        # the run's one staleness gate (max_head_offpolicyness null: concurrency only)
        self.staleness = StalenessManager.from_config(self.config, self.get_version)
        self._start_health_supervisor()
        loops = [(self._dispatch_loop, (), "dispatch")]
        loops += [(self._fetch_loop, (i,), f"fetch-{i}") for i in range(len(self.workers))]
        for target, args, name in loops:
            thread = threading.Thread(
                target=target, args=args, name=f"{self.role}-{name}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _start_health_supervisor(self) -> None:
        c = self.config
        if c.health_check_interval <= 0:
            return
        remote = self._remote
        self._health = HealthSupervisor(
            remote.health_targets(self.server_addrs) + remote.proxy_targets(self.proxy_addrs),
            interval=c.health_check_interval,
            timeout=c.health_check_timeout,
            failures=c.health_check_failures,
            on_failure=self._on_health_failure,
            quiet=remote.quiet,
            name=f"{self.role}-health",
        )
        self._health.start()

    def _on_health_failure(self, error: RolloutHealthError) -> None:
        with self._lock:  # under the lock: no task is dispatched after this line is logged
            if self._health_error is None:
                self._health_error = error
                logger.error("%s", error)
            self._lock.notify_all()

    def check_health(self) -> None:
        """Raise the error of a worker, server or proxy found dead (before work that needs
        them)."""
        if self._health_error is not None:
            raise self._health_error

    def diagnose(self) -> RolloutHealthError | None:
        """Why the rollout side is broken, if it is: a known dead worker, server or proxy, or
        one that does not answer a health check now (to explain an error seen elsewhere; it
        then stops the dispatch as a failed supervision does)."""
        if self._health_error is None and self._health is not None:
            found = self._health.diagnose()
            if found is not None:
                self._on_health_failure(found)
        return self._health_error

    def destroy(self) -> None:
        if self._health is not None:
            self._health.stop()
            self._health = None
        self._stopping = True
        with self._lock:
            self._lock.notify_all()
        for thread in self._threads:
            thread.join(timeout=10)
        with contextlib.suppress(Exception):
            self.scheduler.delete_workers(self.role)

    # --- the weight-update barrier (the one pause path) and versions ---

    def get_version(self) -> int:
        return self._version

    def begin_weight_update(self, version: int) -> None:
        """Close the barrier for the update to ``version``: dispatch nothing new; every
        worker starts no rollout and sends no generation request (nor do its proxies);
        every server pauses, aborting the requests in flight (their rollouts keep the
        partial output and go on after :meth:`end_weight_update`). Idempotent."""
        with self._lock:
            if self._barrier_closed:
                return
            self._barrier_closed = True
        self._remote.set_paused(True)
        self._remote.on_all(lambda worker: worker.begin_weight_update.acall(version))

    def end_weight_update(self, version: int) -> None:
        """Set ``version`` on the controller, every worker, its servers (their weight
        version) and its proxies, then resume: the servers serve and rollouts go on.

        Without a :meth:`begin_weight_update` before, this only sets the version (an
        evaluation controller following the trained version, a recovered run)."""
        self._version = version
        self._remote.on_all(lambda worker: worker.end_weight_update.acall(version))
        self._remote.set_paused(False)
        with self._lock:
            self._barrier_closed = False
            self._lock.notify_all()

    set_version = end_weight_update  # a version change is the end of an update

    def offload(self) -> None:
        """Every server releases its accelerator memory (colocation: the actor trains);
        only inside the barrier, which keeps the servers idle until the weights are in."""
        if not self._barrier_closed:
            raise RuntimeError("begin_weight_update() before offloading the inference servers")
        with self._remote.busy():
            self._remote.on_all(lambda worker: worker.offload.acall())

    def onload(self) -> None:
        """Every server takes its memory back (before the weight update)."""
        with self._remote.busy():
            self._remote.on_all(lambda worker: worker.onload.acall())

    # --- the rollout side of the weight-sync handshake (areal.engine.weight_sync) ---

    def init_weights_update_group(self, meta: WeightUpdateMeta) -> None:
        """Every worker's server joins the group at once; worker ``i`` runs server ``i``."""
        if meta.gen_n_servers != len(self.workers):
            raise ValueError(
                f"the weight-update group expects {meta.gen_n_servers} rollout server(s) "
                f"(rollout.backend) but {len(self.workers)} rollout worker(s) run"
            )
        with self._remote.busy():
            self._remote.on_each(
                lambda i, worker: worker.init_weights_update_group.acall(meta, first_server_index=i)
            )

    def receive_weights(
        self,
        meta: WeightUpdateMeta,
        buckets: list[list[ParamSpec]] | None = None,
        payloads: list[list[str]] | None = None,
    ) -> None:
        """Every server loads the update (``disk``: ``meta.path`` once the trainer has
        published it; ``xccl``: each bucket of ``buckets`` while the trainer broadcasts
        it; ``awex``: the buckets each colocated actor rank shares by handle, ``payloads``
        in actor rank order, worker ``i``'s server taking ranks ``i*t .. i*t + t - 1``),
        then serves again; rollouts stay held until :meth:`end_weight_update`."""
        remote = self._remote
        with remote.busy():
            if meta.type == "disk":
                remote.on_all(lambda worker: worker.update_weights_from_disk.acall(meta))
            elif meta.type == "awex":
                t = meta.gen_tp_size
                if payloads is None or len(payloads) != len(self.workers) * t:
                    raise ValueError(
                        f"awex needs one payload list per actor rank: {len(self.workers)} "
                        f"server(s) of TP {t} are colocated with "
                        f"{len(payloads or [])} actor rank(s)"
                    )
                remote.on_each(
                    lambda i, worker: worker.update_weights_from_tensor.acall(
                        meta, payloads[i * t : (i + 1) * t]
                    )
                )
            else:
                for specs in buckets or []:
                    remote.on_all(
                        lambda worker, specs=specs: worker.update_weights_from_distributed.acall(
                            meta, specs
                        )
                    )
            remote.on_all(lambda worker: worker.resume_serving.acall())
        remote.set_paused(False)
        if meta.type == "disk" and self.clear_checkpoint_after_load and meta.path:
            shutil.rmtree(meta.path, ignore_errors=True)

    # --- proxies for agent workflows ---

    def start_proxies(
        self, tokenizer_path: str, expected_temperature: float | None = None
    ) -> list[str]:
        """One rollout proxy per rollout worker, in front of its server; their base URLs.

        Proxy ``i`` runs next to rollout worker ``i`` and in front of its server; tasks sent
        to worker ``i`` carry ``proxy_addrs[i]``. ``expected_temperature`` is
        ``actor.temperature`` (the proxies count requests sampled otherwise). Idempotent.
        The health supervision watches them from now on: a dead proxy fails every rollout
        sent through it, which would otherwise surface only as a storm of rejections.
        """
        if not self.proxy_addrs:
            self.proxy_addrs = self._remote.on_all(
                lambda worker: worker.launch_proxy.acall(
                    tokenizer_path, expected_temperature=expected_temperature
                )
            )
            logger.info("rollout proxies: %s", self.proxy_addrs)
            if self._health is not None:
                self._health.watch(self._remote.proxy_targets(self.proxy_addrs))
        return list(self.proxy_addrs)

    # --- tasks ---

    def submit(self, data: Any, workflow: Any, workflow_kwargs=None, **kwargs: Any) -> int:
        """Queue one rollout task (dispatched when the staleness bound allows)."""
        task = _Task(
            next(self._ids),
            data,
            dict(workflow=workflow, workflow_kwargs=workflow_kwargs, **kwargs),
        )
        self.staleness.on_enqueue()
        with self._lock:
            self._pending.append(task)
            self._lock.notify_all()
        return task.task_id

    def _next_task(self) -> _Task | None:
        if self._pending:
            return self._pending.popleft()
        if self._source is None:
            return None
        row_key, data, submit_kwargs = next(self._source)
        self.staleness.on_enqueue()
        task = _Task(next(self._ids), data, submit_kwargs, row_key=row_key)
        if row_key is not None:
            self._row_keys[task.task_id] = row_key
        return task

    def _dispatch_loop(self) -> None:
        while not self._stopping:
            with self._lock:
                if self._health_error is not None or self._error is not None:
                    return  # the run is failing: launch nothing more
                task = None
                if not self._barrier_closed and self.staleness.get_capacity() > 0:
                    task = self._next_task()
                if task is None:
                    self._lock.wait(timeout=0.1)
                    continue
                self.staleness.on_submit()
                task.worker = next(self._rr) % len(self.workers)
                task.started = time.monotonic()
                self._inflight[task.task_id] = task
                if self.config.enable_rollout_tracing:
                    logger.info(
                        "dispatched task %d (row %s) to %s",
                        task.task_id,
                        task.row_key,
                        self.workers[task.worker].id,
                    )
            kwargs = dict(task.submit_kwargs)
            if self.proxy_addrs and kwargs.get("proxy_addr"):
                # pairing: the proxy in front of this worker's server
                kwargs["proxy_addr"] = self.proxy_addrs[task.worker]
            try:
                self._remote.engines[task.worker].submit(task.data, task_id=task.task_id, **kwargs)
            except Exception as e:
                # A worker that cannot take tasks would turn every remaining row into a
                # rejection; stop and let wait() report why.
                worker_id = self.workers[task.worker].id
                logger.error("submitting task %d to %s failed: %s", task.task_id, worker_id, e)
                self._error = e
                self._finish(task.task_id, None)
                return

    def _fetch_loop(self, index: int) -> None:
        """Long-poll worker ``index`` for finished tasks; acknowledge what arrived next time."""
        worker, engine = self.workers[index], self._remote.engines[index]
        ack: list[int] = []
        while not self._stopping:
            try:
                finished = engine.collect_finished(ack, timeout=COLLECT_TIMEOUT)
            except WorkerFailedError as e:
                # the scheduler saw the process exit: fail now, not after the health checks
                if not self._stopping:
                    target = HealthTarget(ROLLOUT_WORKER, worker.address, worker.id)
                    detail = (
                        "its process died"
                        if e.exit_code is None
                        else f"its process exited with code {e.exit_code}"
                    )
                    if e.logs.strip():
                        detail += f"; last log lines:\n{e.logs.strip()}"
                    self._on_health_failure(RolloutHealthError(target, 0, detail))
                return
            except Exception as e:  # anything else dead is the health supervisor's to report
                if not self._stopping:
                    logger.warning("collecting finished tasks from %s failed: %s", worker.id, e)
                    time.sleep(COLLECT_TIMEOUT)
                continue
            ack = []
            for task_id, trajectory in finished or []:
                ack.append(int(task_id))
                self._finish(int(task_id), trajectory)  # a repeat (lost ack) is ignored

    def _finish(self, task_id: int, trajectory: Any) -> None:
        with self._lock:
            if self._inflight.pop(task_id, None) is None:
                return
            if trajectory is None:
                self.staleness.on_reject()
                self._settle_rows([task_id])  # never trained, and not retried on resume
                self._rejected_in_a_row += 1
                self._check_rejection_storm()
            else:
                self.staleness.on_accept()
                self._rejected_in_a_row = 0
            if self.config.enable_rollout_tracing:
                outcome = "rejected" if trajectory is None else "accepted"
                logger.info("task %d %s", task_id, outcome)
            self._results[task_id] = trajectory
            self._lock.notify_all()

    def _check_rejection_storm(self) -> None:
        """Stop the run when every recent rollout failed (caller holds the lock).

        Servers that answer their health checks can still fail every generation, and an
        Arena can fail every task; either would launch task after task with nothing to
        train on. ``rollout.max_consecutive_rejections`` bounds that.
        """
        limit = self.config.max_consecutive_rejections
        if limit and self._rejected_in_a_row >= limit and self._error is None:
            self._error = RuntimeError(
                f"the last {self._rejected_in_a_row} rollouts were all rejected (no accepted "
                "trajectory): the inference servers or the environment fail every task; "
                f"see {self.role}.log (rollout.max_consecutive_rejections={limit})"
            )
            logger.error("%s; dispatch stopped", self._error)

    def _settle_rows(self, task_ids: list[int]) -> None:
        """The rows of these tasks are done with (trained or rejected); caller holds the lock."""
        keys = [self._row_keys.pop(t) for t in task_ids if t in self._row_keys]
        if keys and self._settle is not None:
            self._settle(keys)

    def wait(self, count: int, timeout: float | None = None) -> list[Any]:
        """``count`` accepted trajectories, in task order (rejected ones are skipped)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        accepted: list[tuple[int, Any]] = []
        with self._lock:
            while True:
                self.check_health()
                if self._error is not None:
                    raise RuntimeError(f"rollout dispatch stopped: {self._error}") from self._error
                for task_id in sorted(self._results):
                    trajectory = self._results.pop(task_id)
                    if trajectory is not None:
                        accepted.append((task_id, trajectory))
                if len(accepted) >= count:
                    accepted.sort(key=lambda item: item[0])  # dataloader order, reproducible
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(f"{len(accepted)} of {count} rollouts within {timeout}s")
                self._lock.wait(timeout=0.2)
            extra = accepted[count:]
            for task_id, trajectory in extra:  # kept for the next call
                self._results[task_id] = trajectory
            self._settle_rows([task_id for task_id, _ in accepted[:count]])  # handed to training
        return [trajectory for _, trajectory in accepted[:count]]

    def prepare_batch(
        self,
        dataloader: Iterable[list[Any]],
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        should_accept_fn: str | None = None,
        group_size: int = 1,
        reward_normalization: bool = False,
        drop_incomplete_group: bool = False,
        proxy_addr: str | None = None,
        batch_size: int | None = None,
    ) -> list[Any]:
        """Keep drawing rows while the bound allows; return one batch of accepted groups.

        With a dataloader that tracks rows (``tracked()`` and ``settle(keys)``, as
        :class:`~areal.trainer.dataloader.StatefulDataLoader` has), every row drawn stays
        outstanding until its group is returned here or rejected.
        """
        if self._source is None:
            kwargs = dict(
                workflow=workflow,
                workflow_kwargs=workflow_kwargs,
                should_accept_fn=should_accept_fn,
                group_size=group_size,
                reward_normalization=reward_normalization,
                drop_incomplete_group=drop_incomplete_group,
                proxy_addr=proxy_addr,
            )
            tracked = getattr(dataloader, "tracked", None)
            if callable(tracked):
                self._settle = dataloader.settle
                keyed = (item for batch in _cycle(tracked) for item in batch)
            else:
                keyed = ((None, row) for batch in _cycle(lambda: iter(dataloader)) for row in batch)
            self._source = ((key, row, kwargs) for key, row in keyed)
            with self._lock:
                self._lock.notify_all()
        return self.wait(batch_size or self.config.consumer_batch_size)

    def rollout_batch(
        self,
        rows: Iterable[Any],
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        **submit_kwargs: Any,
    ) -> list[Any]:
        """Submit every row and wait for all of them (evaluation): one result per row, in
        row order, ``None`` where the rollout was rejected. Nothing is drawn from a
        dataloader, so this controller should not also serve :meth:`prepare_batch`."""
        ids = [self.submit(row, workflow, workflow_kwargs, **submit_kwargs) for row in rows]
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while not all(task_id in self._results for task_id in ids):
                self.check_health()
                if self._error is not None:
                    raise RuntimeError(f"rollout dispatch stopped: {self._error}") from self._error
                if deadline is not None and time.monotonic() > deadline:
                    done = sum(task_id in self._results for task_id in ids)
                    raise TimeoutError(f"{done} of {len(ids)} rollouts within {timeout}s")
                self._lock.wait(timeout=0.2)
            return [self._results.pop(task_id) for task_id in ids]

    # --- stats ---

    def export_stats(self) -> dict[str, float]:
        merged = merge_worker_stats(self._remote.on_all(lambda worker: worker.export_stats.acall()))
        if self.role != "rollout":  # e.g. eval-rollout: its workers record under rollout/ too
            merged = {_rescoped(k, self.role): v for k, v in merged.items()}
        stat = self.staleness.get_stats() if self.staleness else None
        if stat is not None:
            stats_tracker.get(self.role).scalar(running=stat.running, accepted_total=stat.accepted)
        return merged


def _rescoped(key: str, scope: str) -> str:
    """``rollout/<name>`` as ``<scope>/<name>``; other keys unchanged."""
    return f"{scope}/{key.removeprefix('rollout/')}" if key.startswith("rollout/") else key


def _cycle(batches: Callable[[], Iterable[list[Any]]]) -> Iterator[list[Any]]:
    """Epoch after epoch of ``batches()`` (``set_epoch`` is the dataloader's business)."""
    while True:
        empty = True
        for batch in batches():
            empty = False
            yield batch
        if empty:
            raise ValueError("the dataloader yields no batches")
