"""Worker jobs a killed controller left in the queue: whether a new controller may cancel them.

A controller killed outright (SIGKILL, its own Slurm job cancelled) runs no cleanup, so its
worker jobs may still be queued or running when the same trial is submitted again. Each
worker job's ``--comment`` names the Slurm job of the controller that submitted it
(:data:`~areal.infra.scheduler.slurm_batch.CONTROLLER_COMMENT`); a new controller cancels
the jobs whose controller is over, and refuses to start beside jobs whose controller
lives or cannot be told.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from areal.infra.scheduler.exceptions import SchedulerError
from areal.infra.scheduler.slurm_batch import CONTROLLER_COMMENT, CONTROLLER_ENDED_STATES

__all__ = ["LeftoverJob", "SlurmClient", "controller_end", "ended_controllers", "find_leftovers"]

# runs a Slurm client: SlurmScheduler._slurm (args, then check= and timeout=)
SlurmClient = Callable[..., subprocess.CompletedProcess]


@dataclass(frozen=True)
class LeftoverJob:
    """A queued or running job of this trial that this controller did not submit."""

    job_id: str
    name: str
    state: str
    controller: str | None  # the Slurm job id of the controller that submitted it


def find_leftovers(slurm: SlurmClient, user: str, prefix: str) -> list[LeftoverJob]:
    """``user``'s active jobs whose name starts with ``prefix`` (``{exp}_{trial}:``)."""
    result = slurm("squeue", "-h", "-u", user, "-o", "%i|%j|%k|%T")
    jobs = []
    for line in result.stdout.splitlines():
        job_id, _, rest = line.strip().partition("|")
        name, comment, state = [*rest.rsplit("|", 2), "", ""][:3]
        if not job_id or not name.startswith(prefix):
            continue
        owner = comment.removeprefix(CONTROLLER_COMMENT)
        controller = owner if comment.startswith(CONTROLLER_COMMENT) and owner.isdigit() else None
        jobs.append(LeftoverJob(job_id, name, state, controller))
    return jobs


def controller_end(slurm: SlurmClient, job_id: str) -> str | None:
    """How controller job ``job_id`` ended (its state, or ``"no longer in the queue"``), or
    None while it lives. The same test as the batch script's watcher
    (:func:`~areal.infra.scheduler.slurm_batch.controller_watcher`)."""
    result = slurm("squeue", "-h", "-j", job_id, "-o", "%T", check=False, timeout=10.0)
    if result.returncode != 0:
        if "Invalid job id" in result.stderr:
            return "no longer in the queue"
        raise SchedulerError(
            f"cannot tell whether controller job {job_id} still runs: squeue failed: "
            f"{result.stderr.strip()}; try again once slurmctld answers"
        )
    state = (result.stdout.split() or [""])[0]
    if not state:
        return "no longer in the queue"
    return state if state in CONTROLLER_ENDED_STATES else None


def ended_controllers(
    jobs: Iterable[LeftoverJob], own_job: str | None, slurm: SlurmClient, trial: str
) -> dict[str, str]:
    """The controller of every job in ``jobs`` and how it ended, if all jobs may be cancelled.

    A job may be cancelled when its controller's job is over, or is ``own_job`` (this
    controller's own job: the job is from an earlier run inside it). Raises
    ``SchedulerError`` naming the jobs and the fix when a controller still runs, or when a
    job records none (its controller ran outside Slurm, so whether it lives cannot be told).
    """
    by_controller: dict[str | None, list[str]] = {}
    for job in jobs:
        by_controller.setdefault(job.controller, []).append(job.job_id)
    ended: dict[str, str] = {}
    for controller, ids in by_controller.items():
        if controller is None:
            raise SchedulerError(
                f"trial {trial} already has Slurm job(s) {', '.join(ids)} from a controller "
                "that ran outside Slurm, so whether it still runs cannot be told; if it is "
                f"gone, run `scancel {' '.join(ids)}`, otherwise choose another trial_name"
            )
        if controller == own_job:
            ended[controller] = "this controller's own job, in an earlier run"
            continue
        end = controller_end(slurm, controller)
        if end is None:
            raise SchedulerError(
                f"trial {trial} already has Slurm job(s) {', '.join(ids)} of a controller "
                f"that still runs (Slurm job {controller}); `scancel {controller}` first, "
                "or choose another trial_name"
            )
        ended[controller] = end
    return ended
