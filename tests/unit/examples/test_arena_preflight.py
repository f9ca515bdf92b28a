"""Preflight library and CLI (README_arena.md#checking-streams-before-you-submit; cases 1-20)."""

from __future__ import annotations

import base64
import json
import threading
from types import SimpleNamespace

import httpx
import pytest

from examples.swe import arena_preflight
from examples.swe.arena_client import ArenaAPIError
from examples.swe.arena_preflight import (
    PreflightHTTP,
    main,
    normalize_api_base,
    recent_health,
    validate_streams,
)
from tests.conftest import SECRET_SENTINEL
from tests.fakes.live_server import ScriptedASGI, serve
from tests.fakes.scripted_http import ScriptedHTTP, reply

TOKEN = f"tok-{SECRET_SENTINEL}"
API = "/openapi/v1"


@pytest.fixture(autouse=True)
def env(monkeypatch):
    monkeypatch.setenv("ARENA_OPENAPI_TOKEN", TOKEN)
    for name in (
        "ARENA_PREFLIGHT_HTTP_TIMEOUT",
        "ARENA_PREFLIGHT_CONNECT_TIMEOUT",
        "ARENA_LLM_API_KEY",
        "ARENA_LLM_BASE_URL",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def http() -> ScriptedHTTP:
    return ScriptedHTTP()


@pytest.fixture(autouse=True)
def sleeps(monkeypatch) -> list[float]:
    """The preflight's back-off sleeps, recorded instead of slept (its module's ``time`` is
    replaced, so the live server's thread keeps the real one)."""
    recorded: list[float] = []
    monkeypatch.setattr(arena_preflight, "time", SimpleNamespace(sleep=recorded.append))
    return recorded


def task(status: str, harness=("claude", "1"), reward=("reward-a", "1"), wrap=True) -> dict:
    body = {"status": status}
    if harness:
        body["harness_ref"] = {"key": harness[0], "version": harness[1]}
    if reward:
        body["reward_ref"] = {"key": reward[0], "version": reward[1]}
    return {"task": body} if wrap else body


def expecting_query(expected: dict[str, str], payload: dict):
    """A reply that is only given to a request with exactly the ``expected`` query."""

    def answer(request: httpx.Request) -> httpx.Response:
        params = dict(request.url.params)
        if params != expected:
            return httpx.Response(400, json={"error": f"query {params}, expected {expected}"})
        return httpx.Response(200, json=payload)

    return answer


def arena(
    http: ScriptedHTTP,
    stream_id: str = "stream-a",
    *,
    status: str | None = "ACTIVE",
    reward=("reward-a", "1"),
    harness=("claude", "1"),
    harness_status="PUBLISHED",
    default_harness=None,
    total=10,
    tasks=None,
    recent_tasks: int = 100,
) -> None:
    """Serve one Stream; each route answers only the query the preflight must send."""
    sid = stream_id.replace("/", "%2F")
    stream = {"stream_id": stream_id}
    if status is not None:
        stream["status"] = status
    if reward is not None:
        stream["default_reward_ref"] = {"key": reward[0], "version": reward[1]}
    if default_harness is not None:
        stream["default_harness_ref"] = {"key": default_harness[0], "version": default_harness[1]}
    http.on("GET", f"{API}/streams/{sid}", expecting_query({}, {"data": {"stream": stream}}))
    key, version = (k.replace("/", "%2F") for k in harness)
    http.on(
        "GET",
        f"{API}/harnesses/{key}/versions/{version}",
        expecting_query({}, {"data": {"status": harness_status}}),
    )
    http.on(
        "POST",
        f"{API}/streams/{sid}/dataset",
        expecting_query({"limit": "1", "offset": "0"}, {"data": {"total": total}}),
    )
    rows = [task("DONE", harness=harness, reward=reward)] if tasks is None else tasks
    http.on(
        "GET",
        f"{API}/streams/{sid}/tasks",
        expecting_query({"limit": str(recent_tasks), "offset": "0"}, {"data": rows}),
    )


def streams_file(tmp_path, text: str):
    path = tmp_path / "streams.yaml"
    path.write_text(text)
    return str(path)


ONE_STREAM = """\
streams:
  - name: astra
    stream_id: stream-a
    harness: claude@1
    task_envs: {PRIVATE_VALUE: hidden}
    expected_reward_ref: {key: reward-a, version: "1"}
"""


def run(http: ScriptedHTTP, *, retries: int = 3, **kwargs):
    client = PreflightHTTP("https://arena.test", retries=retries, transport=http.transport)
    kwargs.setdefault("base_url", "https://arena.test")
    return validate_streams(http=client, retries=retries, **kwargs)


# --- case 12: the happy path ---


def test_happy_path_summary(http, tmp_path):
    arena(http)
    (record,) = run(http, streams_file=streams_file(tmp_path, ONE_STREAM))
    assert record == {
        "name": "astra",
        "stream_id": "stream-a",
        "sampling_weight": 1.0,
        "harness": "claude@1",
        "llm_protocol": "anthropic",
        "task_envs": ["PRIVATE_VALUE"],
        "expected_reward_ref": {"key": "reward-a", "version": "1"},
        "reward_threshold": None,
        "reward_transform_fn": "",
        "dataset_total": 10,
        "recent_terminal_tasks": 1,
        "recent_failures": 0,
        "recent_failure_rate": 0.0,
        "unhealthy_override": False,
    }
    assert "hidden" not in json.dumps(record)


# --- case 7 and 8: operations and the API base ---


def test_operation_mapping(http):
    client = PreflightHTTP("https://arena.test", transport=http.transport)
    for command in [
        ["stream", "get", "stream/a"],
        ["harness", "version-get", "claude/code", "1.2.4"],
        ["stream", "dataset", "stream/a", "--limit", 1],
        ["stream", "tasks", "stream/a", "--limit", 100, "--offset", 23],
    ]:
        with pytest.raises(ArenaAPIError):  # the scripted peer answers 404
            client.data(command)
    assert [(r.method, r.raw_path) for r in http.requests] == [
        ("GET", f"{API}/streams/stream%2Fa"),
        ("GET", f"{API}/harnesses/claude%2Fcode/versions/1.2.4"),
        ("POST", f"{API}/streams/stream%2Fa/dataset"),
        ("GET", f"{API}/streams/stream%2Fa/tasks"),
    ]
    assert [r.params for r in http.requests] == [
        {},
        {},
        {"limit": "1", "offset": "0"},
        {"limit": "100", "offset": "23"},
    ]
    assert {r.headers["authorization"] for r in http.requests} == {f"Bearer {TOKEN}"}
    assert all(r.body == b"" for r in http.requests)
    with pytest.raises(ValueError, match="unknown Arena command"):
        client.data(["task", "launch", "x"])


@pytest.mark.parametrize(
    "base", ["https://x", "https://x/", "https://x/openapi/v1/", "https://x/openapi/v1"]
)
def test_api_base_normalization(base):
    assert normalize_api_base(base) == "https://x/openapi/v1"


def test_stream_path_segments_are_encoded_end_to_end(http, tmp_path):
    arena(http, "stream/a", harness=("claude/code", "1.2.4"))
    path = streams_file(tmp_path, "- {name: a, stream_id: stream/a, harness: claude/code@1.2.4}\n")
    (record,) = run(http, streams_file=path)
    assert record["harness"] == "claude/code@1.2.4"


# --- cases 9-11: retries, transport errors, the token ---


def test_spanner_403_is_retried(http, sleeps, tmp_path):
    arena(http)
    http.routes[("GET", f"{API}/streams/stream-a")].appendleft(
        reply(403, text="blocked by spanner-http-ant-group-watch-all gateway")
    )
    run(http, retries=1, streams_file=streams_file(tmp_path, ONE_STREAM))
    assert len(http.calls("GET", f"{API}/streams/stream-a")) == 2 and sleeps == [1.0]


def test_plain_403_is_not_retried(http, sleeps, tmp_path):
    http.on("GET", f"{API}/streams/stream-a", reply(403, text="forbidden"))
    with pytest.raises(ArenaAPIError, match="returned HTTP 403"):
        run(http, streams_file=streams_file(tmp_path, ONE_STREAM))
    assert len(http.requests) == 1 and sleeps == []


@pytest.mark.parametrize("status", [429, 500, 503])
def test_retryable_statuses_exhaust(http, sleeps, tmp_path, status):
    http.on("GET", f"{API}/streams/stream-a", reply(status))
    with pytest.raises(ArenaAPIError, match=f"returned HTTP {status}"):
        run(http, streams_file=streams_file(tmp_path, ONE_STREAM))
    assert len(http.requests) == 4 and sleeps == [1.0, 2.0, 4.0]


def test_zero_retries_and_backoff_cap(http, sleeps, tmp_path):
    http.on("GET", f"{API}/streams/stream-a", reply(502))
    with pytest.raises(ArenaAPIError):
        run(http, retries=0, streams_file=streams_file(tmp_path, ONE_STREAM))
    assert len(http.requests) == 1
    with pytest.raises(ArenaAPIError):
        run(http, retries=6, streams_file=streams_file(tmp_path, ONE_STREAM))
    assert sleeps == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_transport_errors_name_the_type_only(http, tmp_path):
    http.on("GET", f"{API}/streams/stream-a", httpx.ConnectTimeout(f"to {TOKEN}"))
    with pytest.raises(ArenaAPIError) as info:
        run(http, retries=2, streams_file=streams_file(tmp_path, ONE_STREAM))
    assert "request failed after 3 attempts (ConnectTimeout)" in str(info.value)
    assert SECRET_SENTINEL not in str(info.value)


def test_missing_token_fails_before_any_request(http, tmp_path, monkeypatch):
    monkeypatch.delenv("ARENA_OPENAPI_TOKEN")
    with pytest.raises(ArenaAPIError, match="ARENA_OPENAPI_TOKEN is required"):
        run(http, streams_file=streams_file(tmp_path, ONE_STREAM))
    assert http.requests == []


def test_timeouts_are_parsed_first(monkeypatch, tmp_path):
    monkeypatch.setenv("ARENA_PREFLIGHT_HTTP_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="ARENA_PREFLIGHT_HTTP_TIMEOUT"):
        validate_streams(streams_file=streams_file(tmp_path, ONE_STREAM), base_url="x", retries=-1)


# --- case 6: parameter checks ---


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"retries": -1}, "retries"),
        ({"recent_tasks": 0}, "recent_tasks"),
        ({"min_terminal_tasks": -1}, "min_terminal_tasks"),
        ({"max_failure_rate": 1.5}, "max_failure_rate"),
        ({"max_failure_rate": -0.1}, "max_failure_rate"),
    ],
)
def test_parameter_checks_come_first(http, tmp_path, kwargs, message):
    with pytest.raises(ValueError, match=message):
        run(http, streams_file=str(tmp_path / "missing.yaml"), **kwargs)
    assert http.requests == []


