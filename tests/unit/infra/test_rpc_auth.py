"""Signed RPC: a real worker refuses forged, stale and replayed requests; no token travels."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from areal.infra.rpc import auth
from areal.infra.rpc.auth import (
    NONCE_HEADER,
    SIGNATURE_HEADER,
    SIGNED_HEADERS,
    AuthError,
    ReplayCache,
    check_request,
    sign_request,
    verify_response,
)
from areal.infra.rpc.client import RPCClient
from areal.infra.rpc.guard import SignedRequestGuard
from areal.infra.rpc.loop import run_sync
from areal.infra.rpc.rpc_server import WorkerServer
from areal.infra.rpc.serialization import json_dumps
from areal.infra.scheduler.exceptions import RPCAuthenticationError
from areal.utils import names
from areal.utils.http_limits import read_body
from areal.utils.serving import serve_in_thread
from tests.unit.infra.test_rpc_server import (
    OK,
    REPO_ROOT,
    ScriptedCallServer,
    worker_cmd,
    worker_env,
)

TOKEN = "rpc-test-token-5d1e9a"  # what worker_env() gives the worker
FAKES = "tests.unit.infra.fake_engines"
LIMITS = ["--max-body-bytes", "4096", "--header-timeout", "1", "--body-timeout", "1"]
LIMITS += ["--idle-timeout", "1"]


# --- the protocol itself ---


def test_a_signature_covers_method_host_target_timestamp_nonce_and_body():
    headers = sign_request(TOKEN, "POST", "10.0.0.1:5000", "/call?x=1", b"{}")
    lower = {k.lower(): v for k, v in headers.items()}
    signed = check_request(TOKEN, "POST", "10.0.0.1:5000", "/call?x=1", lower)
    assert signed.nonce == headers[NONCE_HEADER]
    changed = [
        ("GET", "10.0.0.1:5000", "/call?x=1", lower),
        ("POST", "10.0.0.2:5000", "/call?x=1", lower),
        ("POST", "10.0.0.1:5000", "/fork", lower),
        ("POST", "10.0.0.1:5000", "/call?x=1", {**lower, "x-areal-content-sha256": "0" * 64}),
        ("POST", "10.0.0.1:5000", "/call?x=1", {**lower, "x-areal-nonce": "1" * 32}),
    ]
    for method, host, target, hdrs in changed:
        with pytest.raises(AuthError, match="wrong signature"):
            check_request(TOKEN, method, host, target, hdrs)
    with pytest.raises(AuthError, match="wrong signature"):
        check_request("another-token", "POST", "10.0.0.1:5000", "/call?x=1", lower)
    old = sign_request(TOKEN, "GET", "h:1", "/", b"", timestamp=int(time.time()) - 61)
    with pytest.raises(AuthError, match="clock"):
        check_request(TOKEN, "GET", "h:1", "/", {k.lower(): v for k, v in old.items()})


def test_the_replay_cache_refuses_a_nonce_twice_even_after_it_is_full():
    cache = ReplayCache(window=60, capacity=2)
    now = 1000.0
    cache.use("a" * 32, 990, now)
    cache.use("b" * 32, 995, now)
    with pytest.raises(AuthError, match="replayed"):
        cache.use("b" * 32, 995, now)
    cache.use("c" * 32, 999, now)  # full: "a" is forgotten, and with it everything as old
    assert len(cache) == 2
    with pytest.raises(AuthError, match="too old"):
        cache.use("a" * 32, 990, now)
    with pytest.raises(AuthError, match="replayed"):
        cache.use("c" * 32, 999, now)
    cache.use("d" * 32, 1100, now=1100.0)  # "b" and "c" expired with the window
    assert len(cache) == 1


def test_a_replay_at_the_very_edge_of_the_window_is_refused():
    # the timestamp check accepts ts up to ts + skew; from that instant the replay cache
    # may read a later clock (it used to read its own), and must still remember the nonce
    skew, ts = 60.0, 1_700_000_000
    cache = ReplayCache(window=skew)
    nonce = "e" * 32
    headers = sign_request(TOKEN, "POST", "h:1", "/call", b"", timestamp=ts, nonce=nonce)
    lower = {k.lower(): v for k, v in headers.items()}
    first = check_request(TOKEN, "POST", "h:1", "/call", lower, now=ts + 1.0, skew=skew)
    cache.use(first.nonce, first.timestamp, now=ts + 1.0)
    # |ts - now| == skew: still accepted
    again = check_request(TOKEN, "POST", "h:1", "/call", lower, now=ts + skew, skew=skew)
    # the cache judged at the check's instant, and later (a clock of its own): the nonce
    # is kept until ts + skew + 1 (the margin), then forgotten with everything as old
    later = [(0.0, "replayed"), (0.5, "replayed"), (1.0, "replayed"), (1.5, "too old")]
    for after, refusal in [*later, (600.0, "too old")]:
        with pytest.raises(AuthError, match=refusal):
            cache.use(again.nonce, again.timestamp, now=ts + skew + after)
    with pytest.raises(AuthError, match="clock"):  # a moment later the check refuses it
        check_request(TOKEN, "POST", "h:1", "/call", lower, now=ts + skew + 0.5, skew=skew)
    # what the guard passes to the cache: the reading the timestamp was checked at
    assert (first.checked_at, again.checked_at) == (ts + 1.0, ts + skew)


def test_a_forgotten_nonce_is_refused_even_when_the_clock_steps_back():
    cache = ReplayCache(window=60)
    cache.use("f" * 32, 1000, now=1000.0)
    cache.use("1" * 32, 1100, now=1100.0)  # "f" (1000 < 1100 - 61) is forgotten
    assert len(cache) == 1
    with pytest.raises(AuthError, match="too old"):  # the clock went back to 1050
        cache.use("f" * 32, 1000, now=1050.0)


class SteppingClock:
    """Stands in for the ``time`` module of :mod:`areal.infra.rpc.auth`: each reading is
    ``step`` seconds after the last, so two readings for one request differ."""

    def __init__(self, start: float, step: float = 0.5):
        self.now, self.step = start, step

    def time(self) -> float:
        now = self.now
        self.now += self.step
        return now


async def echo_body(scope, receive, send):
    body = await read_body(receive)
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": body or b""})


def test_the_guard_refuses_a_replay_at_the_edge_of_the_window(monkeypatch):
    ts, skew = 1_700_000_000, 60.0
    clock = SteppingClock(float(ts))
    monkeypatch.setattr(auth, "time", clock)
    guard = SignedRequestGuard(echo_body, TOKEN, max_skew=skew)
    body = b'{"x": 1}'
    headers = sign_request(TOKEN, "POST", "worker:9", "/call", body, timestamp=ts)

    async def send_once() -> httpx.Response:
        transport = httpx.ASGITransport(app=guard)
        async with httpx.AsyncClient(transport=transport, base_url="http://worker:9") as client:
            return await client.post("/call", content=body, headers=headers)

    assert asyncio.run(send_once()).status_code == 200
    clock.now = ts + skew  # the last instant the timestamp check accepts the request
    replayed = asyncio.run(send_once())
    assert replayed.status_code == 401, replayed.text
    assert "already used" in replayed.json()["error"]


# --- a real worker process ---


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    root = tmp_path_factory.mktemp("rpc_auth")
    output = root / "worker.out"
    with open(output, "wb") as out:
        process = subprocess.Popen(
            [*worker_cmd(root), *LIMITS],
            env=worker_env(),
            cwd=REPO_ROOT,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    entry = root / "name_resolve" / names.worker("exp", "trial", "actor", 0) / "ENTRY"
    deadline = time.monotonic() + 60
    while not entry.exists():
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"worker did not register:\n{output.read_text()}")
        time.sleep(0.05)
    yield entry.read_text(), root
    process.kill()
    process.wait()


def post(address: str, path: str, body: bytes, headers: dict[str, str]) -> httpx.Response:
    return httpx.post(f"http://{address}{path}", content=body, headers=headers, timeout=10)


def signed(address: str, path: str, body: bytes, token: str = TOKEN, **kw) -> dict[str, str]:
    return sign_request(token, "POST", address, path, body, **kw)


def test_wrong_signature_stale_timestamp_replay_and_relay_are_refused(worker):
    address, _ = worker
    body = json_dumps({"count": 1})
    good = signed(address, "/alloc_ports", body)
    first = post(address, "/alloc_ports", body, good)
    assert first.status_code == 200
    verify_response(TOKEN, 200, good[NONCE_HEADER], first.headers, first.content)

    refused = {
        "replayed": post(address, "/alloc_ports", body, good),
        "wrong signature": post(address, "/alloc_ports", body, signed(address, "/x", body, "t")),
        "stale": post(
            address,
            "/alloc_ports",
            body,
            signed(address, "/alloc_ports", body, timestamp=int(time.time()) - 120),
        ),
        "from the future": post(
            address,
            "/alloc_ports",
            body,
            signed(address, "/alloc_ports", body, timestamp=int(time.time()) + 120),
        ),
        # a request signed for another server and relayed here unchanged, Host included
        "relayed": post(
            address,
            "/alloc_ports",
            body,
            {**signed("127.0.0.1:1", "/alloc_ports", body), "Host": "127.0.0.1:1"},
        ),
        "unsigned": post(address, "/alloc_ports", body, {}),
    }
    for case, response in refused.items():
        assert response.status_code == 401, case
        assert SIGNATURE_HEADER not in response.headers, case  # no oracle for strangers
    assert "already used" in refused["replayed"].json()["error"]
    assert "wrong signature" in refused["wrong signature"].json()["error"]
    assert "clock" in refused["stale"].json()["error"]
    assert "another server" in refused["relayed"].json()["error"]
    assert "missing" in refused["unsigned"].json()["error"]


def test_fork_and_create_engine_run_nothing_without_a_valid_signature(worker, tmp_path):
    address, _ = worker
    runs = tmp_path / "runs"
    script = f"open({str(runs)!r}, 'a').write('ran\\n')"

    def fork_body(index: int) -> bytes:
        cmd = [sys.executable, "-c", script]
        return json_dumps({"role": "evil", "worker_index": index, "raw_cmd": cmd})

    def health() -> dict:
        return run_sync(RPCClient(address, token=TOKEN).health())

    # The worker starts a forked child inside its /fork handler, before it answers: any
    # child is alive (counted) or has written to `runs` by the time its answer is in.
    alive_before = health()["forked_children"]
    body = fork_body(0)
    stale = int(time.time()) - 120
    attempts = [
        {},
        signed(address, "/fork", body, token="not-the-token"),
        signed(address, "/fork", body, timestamp=stale),
        {"X-Areal-Token": TOKEN},  # the old clear-text header opens nothing either
    ]
    for headers in attempts:
        assert post(address, "/fork", body, headers).status_code == 401
    create = json_dumps({"engine": f"{FAKES}.EchoEngine", "engine_name": "intruder"})
    assert post(address, "/create_engine", create, {}).status_code == 401
    forged = signed(address, "/create_engine", create, token="x")
    assert post(address, "/create_engine", create, forged).status_code == 401
    after_refusals = health()
    assert after_refusals["forked_children"] == alive_before and not runs.exists()
    assert "intruder" not in after_refusals["engines"]

    # the same request, properly signed, runs once; its replay does not run it again
    good = signed(address, "/fork", fork_body(1))
    assert post(address, "/fork", fork_body(1), good).status_code == 200
    assert post(address, "/fork", fork_body(1), good).status_code == 401
    # both forks are answered, so their children (if any) started: once none is alive,
    # every one of them has written to `runs`
    deadline = time.monotonic() + 30
    while health()["forked_children"] > alive_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert health()["forked_children"] == alive_before
    assert runs.read_text() == "ran\n"


def test_bodies_over_the_cap_get_413_and_tampered_ones_400(worker):
    address, _ = worker
    big = json_dumps({"count": 1, "pad": "x" * 5000})
    response = post(address, "/alloc_ports", big, signed(address, "/alloc_ports", big))
    assert response.status_code == 413 and "4096 bytes" in response.json()["error"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted while reading
        yield big[:3000]
        yield big[3000:]

    response = httpx.post(
        f"http://{address}/alloc_ports",
        content=chunks(),
        headers=signed(address, "/alloc_ports", big),
        timeout=10,
    )
    assert response.status_code == 413
    small = json_dumps({"count": 1})
    response = post(address, "/alloc_ports", small, signed(address, "/alloc_ports", b"{}"))
    assert response.status_code == 400 and "does not match" in response.json()["error"]


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


def test_silent_slow_and_idle_connections_are_closed(worker):
    host, port = worker[0].rsplit(":", 1)
    with socket.create_connection((host, int(port))) as silent:
        assert _closed_within(silent, 5)
    with socket.create_connection((host, int(port))) as slow:
        slow.sendall(b"POST /call HTTP/1.1\r\nHost: x\r\n")  # headers never finished
        assert _closed_within(slow, 5)
    with socket.create_connection((host, int(port))) as idle:
        idle.sendall(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
        idle.settimeout(5)
        assert idle.recv(65536).startswith(b"HTTP/1.1 200")
        assert _closed_within(idle, 5)
    with socket.create_connection((host, int(port))) as huge:
        huge.sendall(b"GET /health HTTP/1.1\r\nX-Pad: " + b"a" * 70_000 + b"\r\n\r\n")
        huge.settimeout(5)
        assert huge.recv(65536).startswith(b"HTTP/1.1 400")


def test_a_stalled_body_gets_408(worker):
    address, _ = worker
    host, port = address.rsplit(":", 1)
    body = json_dumps({"count": 1, "pad": "y" * 100})
    headers = signed(address, "/alloc_ports", body)
    head = f"POST /alloc_ports HTTP/1.1\r\nHost: {address}\r\nContent-Length: {len(body)}\r\n"
    head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
    with socket.create_connection((host, int(port))) as conn:
        conn.sendall(head.encode() + body[:10])
        conn.settimeout(10)
        assert conn.recv(65536).startswith(b"HTTP/1.1 408")


def test_the_max_body_flag_and_environment_are_checked(tmp_path):
    cmd = [*worker_cmd(tmp_path), "--max-body-bytes", "0"]
    result = subprocess.run(
        cmd, env=worker_env(), cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "--max-body-bytes" in result.stderr
    env = {**worker_env(), "AREAL_RPC_MAX_BODY_BYTES": "lots"}
    result = subprocess.run(
        worker_cmd(tmp_path), env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2 and "AREAL_RPC_MAX_BODY_BYTES" in result.stderr


# --- what goes over the wire ---


class Recorder:
    """ASGI wrapper that keeps every request's headers and body, then passes it on."""

    def __init__(self, app):
        self.app = app
        self.requests: list[tuple[dict[str, str], bytes]] = []

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        headers = {k.decode().lower(): v.decode() for k, v in scope["headers"]}
        self.requests.append((headers, b"".join(chunks)))
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def assert_token_never_sent(requests: list[tuple[dict[str, str], bytes]], token: str) -> None:
    assert requests
    for headers, body in requests:
        assert "x-areal-token" not in headers
        assert all(token not in k and token not in v for k, v in headers.items())
        assert token.encode() not in body
        assert {h.lower() for h in SIGNED_HEADERS} <= set(headers)


