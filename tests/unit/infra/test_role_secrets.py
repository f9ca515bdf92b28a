"""Each role's workers receive only the secrets they use.

Trainers get the RPC token and nothing else; rollout workers also get the rollout and
Arena secrets of the config, the Arena credentials of the controller's environment and
the inference API key; a rollout worker forked beside a trainer gets its secrets from a
private file, not from its parent, whose environment stays without them. Read from
``/proc/<pid>/environ`` of the real worker processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import stat
from pathlib import Path

import pytest

from areal.api.cli_args import SchedulingSpec, SchedulingStrategy
from areal.api.scheduler_api import RPC_TOKEN_ENV, Job
from areal.inference.auth import API_KEY_ENV
from areal.infra.rpc.secret_env import SECRETS_FILE_ENV, load_secrets_file, secrets_file_text
from areal.infra.scheduler.local import LocalScheduler
from areal.utils import name_resolve
from areal.utils.secrets import SecretStr
from tests.unit.infra.test_secret_env import ADMIN_ENV, REPO_ROOT, SENTINEL, make_config, sha

ARENA_TOKEN = "sentinel-arena-token-51c0de"
WANDB_KEY = "sentinel-wandb-key-0b7e11"
ENGINE = "tests.unit.infra.test_secret_env.RolloutConfigEngine"


def environ_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.split(b"=", 1) for item in raw.split(b"\0") if b"=" in item)
    return {k.decode(): v.decode(errors="replace") for k, v in pairs}


@pytest.fixture
def scheduler(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # workers import tests.* through the controller's cwd
    monkeypatch.setenv("ARENA_OPENAPI_TOKEN", ARENA_TOKEN)  # the controller's credentials
    monkeypatch.setenv("SWE_RL_ADMIN_API_KEY", SENTINEL)
    config = make_config(tmp_path)
    config.stats_logger.wandb.wandb_api_key = SecretStr(WANDB_KEY)
    sched = LocalScheduler(config, gpu_devices=[0], stop_grace=5.0)
    yield sched
    sched.delete_workers()
    name_resolve.reconfigure("memory")


def _admin_digest(scheduler: LocalScheduler, worker_id: str) -> str:
    config = dataclasses.replace(scheduler.config.rollout)
    asyncio.run(scheduler.create_engine(worker_id, ENGINE, None, config))
    return scheduler.call_engine(worker_id, "admin_key_digest")


def test_each_role_gets_only_the_secrets_it_uses(scheduler):
    spec = SchedulingSpec(port_count=1)
    scheduler.create_workers(Job("actor", 1, [spec]))
    scheduler.create_workers(Job("rollout", 1, [spec], secrets="rollout"))
    (actor,) = scheduler.get_workers("actor", timeout=60.0)
    (rollout,) = scheduler.get_workers("rollout", timeout=60.0)
    # a rollout worker forked beside a trainer (colocation) reads its secrets from a file
    fork = SchedulingStrategy(type="colocation", target="actor", fork=True)
    scheduler.create_workers(Job("eval-rollout", 1, [SchedulingSpec()], fork, secrets="rollout"))
    (forked,) = scheduler.get_workers("eval-rollout", timeout=60.0)
    pids = scheduler.worker_pids()
    actor_env, rollout_env = environ_of(pids[actor.id]), environ_of(pids[rollout.id])
    forked_env = environ_of(pids[forked.id])

    for env in (actor_env, rollout_env, forked_env):
        assert env[RPC_TOKEN_ENV] == scheduler.rpc_token.reveal()
        assert "SWE_RL_ADMIN_API_KEY" not in env  # config secrets go by their own names
        assert WANDB_KEY not in "\0".join(env.values())  # logger keys stay on the controller
    leaked = [
        k for k, v in actor_env.items() if k != RPC_TOKEN_ENV and v in (SENTINEL, ARENA_TOKEN)
    ]
    assert leaked == []
    assert API_KEY_ENV not in actor_env and ADMIN_ENV not in actor_env
    assert "ARENA_OPENAPI_TOKEN" not in actor_env

    assert rollout_env[ADMIN_ENV] == SENTINEL
    assert rollout_env["ARENA_OPENAPI_TOKEN"] == ARENA_TOKEN
    assert rollout_env[API_KEY_ENV] == scheduler.inference_api_key.reveal()

    # the forked child was started with only the file's path: its secrets are in no process
    # environment the trainer beside it could have handed down
    assert SECRETS_FILE_ENV in forked_env and ADMIN_ENV not in forked_env
    secrets_file = Path(forked_env[SECRETS_FILE_ENV])
    assert not secrets_file.exists()  # removed once read: no file holds them meanwhile
    assert stat.S_IMODE(secrets_file.parent.stat().st_mode) == 0o700

    # the same rollout config: rollout workers read the key, the trainer gets it empty
    assert _admin_digest(scheduler, rollout.id) == sha(SENTINEL)
    assert _admin_digest(scheduler, forked.id) == sha(SENTINEL)
    assert _admin_digest(scheduler, actor.id) == sha("")

    scheduler.delete_workers()
    assert not list(secrets_file.parent.glob("*.env"))


def test_secrets_files_are_refused_when_others_can_read_them(tmp_path):
    path = tmp_path / "role.env"
    path.write_text(secrets_file_text({"A": "it's $secret", "B": "two\nlines"}))
    os.chmod(path, 0o600)
    assert load_secrets_file(path) == {"A": "it's $secret", "B": "two\nlines"}
    os.chmod(path, 0o644)
    with pytest.raises(ValueError, match="0600"):
        load_secrets_file(path)


def test_a_role_cannot_share_the_processes_of_a_role_without_its_secrets(scheduler):
    from areal.infra.scheduler.exceptions import WorkerCreationError

    scheduler.create_workers(Job("actor", 1, [SchedulingSpec(port_count=1)]))
    alias = SchedulingStrategy(type="colocation", target="actor", fork=False)
    with pytest.raises(WorkerCreationError, match="fork: true"):
        scheduler.create_workers(Job("rollout", 1, [SchedulingSpec()], alias, secrets="rollout"))