# --- case 13: failures in check order ---


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ({"stream_id": "stream-b"}, "returned Stream 'stream-b'"),
        ({"status": "PAUSED"}, "is not ACTIVE"),
        ({"status": None}, "is not ACTIVE"),
        ({"reward": ("reward-a", "2")}, r"reward_ref drifted: expected reward-a@1, got reward-a@2"),
        ({"reward": ("reward-b", "1")}, "reward_ref drifted"),
        ({"harness_status": "DRAFT"}, r"Harness claude@1 is not PUBLISHED"),
        ({"total": 0}, "at least one row"),
        ({"total": None}, "at least one row"),
        ({"total": True}, "at least one row"),
    ],
)
def test_check_failures(http, tmp_path, setup, message):
    served_id = setup.pop("stream_id", "stream-a")
    arena(http, served_id, **setup)
    if served_id != "stream-a":
        http.on(
            "GET",
            f"{API}/streams/stream-a",
            reply(200, {"stream_id": served_id, "status": "ACTIVE"}),
        )
    with pytest.raises(ArenaAPIError, match=message):
        run(http, streams_file=streams_file(tmp_path, ONE_STREAM))


# Every check of one Stream, in the order the preflight must run them (its module docstring),
# error of each and the requests sent up to and including it.
CHECKS = [
    ("stream_id", "returned Stream 'stream-b'", 1),
    ("status", "is not ACTIVE", 1),
    ("reward_ref_shape", "default_reward_ref is incomplete", 1),
    ("reward_ref_drift", "reward_ref drifted", 1),
    ("harness", "requires Harness key@version", 1),
    ("harness_status", "is not PUBLISHED", 2),
    ("dataset", "at least one row", 3),
    ("health", "failed health check", 4),
]
PINNED_NO_HARNESS = (
    "- {name: a, stream_id: stream-a, expected_reward_ref: {key: reward-a, version: '1'}}\n"
)


