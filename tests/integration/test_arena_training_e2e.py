"""Arena GRPO end to end on one machine: ``train_swe_rl`` against the local Arena.

Each run starts ``python -m examples.swe.train_swe_rl --config examples/swe/arena_local.yaml``
with a tiny model: the entry point starts a local Arena in-process, the trainer starts the
FSDP actor, a rollout worker with the embedded inference server and a rollout proxy, and
every sample is one Arena task whose harness calls the policy through the chosen route.
Afterwards the local Arena's database and the audit shards are checked.
"""

from __future__ import annotations

import getpass
import json
import os
import secrets
import sqlite3
from collections import Counter
from pathlib import Path

import pytest
import yaml

from tests.helpers.arena_jobs import local_arena_env, run_entry

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PROFILE = REPO / "examples" / "swe" / "arena_local.yaml"
DEFAULT_CATALOG = REPO / "examples" / "swe" / "local_arena" / "catalogs" / "default.yaml"
STEPS, PROMPTS, SAMPLES = 2, 3, 2


def _train(root: Path, model: Path, mode: str, *overrides: str, env: dict | None = None) -> str:
    full_env = local_arena_env(
        root, model, secrets.token_urlsafe(24), ARENA_ROUTE_MODE=mode, **(env or {})
    )
    args = [
        "--config",
        str(PROFILE),
        f"trial_name={mode}",
        f"total_train_steps={STEPS}",
        f"gconfig.n_samples={SAMPLES}",
        f"train_dataset.batch_size={PROMPTS}",
        f"econfig.arena_mixture_epoch_size={STEPS * PROMPTS}",
        "rollout.max_head_offpolicyness=0",
        "train_dataset.shuffle=false",
        *overrides,
    ]
    return run_entry("examples.swe.train_swe_rl", args, full_env, timeout=600)


def _arena_db(root: Path, trial: str) -> sqlite3.Connection:
    db = next((root / "local_arena").rglob(f"{trial}/**/arena.db"), None)
    if db is None:
        db = next(p for p in (root / "local_arena").rglob("arena.db") if trial in str(p))
    return sqlite3.connect(f"file:{db}?mode=ro", uri=True)


def _tasks(root: Path, trial: str) -> list[dict]:
    with _arena_db(root, trial) as conn:
        conn.row_factory = sqlite3.Row
        return [dict(r) for r in conn.execute("SELECT * FROM tasks ORDER BY seq")]


def _routes(root: Path, trial: str) -> list[str]:
    with _arena_db(root, trial) as conn:
        return [r[0] for r in conn.execute("SELECT model_name FROM routes")]


def _audit(root: Path, trial: str) -> list[dict]:
    shard_dir = root / "arena-local" / trial / "arena_results"
    return [
        json.loads(line)
        for shard in sorted(shard_dir.glob("arena_results_*.jsonl"))
        for line in shard.read_text().splitlines()
        if line.strip()
    ]


def _stats(root: Path, trial: str) -> list[dict]:
    path = root / "logs" / getpass.getuser() / "arena-local" / trial / "stats.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("mode", ["gateway", "session_gateway", "direct"])
def test_two_streams_two_steps_per_route_mode(tmp_path, tiny_model_dir, mode):
    _train(tmp_path, tiny_model_dir, mode)

    stats = _stats(tmp_path, mode)
    assert [s["global_step"] for s in stats] == list(range(STEPS))

    tasks = _tasks(tmp_path, mode)
    assert len(tasks) == STEPS * PROMPTS * SAMPLES
    # mixture mass = rows x weight = 40 x 2 : 16 x 1, so an epoch of 6 rows holds 5 + 1
    assert Counter(t["stream_id"] for t in tasks) == {"arith-easy": 10, "py-funcs": 2}
    # NO_OUTPUT is a model outcome, not an infrastructure failure: a random tiny model
    # sometimes samples end-of-turn as its first token (seen once in CI, direct mode)
    statuses = Counter(t["status"] for t in tasks)
    assert set(statuses) <= {"DONE", "OK", "NO_OUTPUT"}, statuses
    assert statuses["DONE"] + statuses["OK"] > len(tasks) // 2, statuses

    names = [t["model_name"] for t in tasks]
    if mode == "gateway":  # one registration per rollout, each deleted afterwards
        assert len(set(names)) == len(tasks)
        assert all(n.startswith("stream-areal-") and "session" not in n for n in names)
    elif mode == "session_gateway":  # one route for the one rollout worker
        assert len(set(names)) == 1 and names[0].startswith("stream-areal-session-")
    else:  # direct: generated names, never registered
        assert len(set(names)) == len(tasks)
    assert _routes(tmp_path, mode) == []

    records = _audit(tmp_path, mode)
    by_task = Counter(r["task_id"] for r in records)
    assert by_task == Counter(t["task_id"] for t in tasks)  # one record per task
    scores = {t["task_id"]: t["score"] for t in tasks}
    for record in records:
        assert record["arena_score"] == scores[record["task_id"]]
        if record["status"] == "NO_OUTPUT":  # no score; the model failed after its calls: 0
            assert record["arena_score"] is None and record["training_score"] == 0.0, record
        else:
            assert record["training_score"] == record["arena_score"]  # no transform configured


def _default_catalog() -> dict:
    """The default catalog with its dataset files made absolute, to be edited and saved."""
    document = yaml.safe_load(DEFAULT_CATALOG.read_text())
    for spec in document["datasets"].values():
        if "file" in spec:
            spec["file"] = str((DEFAULT_CATALOG.parent / spec["file"]).resolve())
    return document


