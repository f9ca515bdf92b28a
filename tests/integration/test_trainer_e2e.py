"""The single-controller trainer end to end on this machine (issue: trainer loop).

Every run uses the toy token-reward example (``examples/toy``): the local scheduler,
the embedded ``hf`` inference server and the FSDP actor on gloo, with a tiny model.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.api.scheduler_api import RPC_TOKEN_ENV, RPC_TOKEN_HEADER
from areal.inference.auth import API_KEY_ENV
from areal.infra.rpc.processes import descendant_pids, process_alive
from areal.proxy.keys import DEFAULT_ADMIN_API_KEY, is_loopback_host
from areal.trainer.rl_trainer import PPOTrainer
from areal.utils.secrets import REDACTED, reveal

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
YAML = REPO / "examples" / "toy" / "toy_grpo.yaml"
TRIAL_DIR = "logs/{user}/toy-grpo/{trial}"
ARENA_TOKEN = "sentinel-arena-token-9d2b77"
ADMIN_CALLS = (
    ("/grant_capacity", {}),
    ("/rl/start_session", {"task_id": "intruder"}),
    ("/export_trajectories", {"session_id": "x"}),
    ("/rl/stats", {}),
)


def _env(root: Path) -> dict[str, str]:
    env = {**os.environ, "AREAL_FILEROOT": str(root), "HF_HUB_OFFLINE": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop(RPC_TOKEN_ENV, None)
    return env


def _command(trial: str, *overrides: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "examples.toy.train",
        "--config",
        str(YAML),
        f"trial_name={trial}",
        *overrides,
    ]


def _run(root: Path, trial: str, *overrides: str, timeout: float = 400) -> str:
    done = subprocess.run(
        _command(trial, *overrides),
        cwd=REPO,
        env=_env(root),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout + done.stderr


def _trial_dir(root: Path, trial: str) -> Path:
    import getpass

    return root / TRIAL_DIR.format(user=getpass.getuser(), trial=trial)


def _stats(root: Path, trial: str) -> list[dict]:
    path = _trial_dir(root, trial) / "stats.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _dumps(root: Path, trial: str, steps: int) -> dict[int, list[dict]]:
    """Dumped samples by the weight version that generated them, groups in task order.

    The rollout workers write ``rollout/{max version in group}/{task_id}.jsonl``
    (docs/trainer.md#trajectory-dumps).
    With ``max_head_offpolicyness=0`` (the toy profile) a group's version is the step that
    trained it; groups of version ``steps`` and later started after the last step.
    """
    by_version: dict[int, list[tuple[int, list[dict]]]] = {}
    for path in (_trial_dir(root, trial) / "rollout").glob("*/*.jsonl"):
        version, task = int(path.parent.name), int(path.stem)
        lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
        assert all(line["task_id"] == task for line in lines)
        if version < steps:
            by_version.setdefault(version, []).append((task, lines))
    return {k: [s for _, lines in sorted(v) for s in lines] for k, v in sorted(by_version.items())}


def _processes_mentioning(text: str) -> list[int]:
    """Live processes (not zombies) whose command line contains ``text``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if text in cmdline and process_alive(int(entry)):
            found.append(int(entry))
    return found


def _wait_gone(pids, timeout: float = 45.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if process_alive(p)]
        if not alive:
            return []
        time.sleep(0.2)
    return [p for p in pids if process_alive(p)]


# --- three steps in process: versions, weights on the server, stats, dumps, security ---


class ProbedTrainer(PPOTrainer):
    """Records, after every step, what the server and the actor say about one sequence."""

    prompt: tuple[int, ...] = ()

    def probe(self) -> dict:
        address = self.rollout.server_addrs[0]
        body = {
            "input_ids": list(self.prompt),
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0},
            "return_logprob": True,
        }
        key = self.scheduler.inference_api_key.reveal()  # the run's server API key
        reply = httpx.post(
            f"http://{address}/generate",
            json=body,
            headers={"Authorization": f"Bearer {key}"},
            timeout=60,
        ).json()
        output = list(reply["output_ids"])
        server_logp = [lp for lp, _, _ in reply["meta_info"]["output_token_logprobs"]]
        ids = [*self.prompt, *output]
        n = len(self.prompt)
        trajectory = {
            "input_ids": torch.tensor([ids]),
            "attention_mask": torch.ones(1, len(ids), dtype=torch.bool),
            "loss_mask": torch.tensor([[0] * n + [1] * len(output)]),
        }
        # position t holds log p(token t+1 | tokens <= t)
        actor_logp = self.actor.compute_logp([trajectory])[0][0, n - 1 : -1].tolist()
        return {
            "version": self.actor.get_version(),
            "output": output,
            "server_logp": server_logp,
            "actor_logp": actor_logp,
        }

    def after_step(self, step_info, stats) -> None:
        self.probes.append(self.probe())
        if step_info.global_step == 0:
            self.security = self.check_security()

    def check_security(self) -> dict:
        token = self.scheduler.rpc_token.reveal()
        workers = self.scheduler.worker_pids()
        pids = set(workers.values())
        for pid in list(pids):
            pids.update(descendant_pids(pid))
        argv_with_token = []
        for pid in pids:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
            if token in cmdline:
                argv_with_token.append(pid)
        address = self.actor.workers[0].address
        call = {"method": "get_version", "engine_name": self.actor.workers[0].id}
        without = httpx.post(f"http://{address}/call", json=call, timeout=10)
        wrong = httpx.post(
            f"http://{address}/call", json=call, headers={RPC_TOKEN_HEADER: "x"}, timeout=10
        )
        return {
            "token": token,
            "pids": sorted(pids),
            "n_workers": len(workers),
            "argv_with_token": argv_with_token,
            "status_without_token": without.status_code,
            "status_wrong_token": wrong.status_code,
        }