def arena_failing_checks_from(http: ScriptedHTTP, first_broken: int) -> None:
    """Stream a with every check from ``CHECKS[first_broken]`` on broken, the earlier ones
    passing (the config names no Harness, so the Stream's default Harness is the check)."""

    def ok(check: str) -> bool:
        return [name for name, _, _ in CHECKS].index(check) < first_broken

    if not ok("reward_ref_shape"):
        reward_ref = {"key": "reward-a"}
    elif not ok("reward_ref_drift"):
        reward_ref = {"key": "reward-a", "version": "2"}
    else:
        reward_ref = {"key": "reward-a", "version": "1"}
    stream = {
        "stream_id": "stream-a" if ok("stream_id") else "stream-b",
        "status": "ACTIVE" if ok("status") else "PAUSED",
        "default_reward_ref": reward_ref,
    }
    if ok("harness"):
        stream["default_harness_ref"] = {"key": "claude", "version": "1"}
    http.on("GET", f"{API}/streams/stream-a", reply(200, {"data": {"stream": stream}}))
    status = "PUBLISHED" if ok("harness_status") else "DRAFT"
    http.on("GET", f"{API}/harnesses/claude/versions/1", reply(200, {"data": {"status": status}}))
    total = 10 if ok("dataset") else 0
    http.on("POST", f"{API}/streams/stream-a/dataset", reply(200, {"data": {"total": total}}))
    rows = [task("DONE" if ok("health") else "FAILED")]
    http.on("GET", f"{API}/streams/stream-a/tasks", reply(200, {"data": rows}))


