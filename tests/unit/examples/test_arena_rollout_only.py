"""The rollout-only tool (``examples.swe.arena_rollout_only``, cases O1 and O2) and its helpers."""

from __future__ import annotations

import json
import random
import re
from typing import Any

import httpx
import pytest
import torch

from areal.api.cli_args import load_expr_config
from examples.swe.arena_client import ArenaOpenAPIClient
from examples.swe.arena_rollout_only import (
    _check_supported,
    _run_rollout_tasks,
    _trajectory_reward,
    parse_args,
    registry_smoke,
    select_rows,
    summarize,
)
from examples.swe.train_swe_rl import ARENA_WORKFLOW
from examples.swe.utils import SWEPPOConfig
from tests.conftest import SECRET_SENTINEL, SWE_DIR
from tests.fakes.scripted_http import ScriptedHTTP, reply
from tests.unit.examples.test_train_swe_rl import BASE, TOKEN, FakeArena

PROXY = "http://proxy.test:8000"
ADMIN_KEY = f"admin-{SECRET_SENTINEL}"
SESSION_KEY = f"session-{SECRET_SENTINEL}"


# --- O1: rewards of a trajectory ---


def test_trajectory_reward_sums_tensor_rewards():
    assert _trajectory_reward({"rewards": torch.tensor([0.0, 0.75])}) == pytest.approx(0.75)


def test_trajectory_reward_sums_interaction_rewards():
    traj = {"interactions": [{"reward": 0}, {"reward": 1}, {"no_reward": True}, "not-an-object"]}
    assert _trajectory_reward(traj) == 1.0  # 0 + 1 + 0 (missing); the string is skipped


def test_trajectory_reward_needs_rewards_or_interactions():
    with pytest.raises(ValueError, match="rewards"):
        _trajectory_reward({"input_ids": torch.tensor([1, 2])})


# --- O2: one rejected task does not sink the others ---


class FakeEngine:
    """``submit``/``wait_for_task`` with a scripted outcome per data id."""

    def __init__(self, outcomes: dict[str, Any]):
        self.outcomes = outcomes
        self.submitted: list[tuple[dict, str, dict, dict]] = []

    def submit(self, data, workflow, workflow_kwargs=None, **kwargs):
        outcome = self.outcomes[data["data_id"]]
        if isinstance(outcome, Exception) and "submit" in str(outcome):
            raise outcome
        self.submitted.append((data, workflow, workflow_kwargs, kwargs))
        return data["data_id"]

    def wait_for_task(self, task_id):
        outcome = self.outcomes[task_id]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome


def test_run_rollout_tasks_keeps_successes_when_one_is_rejected():
    engine = FakeEngine({"data-success": {"rewards": torch.tensor([1.0])}, "data-failed": None})
    rows = [{"data_id": "data-success"}, {"data_id": "data-failed"}]
    completed, failed = _run_rollout_tasks(engine, rows, {"timeout": 5.0})
    assert completed == [("data-success", 1.0)]
    assert failed == ["data-failed"]
    assert [s[1] for s in engine.submitted] == [ARENA_WORKFLOW, ARENA_WORKFLOW]
    assert all(s[2] == {"timeout": 5.0} and s[3] == {"group_size": 1} for s in engine.submitted)


def test_run_rollout_tasks_counts_submit_and_wait_errors_as_failed():
    engine = FakeEngine(
        {
            "a": {"interactions": [{"reward": 0.5}]},
            "b": RuntimeError("submit refused"),
            "c": TimeoutError("episode timed out"),
        }
    )
    rows = [{"data_id": "a"}, {"data_id": "b"}, {"data_id": "c"}]
    completed, failed = _run_rollout_tasks(engine, rows, {}, proxy_addr=PROXY)
    assert completed == [("a", 0.5)]
    assert failed == ["b", "c"]
    assert engine.submitted[0][3] == {"group_size": 1, "proxy_addr": PROXY}


def test_summary():
    summary = summarize([("a", 1.0), ("b", 0.25), ("c", 1.5)], ["d"])
    assert (summary.completed, summary.failed) == (3, 1)
    assert summary.mean_reward == pytest.approx(2.75 / 3)
    assert summary.max_reward == 1.5
    assert summary.reward_one_count == 2
    assert summarize([], ["x"]).as_stats() == {
        "rollout/mean_reward": 0.0,
        "rollout/max_reward": 0.0,
        "rollout/reward_one_count": 0.0,
        "rollout/completed": 0.0,
        "rollout/failed": 1.0,
    }


# --- which rows run ---


@pytest.fixture
def arena() -> FakeArena:
    return FakeArena().add("stream-x", 10, harness="codex", reward=("grader", "1"))


def test_data_id_from_the_environment_runs_that_row(arena, monkeypatch):
    monkeypatch.setenv("ARENA_ROLLOUT_DATA_ID", "data-7")
    rows, stream = select_rows({"stream_id": ""}, 5, seed=1, client=arena.client())
    assert rows == [
        {
            "data_id": "data-7",
            "stream_id": "stream-x",  # the first ACTIVE Stream
            "llm_protocol": "responses",  # inferred from the Stream's default Harness
            "arena_task_type": "unknown",
            "arena_stream_name": "default",
            "reward_ref_key": "grader",
            "reward_ref_version": "1",
        }
    ]
    assert stream.stream_id == "stream-x"


