"""The worker RPC server as a real subprocess, and the client's retry rules."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from areal.api.scheduler_api import RPC_TOKEN_ENV
from areal.infra.rpc.auth import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    RequestSigner,
    sign_response,
    signed_headers,
)
from areal.infra.rpc.client import RPCClient
from areal.infra.rpc.guard import SignedRequestGuard
from areal.infra.rpc.loop import run_sync
from areal.infra.rpc.processes import process_alive
from areal.infra.rpc.serialization import json_dumps
from areal.infra.scheduler.exceptions import (
    EngineCallError,
    EngineCreationError,
    EngineImportError,
    PortAllocationError,
    RPCConnectionError,
    WorkerConfigurationError,
)
from areal.utils import names
from areal.utils.paths import get_log_path
from areal.utils.seeding import derive_seed
from areal.utils.serving import serve_in_thread
from tests.unit.infra.fake_engines import NotAnExceptionError, Point

REPO_ROOT = Path(__file__).resolve().parents[3]
TOKEN = "rpc-test-token-5d1e9a"
FAKES = "tests.unit.infra.fake_engines"


@dataclass
class RunningWorker:
    process: subprocess.Popen
    address: str
    root: Path
    output: Path

    @property
    def url(self) -> str:
        return f"http://{self.address}"

    def client(self, token: str = TOKEN) -> RPCClient:
        return RPCClient(self.address, token=token, worker_id="actor/0")

    def post(self, path: str, body: dict, token: str | None = TOKEN) -> httpx.Response:
        """POST signed with ``token`` (unsigned when it is None or empty)."""
        return post_raw(f"{self.url}{path}", json_dumps(body), token)


def post_raw(url: str, content: bytes, token: str | None = TOKEN) -> httpx.Response:
    headers = signed_headers(token, "POST", url, content) if token else {}
    return httpx.post(url, content=content, headers=headers)


def worker_cmd(root: Path, role: str = "actor", index: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "areal.infra.rpc.rpc_server",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--experiment-name",
        "exp",
        "--trial-name",
        "trial",
        "--role",
        role,
        "--worker-index",
        str(index),
        "--nfs-record-root",
        str(root / "name_resolve"),
        "--fileroot",
        str(root / "files"),
    ]


def worker_env(token: str = TOKEN) -> dict[str, str]:
    env = {**os.environ, RPC_TOKEN_ENV: token, "PYTHONPATH": str(REPO_ROOT)}
    env.pop("SLURM_PROCID", None)
    return env


def start_worker(root: Path, role: str = "actor", index: int = 0) -> RunningWorker:
    output = root / f"{role}{index}.out"
    with open(output, "wb") as out:
        process = subprocess.Popen(
            worker_cmd(root, role, index),
            env=worker_env(),
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    entry = root / "name_resolve" / names.worker("exp", "trial", role, index) / "ENTRY"
    deadline = time.monotonic() + 60
    while not entry.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"worker did not register:\n{output.read_text()}")
        time.sleep(0.05)
    return RunningWorker(process, entry.read_text(), root, output)


def stop(worker: RunningWorker) -> None:
    if worker.process.poll() is None:
        os.killpg(worker.process.pid, signal.SIGKILL)
        worker.process.wait()


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningWorker]:
    running = start_worker(tmp_path_factory.mktemp("rpc"))
    yield running
    stop(running)


@pytest.fixture(scope="module")
def echo(worker: RunningWorker) -> str:
    """Name of an EchoEngine on the shared worker."""
    client = worker.client()
    return run_sync(client.create_engine(f"{FAKES}.EchoEngine", "echo", name="first"))


# --- auth and health ---


def test_health_needs_no_token_but_tells_an_unsigned_caller_nothing_more(worker):
    response = httpx.get(f"{worker.url}/health")
    assert response.json() == {"status": "healthy"}
    assert SIGNATURE_HEADER not in response.headers
    body = run_sync(worker.client().health())  # signed, and the signed answer verified
    assert body["status"] == "healthy"
    assert {"forked_children", "engine_count", "engines"} <= set(body)


@pytest.mark.parametrize("token", [None, "", "wrong-token"])
@pytest.mark.parametrize("path", ["/alloc_ports", "/call", "/create_engine", "/configure", "/fork"])
def test_every_other_endpoint_needs_the_token(worker, path, token):
    response = worker.post(path, {"count": 1}, token=token)
    assert response.status_code == 401
    assert "error" in response.json()


def test_token_is_neither_on_argv_nor_in_output(worker):
    cmdline = Path(f"/proc/{worker.process.pid}/cmdline").read_bytes()
    assert TOKEN.encode() not in cmdline
    assert TOKEN not in worker.output.read_text()


def test_server_refuses_to_start_without_a_token(tmp_path):
    result = subprocess.run(
        worker_cmd(tmp_path),
        env=worker_env(token=""),
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert RPC_TOKEN_ENV in result.stderr


def test_worker_index_is_required(tmp_path):
    cmd = worker_cmd(tmp_path)
    cmd[cmd.index("--worker-index") + 1] = "-1"
    result = subprocess.run(
        cmd, env=worker_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "--worker-index" in result.stderr


# --- ports, env, configure ---


def test_alloc_ports(worker):
    client = worker.client()
    first, second = run_sync(client.alloc_ports(3)), run_sync(client.alloc_ports(2))
    assert len(set(first + second)) == 5
    assert worker.post("/alloc_ports", {"count": 0}).status_code == 400
    assert worker.post("/alloc_ports", {}).status_code == 400
    with pytest.raises(PortAllocationError, match="positive"):
        run_sync(client.alloc_ports(-1))


def test_set_env_reaches_engines(worker, echo):
    client = worker.client()
    run_sync(client.set_env({"AREAL_TEST_FLAG": "on"}))
    assert run_sync(client.call_engine("get_env", "AREAL_TEST_FLAG", engine_name=echo)) == "on"
    assert worker.post("/set_env", {"env": {"A": 1}}).status_code == 400


def test_configure_seeds_with_role_and_rank(worker):
    client = worker.client()
    reply = run_sync(client.configure({"seed": 11}, role="actor", rank=3))
    # the key is the worker's own --role plus the rank
    assert reply["seed"] == derive_seed(11, "actor3")
    assert worker.post("/configure", {"config": {"seed": 1}}).status_code == 400
    with pytest.raises(WorkerConfigurationError, match="config"):
        run_sync(client._control("/configure", {"rank": 0}, WorkerConfigurationError))


# --- engines ---


def test_create_engine_errors(worker, echo):
    client = worker.client()
    with pytest.raises(EngineCreationError, match="already exists"):
        run_sync(client.create_engine(f"{FAKES}.EchoEngine", echo))
    with pytest.raises(EngineImportError, match="cannot import"):
        run_sync(client.create_engine(f"{FAKES}.Missing", "missing"))
    with pytest.raises(EngineImportError, match="not a TrainEngine or InferenceEngine"):
        run_sync(client.create_engine(f"{FAKES}.NotAnEngine", "plain"))
    with pytest.raises(EngineCreationError, match=r"HTTP 500.*constructor exploded"):
        run_sync(client.create_engine(f"{FAKES}.BrokenEngine", "broken"))
    engines = run_sync(client.health())["engines"]
    assert echo in engines and not {"missing", "plain", "broken"} & set(engines)
    response = worker.post("/create_engine", {"engine": f"{FAKES}.BrokenEngine"})
    assert response.status_code == 400  # no engine_name


def test_call_round_trips_values(worker, echo):
    client = worker.client()
    tensor = torch.arange(6, dtype=torch.bfloat16).reshape(2, 3)
    result = run_sync(
        client.call_engine("echo", tensor, Point(1, 2.0), engine_name=echo, flag=(1, 2))
    )
    assert torch.equal(result["args"][0], tensor)
    assert result["args"][1] == Point(1, 2.0)
    assert result["kwargs"] == {"flag": (1, 2)}
    assert result["name"] == "first"


def test_accepted_rpc_sockets_have_nagle_off():
    """The listening socket is created as TCP (protocol 6, not 0): asyncio sets TCP_NODELAY
    only on accepted sockets of that protocol, and without it every reply's body waited
    for a delayed ACK (about 40 ms per RPC)."""
    import socket

    from areal.infra.rpc.rpc_server import _bind

    sock, _ = _bind("127.0.0.1", 0)
    assert sock.proto == socket.IPPROTO_TCP
    seen: list[int] = []

    async def main() -> None:
        def accepted(reader, writer):
            raw = writer.get_extra_info("socket")
            seen.append(raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            writer.close()

        server = await asyncio.start_server(accepted, sock=sock)
        port = sock.getsockname()[1]
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(100):
                if seen:
                    break
                await asyncio.sleep(0.01)
            writer.close()

    asyncio.run(main())
    assert seen and seen[0] != 0


def test_engine_work_runs_on_one_engine_thread(worker, echo):
    client = worker.client()

    async def many() -> list:
        calls = [client.call_engine("echo", i, engine_name=echo) for i in range(8)]
        return await asyncio.gather(*calls)

    results = asyncio.run(many())
    assert [r["args"][0] for r in results] == list(range(8))
    assert run_sync(client.call_engine("engine_threads", engine_name=echo)) == ["engine"]


def test_futures_and_coroutines_are_awaited(worker, echo):
    client = worker.client()
    assert run_sync(client.call_engine("future_square", 7, engine_name=echo)) == 49
    assert run_sync(client.call_engine("async_double", 21, engine_name=echo)) == 42


def test_call_errors(worker, echo):
    client = worker.client()
    assert worker.post("/call", {"method": "echo", "engine_name": "nope"}).status_code == 404
    for method in ("no_such_method", "_private", "__class__"):
        response = worker.post("/call", {"method": method, "engine_name": echo})
        assert response.status_code == 400, method
    assert worker.post("/call", {"engine_name": echo}).status_code == 400
    bad_args = {"method": "echo", "engine_name": echo, "args": {"__areal_type__": "pickle"}}
    assert worker.post("/call", bad_args).status_code == 400
    raw = post_raw(f"{worker.url}/call", b"{not json")
    assert raw.status_code == 400
    response = worker.post("/call", {"method": "fail", "engine_name": echo, "args": ["boom"]})
    assert response.status_code == 500
    assert response.json()["error"] == "Engine method 'fail' failed: RuntimeError: boom"
    with pytest.raises(EngineCallError, match="boom") as info:
        run_sync(client.call_engine("fail", "boom", engine_name=echo, retry_delay=0.01))
    assert info.value.attempt == 1  # a plain 500 is not retried


def test_only_interface_methods_are_called(worker):
    client = worker.client()
    run_sync(client.create_engine(f"{FAKES}.UndeclaredMethodEngine", "undeclared"))
    assert run_sync(client.call_engine("get_version", engine_name="undeclared")) == 0
    response = worker.post("/call", {"method": "undeclared", "engine_name": "undeclared"})
    assert response.status_code == 400
    error = response.json()["error"]
    assert "'undeclared'" in error and "engine interfaces" in error


def test_an_engine_failure_that_is_no_exception_gets_a_signed_answer(worker, echo):
    # e.g. a DCP save on a full disk: unsigned, the client would blame an impostor instead
    expected = "Engine method 'fail_beyond_exception' failed: NotAnExceptionError: disk full"
    with pytest.raises(EngineCallError, match=expected):
        run_sync(
            worker.client().call_engine("fail_beyond_exception", "disk full", engine_name=echo)
        )
    assert run_sync(worker.client().call_engine("add", 1, 2, engine_name=echo)) == 3  # serving


def test_the_guard_signs_the_answer_to_an_app_that_failed_without_one():
    async def crashing(scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            raise NotAnExceptionError("no answer")

    signer = RequestSigner(TOKEN)  # refuses an unsigned answer
    with serve_in_thread(SignedRequestGuard(crashing, TOKEN)) as url, httpx.Client() as client:
        response = client.post(f"{url}/call", content=b"{}", auth=signer)
    assert response.status_code == 500
    assert response.json() == {"error": "the server failed: NotAnExceptionError: no answer"}


def test_non_head_train_ranks_return_null(worker):
    client = worker.client()
    run_sync(client.create_engine(f"{FAKES}.FakeTrainEngine", "head", head=True))
    run_sync(client.create_engine(f"{FAKES}.FakeTrainEngine", "follower", head=False))
    assert run_sync(client.call_engine("step", 1, engine_name="head")) == 2
    assert run_sync(client.call_engine("step", 1, engine_name="follower")) is None


def test_destroy_drops_the_engine(worker):
    client = worker.client()
    run_sync(client.create_engine(f"{FAKES}.EchoEngine", "short-lived"))
    run_sync(client.call_engine("destroy", engine_name="short-lived"))
    assert "short-lived" not in run_sync(client.health())["engines"]


# --- fork ---


def test_fork_and_kill(worker):
    client = worker.client()
    script = (
        "import os, time; print('hello from', os.environ['FORK_FLAG'], flush=True); time.sleep(60)"
    )
    info = run_sync(
        client.fork("helper", 0, [sys.executable, "-c", script], env={"FORK_FLAG": "child"})
    )
    assert info["status"] == "success" and info["host"] == "127.0.0.1"
    pid = info["pid"]
    log_dir = get_log_path(str(worker.root / "files"), "exp", "trial", create=False)
    deadline = time.monotonic() + 30
    while "hello from child" not in _read(log_dir / "helper.log"):
        assert time.monotonic() < deadline, "forked child did not log"
        time.sleep(0.05)
    assert "[helper/0] hello from child" in _read(log_dir / "merged.log")
    assert run_sync(client.health())["forked_children"] == 1
    assert (
        worker.post("/fork", {"role": "helper", "worker_index": 0, "raw_cmd": ["x"]}).status_code
        == 400
    )
    run_sync(client.kill_forked_worker("helper", 0))
    assert not process_alive(pid)
    assert (
        worker.post("/kill_forked_worker", {"role": "helper", "worker_index": 0}).status_code == 404
    )
    assert (
        worker.post("/fork", {"role": "helper", "worker_index": 1, "raw_cmd": []}).status_code
        == 400
    )


def _read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


# --- shutdown ---


def test_sigterm_destroys_engines_and_kills_forked_children(tmp_path):
    running = start_worker(tmp_path, role="rollout", index=2)
    try:
        client = running.client()
        marker = tmp_path / "destroyed"
        run_sync(client.create_engine(f"{FAKES}.EchoEngine", "e", destroy_marker=str(marker)))
        child = run_sync(
            client.fork("sub", 0, [sys.executable, "-c", "import time; time.sleep(60)"])
        )
        running.process.send_signal(signal.SIGTERM)
        assert running.process.wait(timeout=30) == 0
        assert marker.read_text() == "destroyed echo"
        assert not process_alive(child["pid"])
        entry = tmp_path / "name_resolve" / names.worker("exp", "trial", "rollout", 2) / "ENTRY"
        assert not entry.exists()  # the registration is removed on exit
    finally:
        stop(running)


# --- client retry rules (against a scripted ASGI peer) ---


class ScriptedCallServer:
    """Answers successive ``/call`` requests with the scripted (status, body) pairs."""

    def __init__(self, script: list[tuple[int, dict]], token: str = "tok"):
        self.script = list(script)
        self.token = token
        self.calls = 0
        self.headers: list[dict[bytes, bytes]] = []

    @property
    def nonces(self) -> list[str]:
        return [h.get(NONCE_HEADER.lower().encode(), b"").decode() for h in self.headers]

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        while (await receive()).get("more_body"):
            pass
        headers = dict(scope["headers"])
        self.headers.append(headers)
        nonce = headers.get(NONCE_HEADER.lower().encode(), b"").decode()
        status, body = self.script[min(self.calls, len(self.script) - 1)]
        self.calls += 1
        raw = json_dumps(body)
        signature = sign_response(self.token, status, nonce, raw).encode()
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", b"application/json"),
                    (SIGNATURE_HEADER.lower().encode(), signature),
                ],
            }
        )
        await send({"type": "http.response.body", "body": raw})


OK = (200, {"status": "success", "result": 5})


@pytest.mark.parametrize(
    ("script", "expected_calls"),
    [
        ([(503, {"error": "busy"}), (503, {"error": "busy"}), OK], 3),
        ([(500, {"error": "Engine method 'x' failed: TimeoutError: read timeout"}), OK], 2),
    ],
)
def test_client_retries_transient_failures(script, expected_calls):
    peer = ScriptedCallServer(script)
    with serve_in_thread(peer) as url:
        client = RPCClient(url.removeprefix("http://"), token="tok", worker_id="w/0")
        assert run_sync(client.call_engine("x", retry_delay=0.01)) == 5
    assert peer.calls == expected_calls
    assert len(set(peer.nonces)) == expected_calls  # each attempt signed afresh
    assert not any(b"x-areal-token" in h for h in peer.headers)


def test_client_gives_up_after_max_retries_and_keeps_the_server_error():
    peer = ScriptedCallServer([(503, {"error": "still busy"})])
    with serve_in_thread(peer) as url:
        client = RPCClient(url.removeprefix("http://"), token="tok", worker_id="w/0")
        with pytest.raises(EngineCallError, match="still busy") as info:
            run_sync(client.call_engine("x", max_retries=2, retry_delay=0.01))
    assert info.value.attempt == 2 and peer.calls == 2


def test_client_does_not_retry_client_errors():
    peer = ScriptedCallServer([(400, {"error": "engine 'w/0' has no method 'x'"})])
    with serve_in_thread(peer) as url:
        client = RPCClient(url.removeprefix("http://"), token="tok", worker_id="w/0")
        with pytest.raises(EngineCallError, match="has no method"):
            asyncio.run(client.call_engine("x", retry_delay=0.01))
    assert peer.calls == 1


def test_client_retries_connection_errors_then_raises(unused_port):
    checks = []
    client = RPCClient(
        f"127.0.0.1:{unused_port}",
        token="tok",
        worker_id="w/0",
        liveness_check=lambda: checks.append(1),
    )
    with pytest.raises(EngineCallError, match="no answer") as info:
        run_sync(client.call_engine("x", max_retries=3, retry_delay=0.01))
    assert info.value.attempt == 3
    assert len(checks) == 4  # before each attempt, and once more to explain the failure
    with pytest.raises(RPCConnectionError):
        run_sync(client.health())


def test_client_token_defaults_to_the_environment(monkeypatch):
    monkeypatch.setenv(RPC_TOKEN_ENV, "from-env")
    peer = ScriptedCallServer([OK], token="from-env")  # answers verify only with that token
    with serve_in_thread(peer) as url:
        assert run_sync(RPCClient(url.removeprefix("http://")).call_engine("x")) == 5


@pytest.fixture
def unused_port() -> int:
    from areal.utils.network import find_free_port

    return find_free_port("127.0.0.1")