@pytest.mark.parametrize(
    ("first_broken", "check", "message", "requests"),
    [(i, *check) for i, check in enumerate(CHECKS)],
    ids=[name for name, _, _ in CHECKS],
)
def test_checks_run_in_order(http, tmp_path, first_broken, check, message, requests):
    # case 13: with this check and every later one broken, this one is reported, and no
    # request of a later check is sent.
    arena_failing_checks_from(http, first_broken)
    with pytest.raises(ArenaAPIError, match=message):
        run(http, streams_file=streams_file(tmp_path, PINNED_NO_HARNESS))
    order = [
        ("GET", f"{API}/streams/stream-a"),
        ("GET", f"{API}/harnesses/claude/versions/1"),
        ("POST", f"{API}/streams/stream-a/dataset"),
        ("GET", f"{API}/streams/stream-a/tasks"),
    ]
    assert [(r.method, r.raw_path) for r in http.requests] == order[:requests]


def test_checks_in_order_all_pass_when_nothing_is_broken(http, tmp_path):
    arena_failing_checks_from(http, len(CHECKS))
    (record,) = run(http, streams_file=streams_file(tmp_path, PINNED_NO_HARNESS))
    assert record["harness"] == "claude@1" and len(http.requests) == 4


def test_recent_task_window_is_the_requested_size_from_offset_0(http, tmp_path):
    # case 7: the health window is limit=recent_tasks, offset=0 (the fake answers nothing else).
    arena(http, recent_tasks=7)
    (record,) = run(http, streams_file=streams_file(tmp_path, ONE_STREAM), recent_tasks=7)
    assert record["recent_terminal_tasks"] == 1
    (tasks,) = http.calls("GET", f"{API}/streams/stream-a/tasks")
    assert tasks.params == {"limit": "7", "offset": "0"}
    (probe,) = http.calls("POST", f"{API}/streams/stream-a/dataset")
    assert probe.params == {"limit": "1", "offset": "0"}