def test_rows_are_a_seeded_sample(arena, monkeypatch):
    monkeypatch.delenv("ARENA_ROLLOUT_DATA_ID", raising=False)
    econfig = {"stream_id": "stream-x"}
    rows, _ = select_rows(econfig, 3, seed=7, client=arena.client())
    again, _ = select_rows(econfig, 3, seed=7, client=arena.client())
    assert rows == again
    expected = random.Random(7).sample([f"stream-x-{i}" for i in range(10)], 3)
    assert [r["data_id"] for r in rows] == expected
    with pytest.raises(ValueError, match="fewer than the 11 rollouts"):
        select_rows(econfig, 11, seed=7, client=arena.client())


# --- configuration checks ---


def test_flags_and_config_arguments_are_separated():
    args, rest = parse_args(["--num-rollouts", "4", "--config", "x.yaml", "seed=3"])
    assert args.num_rollouts == 4 and not args.registry_smoke
    assert rest == ["--config", "x.yaml", "seed=3"]
    with pytest.raises(SystemExit):
        parse_args(["--num-rollouts", "0", "--config", "x.yaml"])


def test_needs_a_local_scheduler_and_an_sglang_api_backend(profile_env):
    config, _ = load_expr_config(["--config", str(SWE_DIR / "arena_grpo.yaml")], SWEPPOConfig)
    with pytest.raises(ValueError, match=r"scheduler\.type must be 'local'"):
        _check_supported(config)  # the profile submits to Slurm
    config.scheduler.type = "local"
    _check_supported(config)  # sglang
    config.rollout.backend = "hf:d1"
    _check_supported(config)


# --- registry smoke ---


class SmokePeers:
    """The proxy's session routes and Arena's route registry, each scripted."""

    def __init__(self, register: Any = None, delete_status: int = 204):
        self.arena, self.proxy = ScriptedHTTP(), ScriptedHTTP()
        self.deleted: list[str] = []
        self.delete_status = delete_status
        self.arena.on("POST", "/openapi/v1/llm/models", register or self._echo_name)
        self.proxy.on("POST", "/grant_capacity", reply(200, {"capacity": 1}))
        self.proxy.on(
            "POST", "/rl/start_session", reply(200, {"session_id": "s", "api_key": SESSION_KEY})
        )
        self.proxy.on("POST", "/rl/end_session", reply(200, {"message": "success"}))

    @staticmethod
    def _echo_name(request: httpx.Request) -> httpx.Response:
        return reply(201, {"model_name": json.loads(request.read())["model_name"]})

    def _arena(self, request: httpx.Request) -> httpx.Response:
        if request.method == "DELETE":  # the route name is only known at run time
            self.deleted.append(request.url.path)
            return reply(self.delete_status, {"error": "delete failed"})
        return self.arena.handler(request)

    def run(self, **kwargs: Any) -> str:
        client = ArenaOpenAPIClient(
            base_url=BASE,
            api_token=TOKEN,
            request_retries=0,
            transport=httpx.MockTransport(self._arena),
        )
        with httpx.Client(transport=self.proxy.transport) as http:
            return registry_smoke(PROXY, ADMIN_KEY, "My Trial_01", client, http=http, **kwargs)


def test_registry_smoke_registers_the_proxy_and_cleans_up(areal_logs):
    peers = SmokePeers()
    naps: list[float] = []
    name = peers.run(serve_seconds=2.0, sleep=naps.append)

    assert re.fullmatch(r"stream-areal-my-trial-01-[0-9a-f]{10}", name)
    assert naps == [2.0]
    (grant,) = peers.proxy.calls("POST", "/grant_capacity")
    (start,) = peers.proxy.calls("POST", "/rl/start_session")
    assert grant.headers["authorization"] == start.headers["authorization"] == f"Bearer {ADMIN_KEY}"
    assert start.json() == {"task_id": f"registry-smoke-{name[-10:]}"}
    (register,) = peers.arena.calls("POST")
    endpoint = register.json()["endpoints"][0]
    assert endpoint["base_url"] == PROXY and endpoint["api_key"] == SESSION_KEY
    assert peers.deleted == [f"/openapi/v1/llm/models/{name}"]
    (end,) = peers.proxy.calls("POST", "/rl/end_session")
    assert end.headers["authorization"] == f"Bearer {SESSION_KEY}"
    assert SECRET_SENTINEL not in areal_logs.text


def test_registry_smoke_reports_the_first_error_and_still_cleans_up():
    peers = SmokePeers(register=reply(500, {"error": "registry down"}), delete_status=500)
    with pytest.raises(Exception, match="registry down") as raised:
        peers.run()
    assert "delete failed" not in str(raised.value)  # the registration error wins
    assert len(peers.deleted) == 1
    assert len(peers.proxy.calls("POST", "/rl/end_session")) == 1


def test_registry_smoke_raises_a_cleanup_error_when_nothing_else_failed():
    peers = SmokePeers(delete_status=500)
    with pytest.raises(Exception, match="delete failed"):
        peers.run()
    assert len(peers.proxy.calls("POST", "/rl/end_session")) == 1
