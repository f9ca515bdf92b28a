"""Health supervision of rollout workers, their servers and proxies: a dead one fails the run.

A rollout against a dead inference server fails and is rejected, and the dispatcher would
replace it with a new one forever (each new one launching, say, another Arena task). The
:class:`HealthSupervisor` probes every watched endpoint on its own thread, every
``interval`` seconds with a ``timeout``; an endpoint that fails ``failures`` consecutive
probes (no answer in time, or HTTP 5xx) is dead, and ``on_failure`` gets a
:class:`RolloutHealthError` naming it. The rollout controller then stops dispatching and
raises that error to the trainer.

A rollout worker's servers and proxies are its children and die with it, often within the
same probe round; the error then names the worker, which explains the others (a dead
server or proxy whose worker also fails its probe is blamed on the worker).

While the servers are paused for a weight update (``quiet()`` is true), servers are
probed on their ``quiet_path`` instead: SGLang's ``/health`` runs a one-token generation,
which a paused scheduler cannot answer, whereas ``/get_model_info`` is answered by its
HTTP process alone. A killed server refuses the connection either way.
"""

from __future__ import annotations

import concurrent.futures
import threading
from collections.abc import Callable
from dataclasses import dataclass

import httpx

from areal.utils import logging

__all__ = [
    "INFERENCE_SERVER",
    "ROLLOUT_PROXY",
    "ROLLOUT_WORKER",
    "HealthSupervisor",
    "HealthTarget",
    "RolloutHealthError",
]

logger = logging.getLogger("rollout.health")

INFERENCE_SERVER = "inference server"
ROLLOUT_PROXY = "rollout proxy"
ROLLOUT_WORKER = "rollout worker"
MAX_PROBE_THREADS = 16


@dataclass(frozen=True)
class HealthTarget:
    """One watched endpoint: ``kind`` (:data:`INFERENCE_SERVER`, :data:`ROLLOUT_PROXY` or
    :data:`ROLLOUT_WORKER`), its ``host:port``, and the rollout worker it belongs to."""

    kind: str
    address: str
    worker_id: str
    path: str = "/health"
    quiet_path: str | None = None  # probed instead while the servers are paused

    def describe(self) -> str:
        if self.kind == ROLLOUT_WORKER:
            return f"{ROLLOUT_WORKER} {self.worker_id} at {self.address}"
        return f"{self.kind} {self.address} ({ROLLOUT_WORKER} {self.worker_id})"


class RolloutHealthError(RuntimeError):
    """A rollout worker, inference server or rollout proxy stopped answering its health
    checks (``failures`` of them; 0: its scheduler saw the process exit); ``gone_with``
    are the worker's servers and proxies that stopped with it."""

    def __init__(
        self,
        target: HealthTarget,
        failures: int,
        detail: str,
        gone_with: tuple[HealthTarget, ...] = (),
    ):
        self.target = target
        self.failures = failures
        self.detail = detail
        self.gone_with = gone_with
        if failures == 0:  # its scheduler saw the process exit: no probe needed to know
            what = f"exited ({detail})"
        elif failures == 1:
            what = f"failed the health check (last: {detail})"
        else:
            what = f"failed {failures} consecutive health checks (last: {detail})"
        children = ""
        if gone_with:
            *others, last = [f"{t.kind} {t.address}" for t in gone_with]
            names = f"{', '.join(others)} and {last}" if others else last
            children = f"; its {names} stopped answering with it"
        super().__init__(
            f"{target.describe()} {what}{children}; rollout dispatch stopped and the run is failed"
        )