@pytest.mark.parametrize("ref", ["reward-a@1", {"key": "reward-a"}, {"key": "", "version": "1"}])
def test_malformed_default_reward_ref(http, tmp_path, ref):
    arena(http)
    http.routes[("GET", f"{API}/streams/stream-a")].clear()
    http.on(
        "GET",
        f"{API}/streams/stream-a",
        reply(200, {"stream_id": "stream-a", "status": "ACTIVE", "default_reward_ref": ref}),
    )
    with pytest.raises(ArenaAPIError, match=r"must be an object|incomplete"):
        run(http, streams_file=streams_file(tmp_path, ONE_STREAM))


def test_missing_stream_object(http, tmp_path):
    http.on("GET", f"{API}/streams/stream-a", reply(200, {"data": ["not", "a", "stream"]}))
    with pytest.raises(ArenaAPIError, match="missing the Stream object"):
        run(http, streams_file=streams_file(tmp_path, ONE_STREAM))


def test_no_harness_available(http, tmp_path):
    arena(http)
    path = streams_file(tmp_path, "- {name: a, stream_id: stream-a}\n")
    with pytest.raises(ArenaAPIError, match="requires Harness key@version"):
        run(http, streams_file=path)
    with pytest.raises(ArenaAPIError, match="requires Harness key@version"):
        run(
            http,
            streams_file=streams_file(
                tmp_path, "- {name: a, stream_id: stream-a, harness: claude}\n"
            ),
        )


# --- cases 14-18: health and Harness resolution ---


def test_health_counts_only_exact_provenance():  # case 14
    rows = [task("DONE", harness=None, reward=None), task("DONE", reward=None), task("FAILED")]
    assert recent_health(rows, ("claude", "1"), ("reward-a", "1")) == (1, 1, 1.0)


def test_health_payload_shapes():  # case 15
    rows = [task("done", wrap=False), task("HARNESS_FAILED"), "junk", task("RUNNING"), task("OK")]
    expected = (3, 1, 1 / 3)
    assert recent_health(rows, ("claude", "1"), ("reward-a", "1")) == expected
    assert recent_health({"items": rows}, ("claude", "1"), ("reward-a", "1")) == expected
    assert recent_health({"other": rows}, ("claude", "1"), ("reward-a", "1")) == (0, 0, 0.0)
    assert recent_health("junk", ("claude", "1"), ("reward-a", "1")) == (0, 0, 0.0)