def test_the_token_is_never_in_any_request_of_the_client(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_TEST_AUTH_FLAG", "0")  # restored after /set_env changes it
    server = WorkerServer("exp", "trial", "actor", 0, TOKEN, "127.0.0.1", str(tmp_path))
    recorder = Recorder(server.app)
    try:
        with serve_in_thread(recorder) as url:
            client = RPCClient(url.removeprefix("http://"), token=TOKEN, worker_id="actor/0")
            run_sync(client.health())
            run_sync(client.alloc_ports(2))
            run_sync(client.set_env({"AREAL_TEST_AUTH_FLAG": "1"}))
            run_sync(client.configure({"seed": 3}, role="actor", rank=0))
            name = run_sync(client.create_engine(f"{FAKES}.EchoEngine", "echo"))
            assert run_sync(client.call_engine("echo", 1, engine_name=name))["args"] == (1,)
            big = "z" * 2_000_000  # hashed off the event loop on both ends
            assert run_sync(client.call_engine("echo", big, engine_name=name))["args"] == (big,)
            child = run_sync(
                client.fork("helper", 0, [sys.executable, "-c", "import time; time.sleep(30)"])
            )
            assert child["pid"] > 0
            run_sync(client.kill_forked_worker("helper", 0))
            run_sync(client.call_engine("destroy", engine_name=name))
    finally:
        server.shutdown()
    assert len(recorder.requests) == 10
    assert_token_never_sent(recorder.requests, TOKEN)
    assert len({h["x-areal-nonce"] for h, _ in recorder.requests}) == 10


# --- the client acts only on answers it can verify ---


class Unsigned:
    """Passes a peer's answers on without their signature header."""

    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, scope, receive, send):
        async def strip(message):
            if message["type"] == "http.response.start":
                kept = [(k, v) for k, v in message["headers"] if k != b"x-areal-signature"]
                message = {**message, "headers": kept}
            await send(message)

        await self.inner(scope, receive, strip)


@pytest.mark.parametrize("signed_by", ["someone-else", None])
def test_answers_without_a_valid_signature_are_not_acted_on(signed_by):
    peer = ScriptedCallServer([OK], token=signed_by or TOKEN)
    with serve_in_thread(peer if signed_by else Unsigned(peer)) as url:
        client = RPCClient(url.removeprefix("http://"), token=TOKEN, worker_id="w/0")
        with pytest.raises(RPCAuthenticationError, match="did not prove it holds"):
            run_sync(client.call_engine("x", retry_delay=0.01))
        assert peer.calls == 1  # not retried: waiting does not make a stranger a worker
        with pytest.raises(RPCAuthenticationError):
            run_sync(client.health())
        with pytest.raises(RPCAuthenticationError):
            run_sync(client.configure({"seed": 1}, role="actor", rank=0))
