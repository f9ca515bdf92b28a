"""Bounded fault settings and server limits of the local Arena.

A setting that could wedge the server (``latency_ms: 1e30``, an infinite route TTL, zero
task slots) is refused where it is loaded, naming the field and the allowed range; the
settings endpoint is never delayed, so an injected latency can always be taken back; and
request bodies over the cap are answered 413, declared or chunked.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from examples.swe.local_arena.catalog import DEFAULT_CATALOG, load_catalog
from examples.swe.local_arena.faults import FaultConfig, FaultError
from examples.swe.local_arena.server import LocalArenaConfig
from examples.swe.local_arena.testing import running_local_arena
from examples.swe.local_arena.types import CatalogError

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.parametrize(
    ("settings", "field", "allowed"),
    [
        ({"latency_ms": 1e30}, "latency_ms", "[0, 60000]"),
        ({"latency_ms": float("inf")}, "latency_ms", "[0, 60000]"),
        ({"latency_ms": float("nan")}, "latency_ms", "[0, 60000]"),
        ({"latency_ms": 60_001}, "latency_ms", "[0, 60000]"),
        ({"env_latency_ms": 1e30}, "env_latency_ms", "[0, 60000]"),
        ({"env_latency_ms": float("inf")}, "env_latency_ms", "[0, 60000]"),
        ({"env_latency_ms": float("nan")}, "env_latency_ms", "[0, 60000]"),
        ({"env_latency_ms": 60_001}, "env_latency_ms", "[0, 60000]"),
        ({"env_latency_ms": -1}, "env_latency_ms", "[0, 60000]"),
        ({"route_ttl_seconds": float("inf")}, "route_ttl_seconds", "(0, 86400]"),
        ({"route_ttl_seconds": float("nan")}, "route_ttl_seconds", "(0, 86400]"),
        ({"route_ttl_seconds": 1e30}, "route_ttl_seconds", "(0, 86400]"),
        ({"seed": 2**70}, "seed", "[0, 2**63)"),
        ({"force_status": {f"d{i}": "TIMEOUT" for i in range(10_001)}}, "force_status", "10000"),
        ({"fail_after_harness": "HARNESS_FAILED"}, "fail_after_harness", "mapping"),
    ],
)
def test_out_of_range_fault_settings_are_refused_naming_the_field(settings, field, allowed):
    with pytest.raises(FaultError) as info:
        FaultConfig.from_mapping(settings, where="faults")
    message = str(info.value)
    assert f"faults.{field}" in message and allowed in message
    assert len(message) < 300  # a huge value is not echoed whole


def test_catalog_faults_are_bounded_at_load(tmp_path):
    text = DEFAULT_CATALOG.read_text().replace("faults: {}", "faults: {latency_ms: 1.0e+30}")
    (tmp_path / "datasets").symlink_to(DEFAULT_CATALOG.parent / "datasets")
    catalog = tmp_path / "catalog.yaml"
    catalog.write_text(text)
    with pytest.raises(CatalogError, match=r"catalog\.yaml: faults\.latency_ms .*\[0, 60000\]"):
        load_catalog(catalog)


@pytest.mark.parametrize(
    ("flag", "field"), [("--latency-ms", ".latency_ms"), ("--env-latency-ms", ".env_latency_ms")]
)
def test_cli_latency_flags_are_refused_before_serving(tmp_path, flag, field):
    argv = [sys.executable, "-m", "examples.swe.local_arena", "serve", "--port", "0"]
    argv += ["--db", str(tmp_path / "a.db"), flag, "1e30"]
    done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=20)
    assert done.returncode == 2
    assert f"{field} must be a number of milliseconds in [0, 60000]" in done.stderr
    assert not (tmp_path / "a.db").exists()  # refused before the database was opened


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"task_timeout": float("inf")}, "--task-timeout"),
        ({"task_timeout": 1e30}, "--task-timeout"),
        ({"max_concurrent_tasks": 0}, "--max-concurrent-tasks"),
        ({"max_concurrent_tasks": 10**6}, "--max-concurrent-tasks"),
        ({"max_body_bytes": 0}, "--max-body-bytes"),
    ],
)
def test_server_counts_and_timeouts_are_bounded(tmp_path, options, named):
    with pytest.raises(ValueError, match=named):
        LocalArenaConfig(
            db=tmp_path / "a.db", catalog=load_catalog(DEFAULT_CATALOG), token="t0ken", **options
        )


def test_fault_settings_endpoint_is_never_delayed(tmp_path):
    with running_local_arena(tmp_path, faults={"latency_ms": 60_000}) as arena:
        headers = {"Authorization": f"Bearer {arena.token}"}
        faults_url = f"{arena.base_url}/openapi/v1/local/faults"
        started = time.monotonic()
        assert httpx.get(faults_url, headers=headers, timeout=10).json()["latency_ms"] == 60_000
        reset = httpx.put(faults_url, headers=headers, json={"latency_ms": 0}, timeout=10)
        assert reset.status_code == 200 and reset.json()["latency_ms"] == 0
        streams = httpx.get(f"{arena.base_url}/openapi/v1/streams", headers=headers, timeout=10)
        assert streams.status_code == 200
        assert time.monotonic() - started < 10


def test_put_of_an_unbounded_latency_is_a_400_naming_the_field(tmp_path):
    with running_local_arena(tmp_path) as arena:
        url = f"{arena.base_url}/openapi/v1/local/faults"
        headers = {"Authorization": f"Bearer {arena.token}"}
        response = httpx.put(url, headers=headers, json={"latency_ms": 1e30}, timeout=10)
        assert response.status_code == 400
        assert "latency_ms" in response.json()["error"]["message"]
        assert arena.arena.faults.latency_ms == 0
        edge = {"latency_ms": 60_000, "route_ttl_seconds": 86_400, "seed": 2**63 - 1}
        accepted = httpx.put(url, headers=headers, json=edge, timeout=10)
        assert accepted.status_code == 200 and accepted.json()["latency_ms"] == 60_000


def test_request_bodies_over_the_cap_get_413(tmp_path):
    limit = 4096
    with running_local_arena(tmp_path, max_body_bytes=limit) as arena:
        headers = {"Authorization": f"Bearer {arena.token}"}
        big = b'{"pad": "' + b"x" * (2 * limit) + b'"}'

        def chunks():
            for i in range(0, len(big), 1000):
                yield big[i : i + 1000]

        targets = [
            f"{arena.base_url}/openapi/v1/llm/models",
            f"{arena.base_url}/openapi/v1/streams/arith-easy/launch_one_task",
            f"{arena.base_url}/api/v1/chat/completions",
        ]
        for url in targets:
            for content in (big, chunks()):  # declared Content-Length, then chunked
                response = httpx.post(url, headers=headers, content=content, timeout=10)
                assert response.status_code == 413, (url, response.text)
                assert response.json()["error"]["code"] == "body_too_large"
                assert str(limit) in response.json()["error"]["message"]
        small = httpx.post(targets[0], headers=headers, json={"model_name": "x"}, timeout=10)
        assert small.status_code == 400  # read and validated as usual