def test_health_thresholds(http, tmp_path):  # case 16
    arena(http, tasks=[])
    path = streams_file(tmp_path, ONE_STREAM)
    with pytest.raises(
        ArenaAPIError, match=r"failed health check.*terminal=0, failures=0, failure_rate=0\.0000"
    ):
        run(http, streams_file=path)
    assert run(http, streams_file=path, min_terminal_tasks=0)[0]["unhealthy_override"] is False

    http2 = ScriptedHTTP()
    arena(http2, tasks=[task("DONE"), task("FAILED"), task("TIMEOUT"), task("OK"), task("DONE")])
    with pytest.raises(ArenaAPIError, match=r"failure_rate=0\.4000"):
        run(http2, streams_file=path, max_failure_rate=0.4)  # equal to the bound fails
    assert run(http2, streams_file=path, max_failure_rate=0.41)[0]["recent_failure_rate"] == 0.4
    (record,) = run(http2, streams_file=path, max_failure_rate=0.4, allow_unhealthy=True)
    assert record["unhealthy_override"] is True


def test_stream_without_reward_ref(http, tmp_path):  # case 17
    arena(http, reward=None, tasks=[task("DONE", reward=None), task("DONE", reward=("x", "9"))])
    path = streams_file(tmp_path, "- {name: a, stream_id: stream-a, harness: claude@1}\n")
    (record,) = run(http, streams_file=path)
    assert record["expected_reward_ref"] == {"key": "", "version": ""}
    assert record["recent_terminal_tasks"] == 2  # reward provenance ignored


def test_harness_resolution(http, tmp_path):  # case 18
    arena(
        http,
        harness=("codex", "2"),
        default_harness=("claude", "1"),
        tasks=[task("DONE", harness=("codex", "2"))],
    )
    (r,) = run(
        http,
        streams_file=streams_file(tmp_path, "- {name: a, stream_id: stream-a}\n"),
        default_harness="codex@2",
    )
    assert (r["harness"], r["llm_protocol"]) == ("codex@2", "responses")
    http3 = ScriptedHTTP()
    arena(http3, harness=("claude", "1"), default_harness=("claude", "1"))
    (r,) = run(http3, streams_file=streams_file(tmp_path, "- {name: a, stream_id: stream-a}\n"))
    assert r["harness"] == "claude@1"
    (r,) = run(
        http3,
        streams_file=streams_file(
            tmp_path, "- {name: a, stream_id: stream-a, harness: claude@1}\n"
        ),
        default_harness="codex@2",
    )
    assert r["harness"] == "claude@1"  # the Stream's own Harness wins


def test_configured_protocol_wins(http, tmp_path):
    arena(http)
    path = streams_file(
        tmp_path,
        "- {name: a, stream_id: stream-a, harness: claude@1, llm_protocol: chat_completions}\n",
    )
    assert run(http, streams_file=path)[0]["llm_protocol"] == "chat_completions"


# --- case 19: several Streams, one after another, in order ---

TWO_STREAMS = (
    "- {name: a, stream_id: stream-a, harness: claude@1}\n"
    "- {name: b, stream_id: stream-b, harness: claude@1}\n"
)


def watch_stream_b(http: ScriptedHTTP) -> threading.Event:
    """An event set when anything about stream-b is requested."""
    seen = threading.Event()
    answer = http.routes[("GET", f"{API}/streams/stream-b")].popleft()

    def stream_b(request: httpx.Request) -> httpx.Response:
        seen.set()
        return answer(request)

    http.on("GET", f"{API}/streams/stream-b", stream_b)
    return seen


def delay_stream_a(http: ScriptedHTTP, b_seen: threading.Event, overlapped: list[bool]) -> None:
    """Stream a's lookup waits up to 0.3 s for a request about stream b (a concurrent check
    would send one) and records whether it came."""
    answer = http.routes[("GET", f"{API}/streams/stream-a")].popleft()

    def stream_a(request: httpx.Request) -> httpx.Response:
        overlapped.append(b_seen.wait(0.3))
        return answer(request)

    http.on("GET", f"{API}/streams/stream-a", stream_a)


