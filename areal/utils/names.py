"""Name-resolve keys shared by the controller, workers and inference servers."""

from __future__ import annotations

from areal.utils.paths import get_user

__all__ = ["gen_servers", "trial_root", "update_weights_from_disk", "worker", "workers"]


def trial_root(experiment_name: str, trial_name: str) -> str:
    return f"{get_user()}/{experiment_name}/{trial_name}"


def workers(experiment_name: str, trial_name: str, role: str) -> str:
    return f"{trial_root(experiment_name, trial_name)}/workers/{role}"


def worker(experiment_name: str, trial_name: str, role: str, index: int) -> str:
    """Key whose value is ``"<ip>:<port>"`` of a worker's RPC server."""
    return f"{workers(experiment_name, trial_name, role)}/{index}"


def gen_servers(experiment_name: str, trial_name: str) -> str:
    return f"{trial_root(experiment_name, trial_name)}/gen_servers"


def update_weights_from_disk(experiment_name: str, trial_name: str, version: int) -> str:
    """Published by the trainer once the checkpoint for ``version`` is on disk."""
    return f"{trial_root(experiment_name, trial_name)}/update_weights_from_disk/{version}"
