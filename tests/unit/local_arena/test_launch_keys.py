"""Launch and route keys with surrounding whitespace: stripped, so they work and stay secret.

A key read from a file keeps its trailing newline. Sent as is, it made the harness's HTTP
client reject the header, and the error text, stored in the task result, quoted the key
(escaped, so redaction of the raw value missed it).
"""

from __future__ import annotations

import json
import time

import httpx
import pytest

from areal.utils.serving import serve_in_thread
from examples.swe.local_arena.testing import running_local_arena
from tests.conftest import SECRET_SENTINEL
from tests.fakes.stub_llm import StubLLM

STREAM = "arith-easy"


@pytest.fixture
def stub():
    llm = StubLLM(lambda body: "4")
    with serve_in_thread(llm.app()) as url:
        llm.url = url
        yield llm


def launch(arena, stub, api_key: str, route_key: str = "upstream-key") -> dict:
    headers = {"Authorization": f"Bearer {arena.token}"}
    v1 = f"{arena.base_url}/openapi/v1"
    endpoint = {"endpoint_id": "e", "upstream_model": "m", "base_url": stub.url}
    route = {"model_name": "stream-areal-k", "endpoints": [{**endpoint, "api_key": route_key}]}
    assert httpx.post(f"{v1}/llm/models", headers=headers, json=route).status_code in (200, 201)
    data_id = httpx.post(f"{v1}/streams/{STREAM}/dataset?limit=1", headers=headers).json()[
        "data_ids"
    ][0]
    body = {
        "data_id": data_id,
        "model_name": "stream-areal-k",
        "base_url": arena.gateway_url,
        "api_key": api_key,
    }
    task_id = httpx.post(
        f"{v1}/streams/{STREAM}/launch_one_task", headers=headers, json=body
    ).json()["task_id"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        result = httpx.get(f"{v1}/tasks/{task_id}/result", headers=headers).json()
        if result["status"] not in ("PENDING", "RUNNING"):
            return result
        time.sleep(0.05)
    raise AssertionError(f"task {task_id} did not finish")


@pytest.mark.parametrize("padding", ["\n", " \r\n", "\t"])
def test_a_rejected_key_with_a_trailing_newline_is_not_stored(tmp_path, stub, padding):
    key = f"wrong-{SECRET_SENTINEL}{padding}"
    with running_local_arena(tmp_path) as arena:
        result = launch(arena, stub, key)
        stored = arena.arena.store.get_task(result["task_id"])
    assert result["status"] == "HARNESS_FAILED"
    assert SECRET_SENTINEL not in json.dumps(result)
    assert SECRET_SENTINEL not in json.dumps(stored.envelope())
    assert not stub.calls  # the gateway refused the key; nothing reached the upstream


def test_the_right_key_with_a_trailing_newline_still_authenticates(tmp_path, stub):
    with running_local_arena(tmp_path) as arena:
        result = launch(arena, stub, arena.token + "\n", route_key="upstream-key\n")
    assert result["status"] == "DONE"  # graded (the stub's answer need not be right)
    assert stub.calls[0].headers["authorization"] == "Bearer upstream-key"
