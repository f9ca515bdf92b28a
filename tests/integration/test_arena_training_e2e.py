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
import math
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


def _total(stats: list[dict], key: str) -> float:
    """A denominator summed over the steps (0 where a step never recorded it)."""
    return sum(row.get(key) or 0 for row in stats)


def _check_turn_metrics(stats: list[dict], records: list[dict], *, all_groups_kept: bool) -> None:
    """Every exported episode counts once in ``num_turns_count``; an answer harness makes one
    LLM call per task, so each episode is one turn."""
    exported = [r for r in records if r["training_score"] is not None]
    harness_errors = [r for r in exported if r["status"] == "HARNESS_FAILED"]
    for row in stats:
        if row.get("rollout/num_turns_count"):
            assert row["rollout/num_turns/avg"] == row["rollout/num_turns/min"] == 1.0, row
            assert row["rollout/num_turns/max"] == 1.0, row
    counted = _total(stats, "rollout/num_turns_count")
    if all_groups_kept:
        assert counted == len(exported)
    else:  # a rejected group's replacement may be exported after the last stats export
        assert STEPS * PROMPTS <= counted <= len(exported)
    # the masked split adds up: no-error samples plus harness-error samples
    assert counted == _total(stats, "rollout/num_turns_no_harness_err_count") + _total(
        stats, "rollout/num_turns_harness_err_count"
    )
    assert _total(stats, "rollout/num_turns_harness_err_count") <= len(harness_errors)


@pytest.mark.parametrize("mode", ["gateway", "session_gateway", "direct"])
def test_two_streams_two_steps_per_route_mode(tmp_path, tiny_model_dir, mode):
    _train(tmp_path, tiny_model_dir, mode)

    stats = _stats(tmp_path, mode)
    assert [s["global_step"] for s in stats] == list(range(STEPS))

    tasks = _tasks(tmp_path, mode)
    # A random tiny model sometimes samples end-of-turn as its first token (seen once in
    # CI, direct mode): NO_OUTPUT, which is rejected. A group whose every sample was
    # rejected is replaced by another row's group.
    groups: dict[str, list[str]] = {}
    for task in tasks:  # the proxy session id starts with "<rollout id>:<sample index>"
        groups.setdefault(task["session_id"].split(":", 1)[0], []).append(task["status"])
    lost = sum(1 for members in groups.values() if set(members) == {"NO_OUTPUT"})
    assert len(tasks) == (STEPS * PROMPTS + lost) * SAMPLES
    if not lost:  # mixture mass = rows x weight = 40 x 2 : 16 x 1: an epoch of 6 is 5 + 1
        assert Counter(t["stream_id"] for t in tasks) == {"arith-easy": 10, "py-funcs": 2}
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
        if record["status"] == "NO_OUTPUT":  # rejected: NO_OUTPUT never proves a model failure
            assert record["arena_score"] is None and record["training_score"] is None, record
        else:
            assert record["training_score"] == record["arena_score"]  # no transform configured

    _check_turn_metrics(stats, records, all_groups_kept=not lost)
    assert _total(stats, "rollout/num_turns_harness_err_count") == 0
    assert not any("rollout/num_turns_harness_err/" in key for row in stats for key in row)
    for row in stats:  # harness_error/<code> is a rate over every exported episode
        assert row["rollout/harness_error"] == row["rollout/harness_error/OTHER"] == 0.0, row
        assert row["rollout/harness_error/AGENT_MAX_TURNS_EXCEEDED"] == 0.0, row


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


def _injected(record: dict) -> bool:
    """Whether the audited raw result is a harness failure injected after the harness ran."""
    return (record.get("raw") or {}).get("fault_injection") is True


