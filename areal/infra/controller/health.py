"""Health supervision of inference servers and rollout workers: a dead one fails the run.

A rollout against a dead inference server fails and is rejected, and the dispatcher would
replace it with a new one forever (each new one launching, say, another Arena task). The
:class:`HealthSupervisor` probes every watched endpoint on its own thread, every
``interval`` seconds with a ``timeout``; an endpoint that fails ``failures`` consecutive
probes (no answer in time, or HTTP 5xx) is dead, and ``on_failure`` gets a
:class:`RolloutHealthError` naming it. The rollout controller then stops dispatching and
raises that error to the trainer.

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

__all__ = ["HealthSupervisor", "HealthTarget", "RolloutHealthError"]

logger = logging.getLogger("rollout.health")


@dataclass(frozen=True)
class HealthTarget:
    """One watched endpoint: ``kind`` ("inference server" or "rollout worker"), its
    ``host:port``, and the rollout worker it belongs to."""

    kind: str
    address: str
    worker_id: str
    path: str = "/health"
    quiet_path: str | None = None  # probed instead while the servers are paused

    def describe(self) -> str:
        if self.kind == "rollout worker":
            return f"rollout worker {self.worker_id} at {self.address}"
        return f"{self.kind} {self.address} (rollout worker {self.worker_id})"


class RolloutHealthError(RuntimeError):
    """An inference server or rollout worker stopped answering its health checks."""

    def __init__(self, target: HealthTarget, failures: int, detail: str):
        self.target = target
        self.failures = failures
        self.detail = detail
        checks = "the health check" if failures == 1 else f"{failures} consecutive health checks"
        super().__init__(
            f"{target.describe()} failed {checks} (last: {detail}); "
            "rollout dispatch stopped and the run is failed"
        )


class HealthSupervisor:
    """Probes ``targets`` every ``interval`` seconds until one is dead or :meth:`stop`.

    ``on_failure`` is called once, from the supervisor's thread, with the first dead
    target's error. ``quiet`` says whether servers are paused (see the module docstring).
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
        self._stop = threading.Event()
        self._client = httpx.Client(timeout=timeout, trust_env=False)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, min(16, len(self.targets))), thread_name_prefix=f"{name}-probe"
        )
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> None:
        self._thread.start()

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

    def _probe_all(self) -> list[str | None]:
        return list(self._pool.map(self.probe, self.targets))

    def check_round(self) -> RolloutHealthError | None:
        """Probe every target once; the first one whose failure streak reached the limit."""
        dead = None
        for target, problem in zip(self.targets, self._probe_all(), strict=True):
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
            if streak >= self.failures and dead is None:
                dead = RolloutHealthError(target, streak, problem)
        return dead

    def diagnose(self) -> RolloutHealthError | None:
        """One probe of every target now; an error for the first that did not answer.

        For explaining a failure that has already happened (a weight update that could
        not reach a server), so a single failed probe is enough.
        """
        for target, problem in zip(self.targets, self._probe_all(), strict=True):
            if problem is not None:
                return RolloutHealthError(target, 1, problem)
        return None
