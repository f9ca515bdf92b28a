"""The documented pipeline: projection | base64 --decode > streams.yaml, then preflight.

Both tools run as real subprocesses; preflight talks to an Arena peer over loopback HTTP.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.conftest import REPO_ROOT, SECRET_SENTINEL, SWE_DIR
from tests.fakes.live_server import ScriptedASGI, serve
from tests.fakes.scripted_http import ScriptedHTTP, reply

API = "/openapi/v1"


def scripted_arena() -> ScriptedHTTP:
    http = ScriptedHTTP()
    for sid in ("your-first-stream", "your-second-stream"):
        stream = {
            "stream_id": sid,
            "status": "ACTIVE",
            "default_reward_ref": {"key": "your-reward", "version": "1.0.0"},
        }
        http.on("GET", f"{API}/streams/{sid}", reply(200, {"data": {"stream": stream}}))
        http.on("POST", f"{API}/streams/{sid}/dataset", reply(200, {"total": 12}))
        task = {
            "status": "DONE",
            "harness_ref": {"key": "your-harness", "version": "version"},
            "reward_ref": {"key": "your-reward", "version": "1.0.0"},
        }
        http.on("GET", f"{API}/streams/{sid}/tasks", reply(200, {"data": {"items": [task]}}))
    http.on(
        "GET",
        f"{API}/harnesses/your-harness/versions/version",
        reply(200, {"data": {"status": "PUBLISHED"}}),
    )
    return http


def test_projection_then_preflight(tmp_path):
    env = {**os.environ, "ARENA_OPENAPI_TOKEN": f"tok-{SECRET_SENTINEL}"}
    streams = tmp_path / "streams.yaml"
    profile = SWE_DIR / "arena_multi_stream.yaml"
    pipeline = (
        f"{sys.executable} -m examples.swe.arena_stream_config_projection {profile}"
        f" | base64 --decode > {streams}"
    )
    subprocess.run(
        ["bash", "-o", "pipefail", "-c", pipeline], cwd=REPO_ROOT, env=env, check=True, timeout=120
    )
    http = scripted_arena()
    with serve(ScriptedASGI(http)) as url:
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "examples.swe.arena_preflight",
                "--streams-file",
                str(streams),
                "--base-url",
                url,
            ],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert [s["name"] for s in report["streams"]] == ["first", "second"]
    assert all(
        s["dataset_total"] == 12 and s["recent_terminal_tasks"] == 1 for s in report["streams"]
    )
    assert "Arena preflight: 2 Stream(s) passed" in result.stderr
    assert SECRET_SENTINEL not in result.stdout + result.stderr
    assert {r.headers["authorization"] for r in http.requests} == {f"Bearer tok-{SECRET_SENTINEL}"}