def test_streams_are_checked_one_after_another_in_order(http, tmp_path):
    arena(http, "stream-a")
    arena(http, "stream-b")
    overlapped: list[bool] = []
    delay_stream_a(http, watch_stream_b(http), overlapped)

    records = run(http, streams_file=streams_file(tmp_path, TWO_STREAMS))

    assert [r["name"] for r in records] == ["a", "b"]
    assert overlapped == [False]  # nothing about b while a was being checked
    harness = ("GET", f"{API}/harnesses/claude/versions/1")
    assert [(r.method, r.raw_path) for r in http.requests] == [
        ("GET", f"{API}/streams/stream-a"),
        harness,
        ("POST", f"{API}/streams/stream-a/dataset"),
        ("GET", f"{API}/streams/stream-a/tasks"),
        ("GET", f"{API}/streams/stream-b"),
        harness,
        ("POST", f"{API}/streams/stream-b/dataset"),
        ("GET", f"{API}/streams/stream-b/tasks"),
    ]


def test_a_failed_stream_ends_the_run_before_later_streams(http, tmp_path):
    arena(http, "stream-a", status="PAUSED")
    arena(http, "stream-b", total=0)
    overlapped: list[bool] = []
    b_seen = watch_stream_b(http)
    delay_stream_a(http, b_seen, overlapped)

    with pytest.raises(ArenaAPIError, match="stream-a' is not ACTIVE"):
        run(http, streams_file=streams_file(tmp_path, TWO_STREAMS))

    assert overlapped == [False] and not b_seen.is_set()
    assert [r.raw_path for r in http.requests] == [f"{API}/streams/stream-a"]


# --- cases 3-5: inputs ---


def test_streams_document_shapes(http, tmp_path):
    arena(http)
    with pytest.raises(ValueError, match="unknown top-level fields: extra"):
        run(http, streams_file=streams_file(tmp_path, ONE_STREAM + "extra: 1\n"))
    with pytest.raises(ValueError, match="non-empty 'streams' list"):
        run(http, streams_file=streams_file(tmp_path, "streams: []\n"))
    assert run(
        http,
        streams_file=streams_file(
            tmp_path, "- {name: a, stream_id: stream-a, harness: claude@1}\n"
        ),
    )
    with pytest.raises(FileNotFoundError):
        run(http, streams_file=str(tmp_path / "absent.yaml"))
    with pytest.raises(ValueError, match="may only contain"):
        run(http, streams_file=streams_file(tmp_path, "- {name: bad/name, stream_id: s}\n"))


def test_invalid_base64_payload(http):
    with pytest.raises(ValueError, match="not valid base64 UTF-8"):
        run(http, streams_yaml_b64="not base64!")
    assert http.requests == []


# --- the CLI (cases 1-3, 19, 20), over real HTTP on loopback ---


@pytest.fixture
def live(http):
    with serve(ScriptedASGI(http)) as url:
        yield url


def cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "args",
    [
        ["--base-url", "x"],
        ["--streams-file", "a", "--streams-env-b64", "B", "--base-url", "x"],
        ["--streams-file", "a"],
        ["--streams-file", "a", "--base-url", "x", "--retries", "many"],
        ["--streams-file", "a", "--base-url", "x", "--max-failure-rate", "high"],
    ],
)
def test_cli_usage_errors_exit_2(args):
    with pytest.raises(SystemExit) as info:
        main(args)
    assert info.value.code == 2


@pytest.mark.parametrize("value", [None, "   "])
def test_cli_empty_env_payload_exits_2(monkeypatch, capsys, value):
    if value is None:
        monkeypatch.delenv("STREAMS_B64", raising=False)
    else:
        monkeypatch.setenv("STREAMS_B64", value)
    with pytest.raises(SystemExit) as info:
        main(["--streams-env-b64", "STREAMS_B64", "--base-url", "x"])
    assert info.value.code == 2
    assert "STREAMS_B64 is empty" in capsys.readouterr().err


