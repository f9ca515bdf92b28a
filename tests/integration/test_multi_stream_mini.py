"""arena_multi_stream's mini twin trains a step at its topology against the local Arena.

``examples/swe/arena_multi_stream_mini.yaml`` is the Stream mixture of
arena_multi_stream.yaml on arena_grpo's shape (two hf servers of TP 2, an fsdp:d2 actor,
xccl weight sync over gloo, session_gateway). The Slurm submission of that shape is
covered by tests/integration/test_submit_arena_slurm.py; here the local scheduler runs it
so that the mixture path (two Streams, each pinned to its Harness and reward) trains.
"""

from __future__ import annotations

import getpass
import json
import secrets
import sys

import pytest

from tests.helpers.arena_jobs import REPO, local_arena_env, run_entry

pytestmark = pytest.mark.slow

PROFILE = REPO / "examples" / "swe" / "arena_multi_stream_mini.yaml"


def test_multi_stream_mini_trains_a_step_on_two_streams(tmp_path, tiny_model_dir):
    env = local_arena_env(
        tmp_path,
        tiny_model_dir,
        secrets.token_urlsafe(24),
        # read by the Slurm-side keys of the profile; unused by the local scheduler
        AREAL_IMAGE=str(tmp_path / "unused.sif"),
        AREAL_PYTHON=sys.executable,
        AREAL_DIR=str(REPO),
        ARENA_OPENAPI_BASE="local",
    )
    args = [
        *("--config", str(PROFILE)),
        "scheduler.type=local",
        "econfig.arena_base_url=local",
        "total_train_steps=1",
    ]
    output = run_entry("examples.swe.train_swe_rl", args, env, timeout=900)
    assert "from 2 Stream(s): length (arith-length" in output, output[-3000:]
    log_dir = tmp_path / "logs" / getpass.getuser() / "arena-multi-stream-mini" / "smoke"
    [step] = [json.loads(x) for x in (log_dir / "stats.jsonl").read_text().splitlines() if x]
    assert step["global_step"] == 0
    assert step["train/weight_version"] == 1.0
    assert step["ppo_actor/n_seqs"] == 4.0  # 2 groups x 2 samples
    for server in (0, 1):  # both servers serve the actor's weights after the update
        assert step[f"weight_sync/server{server}_max_abs_logp_diff"] <= 1e-4
    streams = {key.split("/")[2] for key in step if key.startswith("rollout/stream/")}
    assert streams and streams <= {"length", "exact"}, streams