class HealthSupervisor:
    """Probes ``targets`` every ``interval`` seconds until one is dead or :meth:`stop`.

    ``on_failure`` is called once, from the supervisor's thread, with the first dead
    target's error (its worker's, when the worker fails too). ``quiet`` says whether
    servers are paused (see the module docstring). :meth:`watch` adds targets later.
    """

    def __init__(
        self,
        targets: list[HealthTarget],
        *,
        interval: float,
        timeout: float,
        failures: int,
        on_failure: Callable[[RolloutHealthError], None],
        quiet: Callable[[], bool] = lambda: False,
        name: str = "rollout-health",
    ):
        self.targets = list(targets)
        self.interval = interval
        self.timeout = timeout
        self.failures = failures
        self.on_failure = on_failure
        self.quiet = quiet
        self._streaks = dict.fromkeys(self.targets, 0)
        self._targets_lock = threading.Lock()
        self._stop = threading.Event()
        self._client = httpx.Client(timeout=timeout, trust_env=False)
        # threads start on demand, so the cap costs nothing while few targets are watched
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=MAX_PROBE_THREADS, thread_name_prefix=f"{name}-probe"
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def watch(self, targets: list[HealthTarget]) -> None:
        """Probe ``targets`` too from the next round on (e.g. proxies started later)."""
        with self._targets_lock:
            for target in targets:
                if target not in self._streaks:
                    self.targets.append(target)
                    self._streaks[target] = 0

    def stop(self) -> None:
        """End the probing thread and release its connections."""
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=self.timeout + 1)
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._client.close()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            failure = self.check_round()
            if failure is not None and not self._stop.is_set():
                self.on_failure(failure)
                return

    # --- probing ---

    def probe(self, target: HealthTarget) -> str | None:
        """Why ``target`` failed one probe now, or ``None`` when it answered."""
        path = target.quiet_path if target.quiet_path and self.quiet() else target.path
        try:
            response = self._client.get(f"http://{target.address}{path}")
        except httpx.HTTPError as e:
            return f"GET {path}: {type(e).__name__}: {str(e) or 'no answer'}"
        if response.status_code >= 500:
            return f"GET {path}: HTTP {response.status_code}"
        return None

    def _probe_all(self) -> dict[HealthTarget, str | None]:
        with self._targets_lock:
            targets = list(self.targets)
        return dict(zip(targets, self._pool.map(self.probe, targets), strict=True))

    def check_round(self) -> RolloutHealthError | None:
        """Probe every target once; the error of one whose failure streak reached the limit."""
        problems = self._probe_all()
        dead = []
        for target, problem in problems.items():
            if problem is None:
                self._streaks[target] = 0
                continue
            self._streaks[target] += 1
            streak = self._streaks[target]
            logger.warning(
                "%s failed a health check (%d of %d): %s",
                target.describe(),
                streak,
                self.failures,
                problem,
            )
            if streak >= self.failures:
                dead.append(target)
        return self._blame(dead, problems, lambda target: self._streaks[target])

    def diagnose(self) -> RolloutHealthError | None:
        """One probe of every target now; an error for one that did not answer.

        For explaining a failure that has already happened (a weight update that could
        not reach a server), so a single failed probe is enough.
        """
        problems = self._probe_all()
        failing = [target for target, problem in problems.items() if problem is not None]
        return self._blame(failing, problems, lambda target: 1)

    @staticmethod
    def _blame(
        dead: list[HealthTarget],
        problems: dict[HealthTarget, str | None],
        streak: Callable[[HealthTarget], int],
    ) -> RolloutHealthError | None:
        """The error for the cause among ``dead``: the rollout worker of a dead target when
        that worker failed this round too (it took its servers and proxies down with it),
        else the first dead target."""
        if not dead:
            return None
        workers = {t.worker_id: t for t in problems if t.kind == ROLLOUT_WORKER}
        for target in dead:
            worker = workers.get(target.worker_id)
            if worker is not None and problems[worker] is not None:
                gone_with = tuple(
                    t
                    for t, problem in problems.items()
                    if t.worker_id == worker.worker_id and t != worker and problem is not None
                )
                return RolloutHealthError(worker, streak(worker), problems[worker], gone_with)
        first = dead[0]
        return RolloutHealthError(first, streak(first), problems[first])