def test_cli_env_payload_and_json_format(http, live, monkeypatch, capsys):
    name = "vérifié-流"
    arena(http)
    doc = ONE_STREAM.replace("name: astra", f"name: astra\n    reward_transform_fn: '{name}'")
    monkeypatch.setenv("STREAMS_B64", base64.b64encode(doc.encode()).decode())
    code, out, err = cli(capsys, "--streams-env-b64", "STREAMS_B64", "--base-url", live)
    assert code == 0, err
    assert out.endswith("}\n") and '\n  "streams": [\n' in out
    assert name in out  # non-ASCII kept literally
    assert json.loads(out)["streams"][0]["reward_transform_fn"] == name
    assert "Arena preflight: 1 Stream(s) passed" in err
    for text in (out, err):
        assert "hidden" not in text and SECRET_SENTINEL not in text


def test_cli_failure_prints_nothing_on_stdout(http, live, tmp_path, capsys):
    arena(http, "stream-a")
    arena(http, "stream-b", harness_status="DRAFT")
    path = streams_file(
        tmp_path,
        "- {name: a, stream_id: stream-a, harness: claude@1}\n"
        "- {name: b, stream_id: stream-b, harness: claude@1}\n",
    )
    code, out, err = cli(capsys, "--streams-file", path, "--base-url", live)
    assert (code, out) == (1, "")
    assert "is not PUBLISHED" in err


def test_cli_invalid_base64_exits_1(monkeypatch, capsys):
    monkeypatch.setenv("STREAMS_B64", "***")
    code, out, err = cli(
        capsys, "--streams-env-b64", "STREAMS_B64", "--base-url", "http://127.0.0.1:9"
    )
    assert (code, out) == (1, "") and "not valid base64 UTF-8" in err


def test_cli_secrets_never_printed(http, live, tmp_path, capsys):
    arena(http)
    http.routes[("GET", f"{API}/streams/stream-a")].appendleft(
        reply(401, text=f"bad token {TOKEN}")
    )
    doc = ONE_STREAM.replace("hidden", SECRET_SENTINEL)
    code, out, err = cli(
        capsys, "--streams-file", streams_file(tmp_path, doc), "--base-url", live, "--retries", "0"
    )
    assert code == 1 and "HTTP 401" in err
    assert SECRET_SENTINEL not in out + err
    code, out, err = cli(capsys, "--streams-file", streams_file(tmp_path, doc), "--base-url", live)
    assert code == 0 and SECRET_SENTINEL not in out + err


# --- the LLM gateway probe ---


def test_gateway_probe(http, live, tmp_path, capsys, monkeypatch):
    arena(http)
    path = streams_file(tmp_path, ONE_STREAM)
    monkeypatch.setenv("ARENA_LLM_API_KEY", f"llm-{SECRET_SENTINEL}")
    http.on(
        "GET",
        "/api/v1/models",
        reply(200, {"data": []}),
        reply(401, text="invalid key"),
        reply(404),
    )
    code, out, err = cli(capsys, "--streams-file", path, "--base-url", live, "--probe-llm-gateway")
    assert code == 0 and "LLM gateway key: accepted" in err
    assert (
        http.calls("GET", "/api/v1/models")[0].headers["authorization"]
        == f"Bearer llm-{SECRET_SENTINEL}"
    )
    code, out, err = cli(capsys, "--streams-file", path, "--base-url", live, "--probe-llm-gateway")
    assert (code, out) == (1, "") and "rejected ARENA_LLM_API_KEY (HTTP 401)" in err
    code, out, err = cli(capsys, "--streams-file", path, "--base-url", live, "--probe-llm-gateway")
    assert code == 0 and "inconclusive (HTTP 404)" in err
    assert SECRET_SENTINEL not in out + err
    monkeypatch.delenv("ARENA_LLM_API_KEY")
    code, out, err = cli(capsys, "--streams-file", path, "--base-url", live, "--probe-llm-gateway")
    assert code == 1 and "ARENA_LLM_API_KEY is required" in err