def _fault_catalog(root: Path, faults: dict) -> Path:
    document = _default_catalog()
    document["faults"] = faults
    path = root / "faulty_catalog.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def _agent_phase_error(record: dict) -> bool:
    """Whether the audited raw result carries the injected agent-phase error text."""
    error = str((record.get("raw") or {}).get("error") or "")
    return "agent phase error: claude reported error" in error


def test_faults_are_retried_trained_as_zero_or_rejected(tmp_path, tiny_model_dir):
    rows = [
        json.loads(line)
        for line in (DEFAULT_CATALOG.parent / "datasets" / "arithmetic.jsonl")
        .read_text()
        .splitlines()
        if line.strip()
    ]
    harness_failed, setup_failed = rows[0]["data_id"], rows[1]["data_id"]
    no_output = rows[2]["data_id"]
    catalog = _fault_catalog(
        tmp_path,
        {
            "error_rates": {"429": 0.05, "500": 0.05},
            "seed": 7,
            "fail_after_harness": {harness_failed: "HARNESS_FAILED", no_output: "NO_OUTPUT"},
            "force_status": {setup_failed: "SETUP_FAILED"},
            "route_ttl_seconds": 3,
        },
    )
    output = _train(
        tmp_path,
        tiny_model_dir,
        "session_gateway",
        "econfig.arena_registration_probe_interval=1.0",
        env={"AREAL_LOCAL_ARENA_CATALOG": str(catalog)},
    )
    del output
    tasks = _tasks(tmp_path, "session_gateway")
    statuses = Counter(t["status"] for t in tasks)
    assert statuses["HARNESS_FAILED"] >= 1 and statuses["SETUP_FAILED"] >= 1
    assert statuses["NO_OUTPUT"] >= 1
    assert len(_stats(tmp_path, "session_gateway")) == STEPS  # training went on

    records = {r["task_id"]: r for r in _audit(tmp_path, "session_gateway")}
    assert set(records) == {t["task_id"] for t in tasks}  # no task result lost
    trained_as_zero = Counter()
    for task in tasks:
        record = records[task["task_id"]]
        if record["status"] == "HARNESS_FAILED" and not _agent_phase_error(record):
            # The harness's own LLM call failed: the gateway route was garbage-collected
            # (TTL 3 s) and not yet restored by the 1 s probe. Not attributable to the
            # model, so rejected. A race this test provokes on purpose; seen once in CI.
            assert record["training_score"] is None, record
            continue
        if task["data_id"] in (harness_failed, no_output):
            assert record["status"] == (
                "HARNESS_FAILED" if task["data_id"] == harness_failed else "NO_OUTPUT"
            )
            assert record["arena_score"] is None
            assert record["training_score"] == 0.0  # the model's failure, trained as 0
            trained_as_zero[record["status"]] += 1
        elif task["data_id"] == setup_failed:
            assert record["status"] == "SETUP_FAILED"
            assert record["training_score"] is None  # rejected
    assert trained_as_zero["HARNESS_FAILED"] >= 1 and trained_as_zero["NO_OUTPUT"] >= 1
    # the garbage-collected route came back under the same name
    names = {t["model_name"] for t in tasks}
    assert len(names) == 1
    restored = [
        value
        for row in _stats(tmp_path, "session_gateway")
        for key, value in row.items()
        if key.endswith("registration_restore_success")
    ]
    assert restored and max(restored) > 0


CLAUDE = REPO / ".cache" / "agent-clis" / "node_modules" / ".bin" / "claude"


@pytest.mark.skipif(
    not CLAUDE.exists(), reason="Claude Code CLI not installed (run `make agent-clis`)"
)
def test_claude_code_direct_rollout_records_interactions(tmp_path, tiny_model_dir):
    """One ``direct``-mode rollout of the real Claude Code CLI through the local Arena.

    Claude Code's default request (~100 KB of tools and prompts) does not fit a tiny model,
    so the catalog gives the harness no tools and a one-line system prompt.
    """
    document = _default_catalog()
    for harness in document["harnesses"]:
        if harness["key"] == "claude-code":
            harness["options"] = {
                "max_turns": 1,
                "extra_args": ["--tools", "", "--system-prompt", "Answer with a number."],
            }
    catalog = tmp_path / "claude_catalog.yaml"
    catalog.write_text(yaml.safe_dump(document))
    profile = yaml.safe_load(PROFILE.read_text())
    profile["econfig"]["arena_streams"] = [
        {"name": "cc", "stream_id": "arith-easy", "harness": "claude-code@2.1.197"}
    ]
    profile_path = tmp_path / "claude_profile.yaml"
    profile_path.write_text(yaml.safe_dump(profile, sort_keys=False))
    env = local_arena_env(
        tmp_path,
        tiny_model_dir,
        secrets.token_urlsafe(24),
        ARENA_ROUTE_MODE="direct",
        AREAL_LOCAL_ARENA_CATALOG=str(catalog),
        PATH=f"{CLAUDE.parent}{os.pathsep}{os.environ.get('PATH', '')}",
    )
    args = ["--config", str(profile_path), "--num-rollouts", "1", "trial_name=claude",
            "sglang.context_length=4096", "gconfig.max_tokens=4095"]  # fmt: skip
    # exit 0 means at least one trajectory came back: the proxy session had interactions
    run_entry("examples.swe.arena_rollout_only", args, env, timeout=600)
    tasks = _tasks(tmp_path, "claude")
    assert len(tasks) == 1 and tasks[0]["harness_key"] == "claude-code"
    assert tasks[0]["status"] in ("DONE", "OK", "HARNESS_FAILED", "NO_OUTPUT"), tasks[0]
    (record,) = _audit(tmp_path, "claude")
    assert record["task_id"] == tasks[0]["task_id"] and record["training_score"] is not None