def test_faults_are_retried_trained_as_zero_or_rejected(tmp_path, tiny_model_dir):
    rows = [
        json.loads(line)
        for line in (DEFAULT_CATALOG.parent / "datasets" / "arithmetic.jsonl")
        .read_text()
        .splitlines()
        if line.strip()
    ]
    ids = [row["data_id"] for row in rows]
    # each injected after the harness ran (its LLM calls recorded); the result formats are
    # those of hosted harnesses: a Claude Code log whose reason is "Prompt is too long",
    # a GameAgent AGENT_MAX_TURNS_EXCEEDED outcome, and an error text that proves nothing
    after_harness = {
        ids[0]: "HARNESS_FAILED",
        ids[2]: "NO_OUTPUT",
        ids[3]: "HARNESS_FAILED:gameagent",
        ids[4]: "HARNESS_FAILED:unattributed",
    }
    trained_as_zero_ids = {ids[0], ids[3]}
    rejected_ids = {ids[1], ids[2], ids[4]}
    catalog = _fault_catalog(
        tmp_path,
        {
            "error_rates": {"429": 0.05, "500": 0.05},
            "seed": 7,
            "fail_after_harness": after_harness,
            "force_status": {ids[1]: "SETUP_FAILED"},
            "route_ttl_seconds": 3,
        },
    )
    _train(
        tmp_path,
        tiny_model_dir,
        "session_gateway",
        "econfig.arena_registration_probe_interval=1.0",
        env={"AREAL_LOCAL_ARENA_CATALOG": str(catalog)},
    )
    tasks = _tasks(tmp_path, "session_gateway")
    statuses = Counter(t["status"] for t in tasks)
    assert statuses["HARNESS_FAILED"] >= 1 and statuses["SETUP_FAILED"] >= 1
    assert statuses["NO_OUTPUT"] >= 1
    stats = _stats(tmp_path, "session_gateway")
    assert len(stats) == STEPS  # training went on

    records = {r["task_id"]: r for r in _audit(tmp_path, "session_gateway")}
    assert set(records) == {t["task_id"] for t in tasks}  # no task result lost
    outcomes: Counter = Counter()
    for task in tasks:
        record = records[task["task_id"]]
        if record["status"] == "HARNESS_FAILED" and not _injected(record):
            # The harness's own LLM call failed: the gateway route was garbage-collected
            # (TTL 3 s) and not yet restored by the 1 s probe. Not attributable to the
            # model, so rejected. A race this test provokes on purpose; seen once in CI.
            assert record["training_score"] is None, record
            continue
        if task["data_id"] in trained_as_zero_ids:
            assert record["status"] == "HARNESS_FAILED" and record["arena_score"] is None
            assert record["training_score"] == 0.0  # the model's failure, trained as 0
            outcomes["zero", record["harness_outcome_code"]] += 1
        elif task["data_id"] in rejected_ids:
            assert record["status"] != "DONE"
            assert record["training_score"] is None, record  # rejected
            outcomes["rejected", record["status"]] += 1
    # Claude's log has no outcome code (bucket OTHER); the GameAgent code is bounded
    assert outcomes["zero", "OTHER"] >= 1 and outcomes["zero", "AGENT_MAX_TURNS_EXCEEDED"] >= 1
    # NO_OUTPUT after LLM calls is rejected (it used to train as 0), as is an unattributed
    # HARNESS_FAILED and a SETUP_FAILED
    assert outcomes["rejected", "NO_OUTPUT"] >= 1 and outcomes["rejected", "SETUP_FAILED"] >= 1
    assert outcomes["rejected", "HARNESS_FAILED"] >= 1

    # turn metrics: the trained-as-zero failures are the harness-error samples, per bucket
    _check_turn_metrics(stats, list(records.values()), all_groups_kept=False)
    zero_codes = Counter(
        r["harness_outcome_code"] for r in records.values() if r["training_score"] == 0.0
    )
    for bucket in ("OTHER", "AGENT_MAX_TURNS_EXCEEDED"):
        counted = _total(stats, f"rollout/num_turns_harness_err/{bucket}_count")
        assert 1 <= counted <= zero_codes[bucket], (bucket, counted, zero_codes)
    rates = [row["rollout/harness_error/AGENT_MAX_TURNS_EXCEEDED"] for row in stats]
    assert max(rates) > 0 and all(0 <= r < 1 for r in rates)
    # the garbage-collected route came back under the same name
    names = {t["model_name"] for t in tasks}
    assert len(names) == 1
    restored = [
        value
        for row in stats
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


def test_ling3_checkpoint_needs_only_its_path_and_the_ling3_parsers(tmp_path, bailing_model_dir):
    """``train_swe_rl`` on a tiny BailingMoeV3 checkpoint (Ling 3: KDA + MLA + MoE, the Ling 3
    tokenizer): the local profile with ``actor.path`` (through ``MODEL_PATH``) and the agent's
    parsers changed, nothing else; both steps train and every task is audited."""
    config = json.loads((bailing_model_dir / "config.json").read_text())
    assert config["architectures"] == ["BailingMoeV3ForCausalLM"]
    _train(tmp_path, bailing_model_dir, "direct",
                 "rollout.agent.tool_call_parser=ling3",
                 "rollout.agent.reasoning_parser=ling3")  # fmt: skip
    stats = _stats(tmp_path, "direct")
    assert [s["global_step"] for s in stats] == list(range(STEPS))
    for row in stats:
        assert math.isfinite(row["ppo_actor/grad_norm"]), row
    tasks = _tasks(tmp_path, "direct")
    assert len(tasks) >= STEPS * PROMPTS * SAMPLES
    assert Counter(r["task_id"] for r in _audit(tmp_path, "direct")) == Counter(
        t["task_id"] for t in tasks
    )