def test_three_steps_in_process(tmp_path, monkeypatch):
    from examples.toy.train import build_inputs

    monkeypatch.setenv("AREAL_FILEROOT", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.delenv(RPC_TOKEN_ENV, raising=False)
    config, _ = load_expr_config(
        ["--config", str(YAML), "trial_name=inproc", "total_train_steps=3"], GRPOConfig
    )
    dataset, workflow, workflow_kwargs = build_inputs(config)
    with ProbedTrainer(config, dataset) as trainer:
        trainer.prompt = tuple(dataset[0]["input_ids"])
        trainer.probes = [trainer.probe()]
        trainer.train(workflow, workflow_kwargs=workflow_kwargs)
        security = trainer.security
        log_dir = trainer.log_dir
    probes = trainer.probes

    # versions advance 1, 2, 3 and the server holds the actor's weights after each step
    assert [p["version"] for p in probes] == [0, 1, 2, 3]
    for p in probes:
        assert len(p["output"]) == 4
        diffs = [abs(a - b) for a, b in zip(p["server_logp"], p["actor_logp"], strict=True)]
        assert max(diffs) < 2e-3, (p["version"], diffs)
    for before, after in itertools.pairwise(probes):
        change = max(abs(a - b) for a, b in zip(before["server_logp"], after["server_logp"]))
        assert change > 1e-4 or before["output"] != after["output"]

    # stats (JSONL and TensorBoard) and trajectory dumps
    stats = _stats(tmp_path, "inproc")
    assert [s["global_step"] for s in stats] == [0, 1, 2]
    assert [s["train/weight_version"] for s in stats] == [1.0, 2.0, 3.0]
    assert all("rollout/reward_mean" in s and "timeperf/train_step" in s for s in stats)
    assert list((tmp_path / "logs" / "toy-tb").glob("events.out.tfevents.*"))
    dumps = _dumps(tmp_path, "inproc", steps=3)
    assert sorted(dumps) == [0, 1, 2]
    assert all(len(samples) == 16 for samples in dumps.values())  # 4 prompts x 4 samples

    # the token: required, and never on a command line or in a log
    assert security["n_workers"] == 2 and len(security["pids"]) >= 3  # + inference server
    assert security["argv_with_token"] == []
    assert security["status_without_token"] == 401
    assert security["status_wrong_token"] == 401
    for path in [*log_dir.rglob("*.log"), *log_dir.rglob("*.yaml"), *log_dir.rglob("*.jsonl")]:
        assert security["token"] not in path.read_text(errors="replace"), path

    # no process outlives the trainer
    assert _wait_gone(security["pids"], timeout=15) == []


# --- two ranks, asynchronous: staleness bound from the dumps ---


@pytest.mark.parametrize("eta", [0, 2])
def test_two_ranks_and_the_staleness_bound(tmp_path, eta):
    trial = f"eta{eta}"
    _run(
        tmp_path,
        trial,
        "total_train_steps=4",
        "actor.backend=fsdp:d2",
        f"rollout.max_head_offpolicyness={eta}",
    )
    stats = _stats(tmp_path, trial)
    assert [s["global_step"] for s in stats] == [0, 1, 2, 3]
    # trained at weight version `step`, a token generated by version v is step - v stale
    offsets = [v for s in stats for k, v in s.items() if k.endswith("version_staleness/max")]
    assert offsets and max(offsets) <= eta
    for path in (_trial_dir(tmp_path, trial) / "rollout").glob("*/*.jsonl"):
        for line in path.read_text().splitlines():
            sample = json.loads(line)
            # the file sits under the newest version in its group
            assert sample["head_version"] <= sample["tail_version"] <= int(path.parent.name)
            assert sample["tail_version"] - sample["head_version"] <= eta
    if eta == 0:
        assert set(offsets) == {0}
    else:
        assert max(offsets) > 0  # rollouts really ran ahead of training
    assert _processes_mentioning(str(tmp_path)) == []


# --- learning ---


def test_grpo_learns_the_token_reward(tmp_path):
    """16 steps (about a minute): the reward of the last 3 beats the first 3 by 0.25.

    The takeoff step varies from run to run (the server's batching decides which sampling
    draws each request gets): three local runs reached 1.0 by steps 9-11, one CI run was
    still at 0.52 over steps 10-12, so the run is long enough for a late takeoff."""
    _run(tmp_path, "learn", "total_train_steps=16", "seed=3")
    rewards = [s["rollout/reward_mean"] for s in _stats(tmp_path, "learn")]
    assert len(rewards) == 16
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.25, rewards


# --- recover after SIGKILL ---


def _prompts_by_step(root: Path, trial: str, steps: int) -> list[list[str]]:
    """The prompts each step trained on, each once (the crashed run's dumps may also hold
    groups generated for its last step before the kill, with the same prompts)."""
    by_version = _dumps(root, trial, steps)
    return [sorted({s["prompt"] for s in samples}) for samples in by_version.values()]


def test_sigkill_after_step_two_resumes_at_step_three(tmp_path):
    overrides = ("total_train_steps=4", "rollout.max_head_offpolicyness=0")
    stats_path = _trial_dir(tmp_path, "crash") / "stats.jsonl"
    controller = subprocess.Popen(
        _command("crash", *overrides),
        cwd=REPO,
        env=_env(tmp_path),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and controller.poll() is None:
            if stats_path.exists() and len(stats_path.read_text().splitlines()) >= 2:
                break
            time.sleep(0.05)
        assert controller.poll() is None, "the run ended before step 2 was logged"
        controller.send_signal(signal.SIGKILL)
        controller.wait()
    finally:
        controller.kill()
    # the workers and the inference server notice and stop on their own
    leftovers = _processes_mentioning(str(tmp_path))
    assert _wait_gone(leftovers) == []
    step_info = json.loads(
        next((tmp_path / "checkpoints").rglob("recover_info/step_info.json")).read_text()
    )
    assert step_info["global_step"] == 1  # steps are 0-based: step 2 was the last saved

    output = _run(tmp_path, "crash", *overrides)
    assert "resuming at global step 2" in output
    resumed = _stats(tmp_path, "crash")
    assert [s["global_step"] for s in resumed][-2:] == [2, 3]
    by_step = {s["global_step"]: s for s in resumed}
    assert by_step[2]["train/weight_version"] == 3.0
    # the optimizer state came back: Adam had taken 2 steps before the crash
    assert by_step[2]["ppo_actor/optimizer_steps"] == 3.0
    assert by_step[3]["ppo_actor/optimizer_steps"] == 4.0

    _run(tmp_path, "straight", *overrides)
    straight = _prompts_by_step(tmp_path, "straight", steps=4)
    assert len(straight) == 4
    assert _prompts_by_step(tmp_path, "crash", steps=4) == straight
    assert [s["global_step"] for s in _stats(tmp_path, "straight")] == [0, 1, 2, 3]


# --- an agent import path: proxies are started and paired with the rollout workers ---


def _admin_call_statuses(proxy: str, keys: dict[str, str]) -> dict[tuple[str, str], int]:
    """The proxy's answers to each admin call made with each of ``keys``."""
    answers = {}
    for name, key in keys.items():
        for path, body in ADMIN_CALLS:
            headers = {"Authorization": f"Bearer {key}"}
            answers[(name, path)] = httpx.post(
                f"{proxy}{path}", json=body, headers=headers
            ).status_code
    return answers


def _process_environs(scheduler) -> dict[str, dict[str, str]]:
    """The environment of every worker, and of each worker's proxy and inference server."""
    from tests.unit.infra.test_role_secrets import environ_of

    envs = {}
    for worker_id, pid in scheduler.worker_pids().items():
        envs[worker_id] = environ_of(pid)
        for child in descendant_pids(pid):
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            for module, kind in (("areal.proxy.server", "proxy"), ("areal.inference", "server")):
                if module in cmdline:
                    envs[f"{worker_id}:{kind}"] = environ_of(child)
    return envs


def test_agent_import_path_runs_through_the_proxies(tmp_path, monkeypatch):
    """An agent runs through one proxy per rollout worker. No admin key is set: the run
    uses a random one of its own, so the proxy (on the host's outward address) refuses
    admin calls with the printed form ``<redacted>`` (which an unset key used to load as)
    or the reference's public default, and each process holds only its own secrets."""
    from examples.toy.chat_agent import make_chat_dataset
    from examples.toy.train import build_inputs

    monkeypatch.setenv("AREAL_FILEROOT", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("ARENA_OPENAPI_TOKEN", ARENA_TOKEN)  # the controller's credentials
    scratch = tmp_path / "tmp"  # the run's temporary files, and what is left of them
    scratch.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    for name in (RPC_TOKEN_ENV, "SWE_RL_ADMIN_API_KEY", "AREAL_ALLOW_DEFAULT_ADMIN_KEY"):
        monkeypatch.delenv(name, raising=False)
    config, _ = load_expr_config(
        [
            "--config",
            str(YAML),
            "trial_name=agent",
            "total_train_steps=2",
            "gconfig.n_samples=2",
            "rollout.agent.chat_template_type=concat",
        ],
        GRPOConfig,
    )
    assert reveal(config.rollout.agent.admin_api_key) == ""  # nothing set
    build_inputs(config)  # builds the tiny model
    seen = {}
    security = {}

    class Trainer(PPOTrainer):
        def after_step(self, step_info, stats):
            seen[step_info.global_step] = (list(self.rollout.proxy_addrs), dict(stats))
            if step_info.global_step == 0:
                key = reveal(self.config.rollout.agent.admin_api_key)
                public = {"printed": REDACTED, "default": DEFAULT_ADMIN_API_KEY}
                security.update(
                    key=key,
                    refused=_admin_call_statuses(self.rollout.proxy_addrs[0], public),
                    own=_admin_call_statuses(self.rollout.proxy_addrs[0], {"own": key}),
                    envs=_process_environs(self.scheduler),
                )

    with Trainer(config, make_chat_dataset(16)) as trainer:
        # two calls per episode that the proxy counts as a concat prefix mismatch and a
        # sampling temperature off actor.temperature (tests/fakes/probing_agent.py)
        trainer.train(
            "tests.fakes.probing_agent.MismatchProbeAgent", workflow_kwargs={"max_tokens": 6}
        )
        proxies = list(trainer.rollout.proxy_addrs)
    assert sorted(seen) == [0, 1]
    assert len(proxies) == 1 and proxies[0].startswith("http://")
    assert all(seen[k][0] == proxies for k in seen)
    for _, stats in seen.values():
        assert 0.0 <= stats["rollout/reward_mean"] <= 1.0
        assert stats["ppo_actor/n_valid_tokens"] > 0  # proxy-recorded tokens were trained
    # metrics recorded in the proxy process and by the agent's group hook reach stats.jsonl
    for stats in _stats(tmp_path, "agent"):
        assert stats["proxy/concat_prefix_mismatch"] >= 1
        assert stats["proxy/sampling_temperature_mismatch"] >= 1
        assert 0.0 <= stats["rollout/pass@k"] <= 1.0
    dumps = _dumps(tmp_path, "agent", steps=2)  # 4 prompts x 2 samples x 2 calls per step
    assert sorted(dumps) == [0, 1] and all(len(v) == 16 for v in dumps.values())
    # the proxy stopped with its rollout worker, and no barrier file was left behind
    assert _processes_mentioning("areal.proxy.server") == []
    assert [p.name for p in scratch.iterdir() if p.name.startswith("areal-barrier")] == []

    # the admin key: off loopback, only the run's own random key manages sessions
    host = proxies[0].removeprefix("http://").rsplit(":", 1)[0]
    assert not is_loopback_host(host), host
    assert set(security["refused"].values()) == {403}, security["refused"]
    assert security["own"][("own", "/grant_capacity")] == 200
    key = security["key"]
    assert len(key) >= 40 and key not in (REDACTED, DEFAULT_ADMIN_API_KEY)
    for path in _trial_dir(tmp_path, "agent").rglob("*"):
        if path.is_file():
            assert key not in path.read_text(errors="replace"), path
    # each process holds only the secrets it uses
    envs = security["envs"]
    holding_key = {w: sorted(k for k, v in env.items() if v == key) for w, env in envs.items()}
    actors = [w for w in envs if w.startswith("actor/")]
    assert actors and all(holding_key[w] == [] for w in actors)
    assert holding_key["rollout/0"] == ["AREAL_SECRET_ROLLOUT_AGENT_ADMIN_API_KEY"]
    assert holding_key["rollout/0:proxy"] == ["SWE_RL_ADMIN_API_KEY"]
    assert holding_key["rollout/0:server"] == []
    for worker, env in envs.items():
        assert (env.get("ARENA_OPENAPI_TOKEN") == ARENA_TOKEN) == (worker == "rollout/0"), worker
        assert (RPC_TOKEN_ENV in env) == (":" not in worker), worker  # workers, not children
        assert (API_KEY_ENV in env) == worker.startswith("rollout/0"), worker
