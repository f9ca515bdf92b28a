"""Name-resolve keys shared by the controller, workers and inference servers.

With the ``nfs`` backend a key is a directory path under the record root, so every name in
it (experiment, trial, role) must be a single safe path part; a bad one raises
``ValueError`` naming it.
"""

from __future__ import annotations

from areal.utils.paths import check_path_name, get_user

__all__ = ["gen_servers", "trial_root", "update_weights_from_disk", "worker", "workers"]


def trial_root(experiment_name: str, trial_name: str) -> str:
    check_path_name(experiment_name, "experiment_name")
    check_path_name(trial_name, "trial_name")
    return f"{get_user()}/{experiment_name}/{trial_name}"


def workers(experiment_name: str, trial_name: str, role: str) -> str:
    check_path_name(role, "worker role name")
    return f"{trial_root(experiment_name, trial_name)}/workers/{role}"


def worker(experiment_name: str, trial_name: str, role: str, index: int) -> str:
    """Key whose value is ``"<ip>:<port>"`` of a worker's RPC server."""
    return f"{workers(experiment_name, trial_name, role)}/{int(index)}"


def gen_servers(experiment_name: str, trial_name: str) -> str:
    return f"{trial_root(experiment_name, trial_name)}/gen_servers"


def update_weights_from_disk(experiment_name: str, trial_name: str, version: int) -> str:
    """Published by the trainer once the checkpoint for ``version`` is on disk."""
    return f"{trial_root(experiment_name, trial_name)}/update_weights_from_disk/{int(version)}"
