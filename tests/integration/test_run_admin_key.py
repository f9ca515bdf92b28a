"""An agent run with no admin key set: its proxy, on the host's outward address, answers
admin calls only with the run's own random key, and each process holds only its secrets.

Before, ``rollout.agent.admin_api_key`` left at its default loaded as the printed form
``<redacted>``: the toy ``VowelAgent`` run started a proxy off loopback whose admin key was
that public string (capacity, sessions, export and stats answered 200 with it).
"""

from __future__ import annotations

import getpass
from pathlib import Path

import httpx
import pytest

from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.api.scheduler_api import RPC_TOKEN_ENV
from areal.inference.auth import API_KEY_ENV
from areal.infra.rpc.processes import descendant_pids
from areal.proxy.keys import DEFAULT_ADMIN_API_KEY, is_loopback_host
from areal.trainer.rl_trainer import PPOTrainer
from areal.utils.secrets import REDACTED, reveal
from tests.unit.infra.test_role_secrets import environ_of

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
YAML = REPO / "examples" / "toy" / "toy_grpo.yaml"
ARENA_TOKEN = "sentinel-arena-token-9d2b77"
PROCESS_KINDS = {"areal.proxy.server": "proxy", "areal.inference.server": "server"}
ADMIN_CALLS = (
    ("/grant_capacity", {}),
    ("/rl/start_session", {"task_id": "intruder"}),
    ("/export_trajectories", {"session_id": "x"}),
    ("/rl/stats", {}),
)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_an_agent_run_without_a_key_serves_admin_calls_only_with_its_random_key(
    tmp_path, monkeypatch
):
    from examples.toy.chat_agent import make_chat_dataset
    from examples.toy.train import build_inputs

    monkeypatch.setenv("AREAL_FILEROOT", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ARENA_OPENAPI_TOKEN", ARENA_TOKEN)
    for name in (RPC_TOKEN_ENV, "SWE_RL_ADMIN_API_KEY", "AREAL_ALLOW_DEFAULT_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    config, _ = load_expr_config(
        ["--config", str(YAML), "trial_name=nokey", "total_train_steps=1", "gconfig.n_samples=2"],
        GRPOConfig,
    )
    assert reveal(config.rollout.agent.admin_api_key) == ""  # nothing set
    build_inputs(config)  # builds the tiny model
    seen: dict = {}

    class Trainer(PPOTrainer):
        def after_step(self, step_info, stats):
            (proxy,) = self.rollout.proxy_addrs
            key = reveal(self.config.rollout.agent.admin_api_key)
            answers = {}
            for name, token in (("printed", REDACTED), ("default", DEFAULT_ADMIN_API_KEY)):
                for path, body in ADMIN_CALLS:
                    headers = {"Authorization": f"Bearer {token}"}
                    response = httpx.post(f"{proxy}{path}", json=body, headers=headers)
                    answers[(name, path)] = response.status_code
            own = httpx.post(f"{proxy}/grant_capacity", headers={"Authorization": f"Bearer {key}"})
            answers[("own", "/grant_capacity")] = own.status_code
            pids = self.scheduler.worker_pids()
            children = {pid: descendant_pids(pid) for pid in pids.values()}
            envs = {}
            for worker_id, pid in pids.items():
                envs[worker_id] = environ_of(pid)
                for child in children[pid]:
                    for module, kind in PROCESS_KINDS.items():
                        if module in _cmdline(child):
                            envs[f"{worker_id}:{kind}"] = environ_of(child)
            seen.update(proxy=proxy, key=key, answers=answers, envs=envs, stats=dict(stats))

    with Trainer(config, make_chat_dataset(8)) as trainer:
        trainer.train("examples.toy.chat_agent.VowelAgent", workflow_kwargs={"max_tokens": 4})
        log_dir = trainer.log_dir

    host = seen["proxy"].removeprefix("http://").rsplit(":", 1)[0]
    assert not is_loopback_host(host), host  # the proxy serves the outward address
    refused = {k: v for k, v in seen["answers"].items() if k[0] != "own"}
    assert set(refused.values()) == {403}, refused
    key = seen["key"]
    assert len(key) >= 40 and key not in (REDACTED, DEFAULT_ADMIN_API_KEY)
    assert seen["answers"][("own", "/grant_capacity")] == 200
    assert 0.0 <= seen["stats"]["rollout/reward_mean"] <= 1.0

    envs = seen["envs"]
    admin_vars = {
        worker: sorted(k for k, v in env.items() if v == key) for worker, env in envs.items()
    }
    assert {w for w in envs if w.startswith("actor/")}, sorted(envs)
    assert all(admin_vars[w] == [] for w in envs if w.startswith("actor/"))
    assert admin_vars["rollout/0"] == ["AREAL_SECRET_ROLLOUT_AGENT_ADMIN_API_KEY"]
    assert admin_vars["rollout/0:proxy"] == ["SWE_RL_ADMIN_API_KEY"]
    assert admin_vars["rollout/0:server"] == []
    for worker, env in envs.items():
        holds_arena = env.get("ARENA_OPENAPI_TOKEN") == ARENA_TOKEN
        assert holds_arena == (worker == "rollout/0"), worker  # only the rollout worker
        assert (RPC_TOKEN_ENV in env) == (":" not in worker), worker  # workers, not children
        assert (API_KEY_ENV in env) == worker.startswith("rollout/0"), worker
    for path in log_dir.rglob("*"):
        if path.is_file():
            assert key not in path.read_text(errors="replace"), path
    assert getpass.getuser() in str(log_dir)
