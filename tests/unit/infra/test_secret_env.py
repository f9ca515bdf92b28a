"""Config secrets reach workers through their environment, never in an RPC body
(docs/design.md#secrets-are-a-type)."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
from pathlib import Path

import pytest

from areal.api.cli_args import ClusterSpecConfig, NameResolveConfig, PPOConfig, SchedulingSpec
from areal.api.engine_api import InferenceEngine, engine_interface
from areal.api.scheduler_api import Job
from areal.infra.rpc.client import RPCClient
from areal.infra.rpc.secret_env import SECRET_ENV_PREFIX, config_secrets, secret_refs
from areal.infra.rpc.serialization import (
    SerializationError,
    deserialize_value,
    serialize_value,
)
from areal.infra.scheduler.local import LocalScheduler
from areal.utils import name_resolve
from areal.utils.secrets import SecretStr, reveal
from tests.unit.infra.fake_engines import EchoEngine

REPO_ROOT = Path(__file__).resolve().parents[3]
SENTINEL = "sentinel-admin-key-7f3a9c"
ADMIN_ENV = f"{SECRET_ENV_PREFIX}ROLLOUT_AGENT_ADMIN_API_KEY"


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


@engine_interface
class RolloutConfigEngine(EchoEngine):
    """Built from a rollout config, as the rollout worker's engine is."""

    def __init__(self, config, name: str = "rollout"):
        super().__init__(name)
        self.config = config

    def admin_key_digest(self) -> str:
        # a digest, so the answer does not carry the key either
        return sha(reveal(self.config.agent.admin_api_key))

    def digest_of(self, key: SecretStr) -> str:
        assert isinstance(key, SecretStr)
        return sha(reveal(key))


# InferenceEngine subclass check of /create_engine
assert issubclass(RolloutConfigEngine, InferenceEngine)


def make_config(root: Path) -> PPOConfig:
    config = PPOConfig(
        experiment_name="exp",
        trial_name="trial",
        cluster=ClusterSpecConfig(
            fileroot=str(root / "files"),
            n_gpus_per_node=1,
            name_resolve=NameResolveConfig(nfs_record_root=str(root / "name_resolve")),
        ),
    )
    config.rollout.agent.admin_api_key = SecretStr(SENTINEL)
    return config


def test_config_secrets_are_named_by_path_and_exported_once():
    config = make_config(Path("/tmp/unused"))
    found = config_secrets(config)
    assert found[ADMIN_ENV] == SENTINEL and isinstance(found[ADMIN_ENV], SecretStr)
    assert all(reveal(v) for v in found.values())  # empty secrets are not exported
    # a copy of the same value elsewhere (the eval rollout config) reuses the one name
    nested = {"a": config.rollout, "b": [dataclasses.replace(config.rollout)]}
    names = list(config_secrets(nested))
    assert f"{SECRET_ENV_PREFIX}A_AGENT_ADMIN_API_KEY" in names
    assert not any(n.startswith(f"{SECRET_ENV_PREFIX}B_") for n in names)


def test_a_known_secret_travels_as_a_variable_name(monkeypatch):
    config = make_config(Path("/tmp/unused"))
    exported = config_secrets(config)
    refs = secret_refs(exported)
    payload = {"cfg": config.rollout, "key": SecretStr(SENTINEL)}
    encoded = json.dumps(serialize_value(payload, secret_env=refs))
    assert SENTINEL not in encoded and ADMIN_ENV in encoded

    for name, value in exported.items():
        monkeypatch.setenv(name, value.reveal())
    out = deserialize_value(json.loads(encoded))
    assert isinstance(out["key"], SecretStr) and out["key"].reveal() == SENTINEL
    assert out["cfg"].agent.admin_api_key.reveal() == SENTINEL

    monkeypatch.delenv(ADMIN_ENV)
    with pytest.raises(SerializationError, match=ADMIN_ENV):
        deserialize_value(json.loads(encoded))


def test_unknown_secrets_are_refused_and_foreign_variables_are_not_read(monkeypatch):
    with pytest.raises(SerializationError, match=r"value\['token'\]"):
        serialize_value({"token": SecretStr("not-exported")}, secret_env={})
    # an empty secret has nothing to hide
    assert serialize_value(SecretStr(""), secret_env={})["value"] == ""
    monkeypatch.setenv("HOME_SECRET", "x")
    forged = {"__areal_type__": "secret", "value": None, "env": "HOME_SECRET"}
    with pytest.raises(SerializationError, match="not a secret variable"):
        deserialize_value(forged)


@pytest.fixture
def scheduler(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO_ROOT)  # workers import tests.* through the controller's cwd
    sched = LocalScheduler(make_config(tmp_path), gpu_devices=[0], stop_grace=5.0)
    yield sched
    sched.delete_workers()
    name_resolve.reconfigure("memory")


def test_the_admin_key_reaches_the_worker_but_no_request_body(scheduler, monkeypatch):
    bodies: list[bytes] = []
    send = RPCClient._send  # every request of the RPC client goes through it

    async def spy_send(self, method, path, content, timeout):
        bodies.append(content)
        return await send(self, method, path, content, timeout)

    monkeypatch.setattr(RPCClient, "_send", spy_send)

    scheduler.create_workers(Job("rollout", 1, [SchedulingSpec(port_count=1)], secrets="rollout"))
    (worker,) = scheduler.get_workers("rollout", timeout=60.0)
    # what the rollout controller sends: a copy of the experiment's rollout config
    worker_config = dataclasses.replace(scheduler.config.rollout)
    engine = f"{__name__}.RolloutConfigEngine"
    asyncio.run(scheduler.create_engine(worker.id, engine, None, worker_config))
    assert scheduler.call_engine(worker.id, "admin_key_digest") == sha(SENTINEL)
    key = scheduler.config.rollout.agent.admin_api_key
    assert scheduler.call_engine(worker.id, "digest_of", key) == sha(SENTINEL)

    create = [b for b in bodies if b"RolloutConfigEngine" in b]
    assert create and ADMIN_ENV.encode() in create[0]
    assert any(b'"config"' in b for b in bodies)  # /configure went out too
    assert all(SENTINEL.encode() not in b for b in bodies)
    pid = scheduler.worker_pids()[worker.id]
    assert SENTINEL.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()


def test_secrets_are_refused_in_set_env_and_fork_bodies():
    from areal.infra.rpc.client import RPCClient
    from areal.infra.rpc.loop import run_sync
    from areal.infra.scheduler.exceptions import WorkerConfigurationError

    client = RPCClient("127.0.0.1:9", token="t", worker_id="w/0")  # nothing is sent
    with pytest.raises(WorkerConfigurationError, match="KEY"):
        run_sync(client.set_env({"KEY": SecretStr(SENTINEL), "PLAIN": "1"}))
    with pytest.raises(WorkerConfigurationError, match="KEY"):
        run_sync(client.fork("r", 0, ["python"], env={"KEY": SecretStr(SENTINEL)}))
    run_sync(client.close())
