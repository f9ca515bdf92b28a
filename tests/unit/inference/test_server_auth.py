"""The embedded server needs its API key, and the client sends it on every call.

Acceptance case of the issue: against a real ``python -m areal.inference.server`` process
launched by ``RemoteSGLangEngine``, generation without the key gets 401 and with it 200,
and the key appears in no argv (``/proc/<pid>/cmdline``) and no log.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.api.io_struct import ModelRequest, WeightUpdateMeta
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.infra import workflow_context
from tests.fakes.live_server import ScriptedASGI, serve
from tests.fakes.scripted_http import ScriptedHTTP, reply

REPO = Path(__file__).resolve().parents[3]
KEY_ENV = "AREAL_INFERENCE_API_KEY"


def greedy(n: int) -> GenerationHyperparameters:
    return GenerationHyperparameters(greedy=True, max_new_tokens=n, max_tokens=500, ignore_eos=True)


def generate(engine: RemoteSGLangEngine, n: int = 8):
    async def run():
        try:
            return await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=greedy(n)))
        finally:
            await workflow_context.close_clients()

    return asyncio.run(run())


@pytest.fixture(scope="module")
def launched(tiny_model_dir, tmp_path_factory):
    """A real embedded server on this host's outward address, launched as production does,
    its stdout and stderr going to a file (the server logs every request at info)."""
    saved = os.environ.pop(KEY_ENV, None)
    log_path = tmp_path_factory.mktemp("server-log") / "server.log"
    engine = RemoteSGLangEngine(InferenceEngineConfig(backend="hf:d1", setup_timeout=120))
    args = {
        "model_path": str(tiny_model_dir),
        "dtype": "float32",
        "context_length": 512,
        "log_level": "info",
        "max_body_bytes": 200_000,
        "header_timeout": 1.0,
    }
    with open(log_path, "wb") as log:  # the child inherits fds 1 and 2
        saved_fds = os.dup(1), os.dup(2)
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            info = engine.launch_server(args)
        finally:
            os.dup2(saved_fds[0], 1)
            os.dup2(saved_fds[1], 2)
            os.close(saved_fds[0])
            os.close(saved_fds[1])
    try:
        engine.initialize()
        yield engine, info, log_path
    finally:
        engine.destroy()
        if saved is not None:
            os.environ[KEY_ENV] = saved


def test_generation_needs_the_api_key(launched):
    engine, info, _ = launched
    base = f"http://{info.address}"
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    assert httpx.post(f"{base}/generate", json=body).status_code == 401
    key = engine.api_key.reveal()
    assert len(key) >= 32  # generated for this engine's servers
    for bad in ("Bearer wrong-key", f"Basic {key}", f"Bearer {key}x", "Bearer"):
        response = httpx.post(f"{base}/generate", json=body, headers={"Authorization": bad})
        assert response.status_code == 401, bad
    for path in ("/pause_generation", "/update_weights_from_disk", "/abort_request"):
        assert httpx.post(f"{base}{path}", json={}).status_code == 401, path
    assert httpx.get(f"{base}/get_server_info").status_code == 401
    assert httpx.get(f"{base}/health").status_code == 200  # open, as on SGLang
    ok = httpx.post(f"{base}/generate", json=body, headers={"Authorization": f"bearer {key}"})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2
    assert len(generate(engine).output_tokens) == 8  # the client sends it itself


def test_the_key_is_in_no_argv_and_no_log(launched):
    engine, info, log_path = launched
    key = engine.api_key.reveal()
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("areal").addHandler(handler)
    try:
        generate(engine, 4)
        httpx.post(f"http://{info.address}/generate", json={"input_ids": [1]})  # a 401
    finally:
        logging.getLogger("areal").removeHandler(handler)
    server_argv = Path(f"/proc/{info.process.pid}/cmdline").read_bytes()
    assert b"areal.inference.server" in server_argv and key.encode() not in server_argv
    assert key.encode() not in Path("/proc/self/cmdline").read_bytes()
    log = log_path.read_text(errors="replace")
    assert '"POST /generate HTTP/1.1" 401' in log  # the server's access log was captured
    assert key not in log
    assert not any(key in message for message in records)


def test_the_limit_flags_reach_the_process(launched):
    engine, info, _ = launched
    headers = {"Authorization": f"Bearer {engine.api_key.reveal()}"}
    big = {"input_ids": [1] * 120_000}  # 240 kB of JSON, over --max-body-bytes 200000
    response = httpx.post(f"http://{info.address}/generate", json=big, headers=headers)
    assert response.status_code == 413 and "max-body-bytes" in response.json()["error"]["message"]
    host, port = info.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\n")  # and never the rest
        started = time.monotonic()
        answer = conn.recv(1024)
    assert answer.startswith(b"HTTP/1.1 408") and time.monotonic() - started < 5


def test_without_a_key_the_server_refuses_an_outward_address(tiny_model_dir):
    env = {k: v for k, v in os.environ.items() if k != KEY_ENV}
    result = subprocess.run(
        [
            *(sys.executable, "-m", "areal.inference.server", "--model-path", str(tiny_model_dir)),
            *("--host", "0.0.0.0", "--port", "1"),
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and KEY_ENV in result.stderr


# --- the client side, against recording peers ---


def generate_reply(request: httpx.Request) -> httpx.Response:
    n = json.loads(request.content)["sampling_params"]["max_new_tokens"]
    return reply(
        200,
        {
            "output_ids": [7] * n,
            "meta_info": {
                "finish_reason": {"type": "length", "length": n},
                "output_token_logprobs": [[-0.5, 7, None]] * n,
            },
        },
    )


@pytest.fixture
def peer(monkeypatch):
    monkeypatch.setenv(KEY_ENV, "per-run-key-0123456789")
    scripted = ScriptedHTTP()
    scripted.on("GET", "/health", reply(200, {}))
    scripted.on("GET", "/get_model_info", reply(200, {"model_path": "m"}))
    scripted.on("POST", "/generate", generate_reply)
    for path in ("/pause_generation", "/continue_generation", "/init_weights_update_group"):
        scripted.on("POST", path, reply(200, {"success": True}))
    with serve(ScriptedASGI(scripted)) as url:
        yield scripted, url.removeprefix("http://")


def test_every_client_call_carries_the_key(peer):
    scripted, address = peer
    engine = RemoteSGLangEngine(InferenceEngineConfig(backend="sglang:d1", setup_timeout=10))
    try:
        engine.initialize(addr=address)
        assert len(generate(engine, 3).output_tokens) == 3  # through the HTTP pool
        engine.begin_weight_update(1)  # fan-out
        meta = WeightUpdateMeta(type="xccl", nccl_master_address="10.0.0.7", nccl_master_port=1)
        engine.init_weights_update_group(meta).result()  # one attempt per server
    finally:
        engine.destroy()
    seen = {(r.method, r.raw_path): r.headers.get("authorization") for r in scripted.requests}
    for route in (
        ("GET", "/get_model_info"),
        ("POST", "/generate"),
        ("POST", "/pause_generation"),
        ("POST", "/init_weights_update_group"),
    ):
        assert seen[route] == "Bearer per-run-key-0123456789", route


def test_a_refused_key_fails_at_once_naming_the_variable(peer):
    scripted, address = peer
    engine = RemoteSGLangEngine(
        InferenceEngineConfig(backend="sglang:d1", setup_timeout=10, request_retries=3)
    )
    try:
        engine.initialize(addr=address)
        scripted.routes[("POST", "/generate")].clear()
        scripted.on("POST", "/generate", reply(401, {"error": "Unauthorized"}))
        with pytest.raises(RuntimeError, match=KEY_ENV):
            generate(engine)
        assert len(scripted.calls("POST", "/generate")) == 1  # no retries
    finally:
        engine.destroy()
    scripted.routes[("GET", "/get_model_info")].clear()
    scripted.on("GET", "/get_model_info", reply(401, {"error": "Unauthorized"}))
    with pytest.raises(RuntimeError, match=KEY_ENV):
        RemoteSGLangEngine(InferenceEngineConfig(backend="sglang:d1")).initialize(addr=address)
