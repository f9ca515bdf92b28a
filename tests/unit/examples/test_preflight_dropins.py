"""The preflight's drop-in names for the reference Arena suite: ``_arena_json`` (one call per
command-style argument list), ``_recent_health``, and the module's ``time`` and ``httpx``
that tools patch. Arena is an ``httpx.MockTransport``; back-off sleeps are recorded."""

from __future__ import annotations

from types import SimpleNamespace

import httpx
import pytest

from examples.swe import arena_preflight
from examples.swe.arena_client import ArenaAPIError
from examples.swe.arena_types import ArenaRewardRefConfig
from tests.conftest import SECRET_SENTINEL

TOKEN = f"tok-{SECRET_SENTINEL}"
BASE = "https://arena.test"
MARKED_403 = "blocked by spanner-http-ant-group-watch-all gateway"


@pytest.fixture(autouse=True)
def env(monkeypatch):
    monkeypatch.setenv("ARENA_OPENAPI_TOKEN", TOKEN)
    monkeypatch.delenv("ARENA_PREFLIGHT_HTTP_TIMEOUT", raising=False)
    monkeypatch.delenv("ARENA_PREFLIGHT_CONNECT_TIMEOUT", raising=False)


@pytest.fixture
def sleeps(monkeypatch) -> list[float]:
    recorded: list[float] = []
    monkeypatch.setattr(arena_preflight.time, "sleep", recorded.append)
    return recorded


class Arena:
    """Answers requests in order (the last answer repeats) and keeps every request."""

    def __init__(self, *answers: httpx.Response | Exception):
        self.answers = list(answers) or [httpx.Response(200, json={"data": {}})]
        self.requests: list[httpx.Request] = []

    def handler(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        answer = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(answer, Exception):
            raise answer
        return httpx.Response(answer.status_code, headers=answer.headers, content=answer.content)

    def client(self) -> httpx.Client:
        return httpx.Client(transport=httpx.MockTransport(self.handler))


def call(arena: Arena, args: list, *, retries: int = 0):
    with arena.client() as client:
        return arena_preflight._arena_json(BASE, args, retries=retries, client=client)


# --- _arena_json: the four commands ---


@pytest.mark.parametrize(
    ("args", "method", "raw_path"),
    [
        (["stream", "get", "stream/a"], "GET", "/openapi/v1/streams/stream%2Fa"),
        (
            ["harness", "version-get", "claude/code", "1.2.4"],
            "GET",
            "/openapi/v1/harnesses/claude%2Fcode/versions/1.2.4",
        ),
        (
            ["stream", "dataset", "stream/a", "--limit", 1],
            "POST",
            "/openapi/v1/streams/stream%2Fa/dataset?limit=1&offset=0",
        ),
        (
            ["stream", "tasks", "stream/a", "--limit", "100", "--offset", "23"],
            "GET",
            "/openapi/v1/streams/stream%2Fa/tasks?limit=100&offset=23",
        ),
    ],
)
def test_each_command_hits_its_endpoint_with_the_bearer_token(args, method, raw_path):
    payload = {"data": {"anything": [1, 2]}}
    arena = Arena(httpx.Response(200, json=payload))
    assert call(arena, args) == payload  # the parsed JSON, unchanged
    (request,) = arena.requests
    assert (request.method, request.url.host, request.url.raw_path.decode()) == (
        method,
        "arena.test",
        raw_path,
    )
    assert request.headers["authorization"] == f"Bearer {TOKEN}"
    assert request.content == b""  # the dataset probe sends its window in the query, no body


def test_base_url_may_already_end_in_the_api_suffix():
    arena = Arena()
    with arena.client() as client:
        arena_preflight._arena_json(
            f"{BASE}/openapi/v1/", ["stream", "get", "s"], retries=0, client=client
        )
    assert arena.requests[0].url.raw_path == b"/openapi/v1/streams/s"


# --- _arena_json: retries through the module's time.sleep ---


@pytest.mark.parametrize(
    "first",
    [
        httpx.Response(429),
        httpx.Response(500),
        httpx.Response(503),
        httpx.Response(403, text=MARKED_403),
        httpx.ConnectError("refused"),
    ],
    ids=["429", "500", "503", "marked-403", "transport-error"],
)
def test_a_transient_answer_is_retried_after_a_sleep(sleeps, first):
    arena = Arena(first, httpx.Response(200, json={"data": {"ok": True}}))
    assert call(arena, ["stream", "get", "s"], retries=1) == {"data": {"ok": True}}
    assert len(arena.requests) == 2 and sleeps == [1.0]


def test_retries_are_extra_attempts_then_the_last_error_is_raised(sleeps):
    # retries=2: three calls, with 1 s and 2 s between them; the third answer is reported.
    arena = Arena(httpx.Response(500), httpx.Response(502), httpx.Response(503, text="busy"))
    with pytest.raises(ArenaAPIError, match=r"GET /streams/s returned HTTP 503: busy"):
        call(arena, ["stream", "get", "s"], retries=2)
    assert len(arena.requests) == 3 and sleeps == [1.0, 2.0]


def test_patching_the_module_time_takes_effect(monkeypatch):
    recorded: list[float] = []
    monkeypatch.setattr(arena_preflight, "time", SimpleNamespace(sleep=recorded.append))
    arena = Arena(httpx.Response(429))
    with pytest.raises(ArenaAPIError, match="HTTP 429"):
        call(arena, ["stream", "get", "s"], retries=3)
    assert recorded == [1.0, 2.0, 4.0] and len(arena.requests) == 4


@pytest.mark.parametrize(
    "answer",
    [
        httpx.Response(400),
        httpx.Response(401),
        httpx.Response(403, text="forbidden"),
        httpx.Response(404),
    ],
    ids=["400", "401", "plain-403", "404"],
)
def test_a_non_retryable_status_is_raised_at_once(sleeps, answer):
    arena = Arena(answer)
    with pytest.raises(ArenaAPIError) as info:
        call(arena, ["harness", "version-get", "claude", "1"], retries=3)
    assert f"GET /harnesses/claude/versions/1 returned HTTP {answer.status_code}" in str(info.value)
    assert len(arena.requests) == 1 and sleeps == []


# --- _arena_json: the token never shows ---


def test_the_token_is_absent_from_error_text(sleeps):
    arena = Arena(httpx.Response(401, text=f"bad token {TOKEN}"))
    with pytest.raises(ArenaAPIError, match="HTTP 401") as info:
        call(arena, ["stream", "get", "s"])
    assert SECRET_SENTINEL not in str(info.value) and "<redacted>" in str(info.value)

    arena = Arena(httpx.ConnectTimeout(f"while sending {TOKEN}"))
    with pytest.raises(ArenaAPIError, match=r"failed after 2 attempts \(ConnectTimeout\)") as info:
        call(arena, ["stream", "get", "s"], retries=1)
    assert SECRET_SENTINEL not in str(info.value)


@pytest.mark.parametrize(
    ("token", "message"),
    [("", "ARENA_OPENAPI_TOKEN is required"), (" <redacted> ", "printed form of a secret")],
)
def test_a_missing_or_printed_token_is_refused_before_any_request(monkeypatch, token, message):
    monkeypatch.setenv("ARENA_OPENAPI_TOKEN", token)
    arena = Arena()
    with pytest.raises(ArenaAPIError, match=message):
        call(arena, ["stream", "get", "s"])
    assert arena.requests == []


# --- _arena_json: its own client ---


def test_without_a_client_one_is_opened_through_the_module_httpx_and_closed(monkeypatch):
    monkeypatch.setenv("ARENA_PREFLIGHT_HTTP_TIMEOUT", "30")
    arena = Arena(httpx.Response(200, json={"data": {"total": 4}}))
    real_client = httpx.Client
    opened: list[tuple[dict, httpx.Client]] = []

    def client_factory(**kwargs) -> httpx.Client:
        client = real_client(transport=httpx.MockTransport(arena.handler), **kwargs)
        opened.append((kwargs, client))
        return client

    monkeypatch.setattr(arena_preflight.httpx, "Client", client_factory)
    payload = arena_preflight._arena_json(BASE, ["stream", "dataset", "s", "--limit", 1], retries=0)

    assert payload == {"data": {"total": 4}} and len(arena.requests) == 1
    ((kwargs, client),) = opened
    assert client.is_closed
    assert kwargs["trust_env"] is False  # environment proxies ignored
    assert kwargs["timeout"] == httpx.Timeout(30.0, connect=10.0)


def test_a_given_client_is_used_and_left_open():
    arena = Arena()
    with arena.client() as client:
        arena_preflight._arena_json(BASE, ["stream", "get", "s"], retries=0, client=client)
        assert not client.is_closed and len(arena.requests) == 1


@pytest.mark.parametrize(
    "args",
    [
        ["task", "launch", "s"],
        ["stream", "get"],
        ["stream", "get", "s", "extra"],
        ["stream", "get", ""],  # GET /streams/ would list every Stream
        ["stream", "dataset", "s"],
        ["stream", "dataset", "s", "--limit", "many"],
        ["stream", "tasks", "s", "--limit", "10"],
        ["stream", "tasks", "s", "--offset", "0", "--limit", "10"],
        ["stream", "tasks", "s", "--limit", "10", "--offset", "-1"],
    ],
)
def test_an_unknown_command_is_refused_naming_the_accepted_forms(args):
    arena = Arena()
    with pytest.raises(ValueError, match="unknown Arena command") as info:
        call(arena, args)
    for form in arena_preflight.ARENA_COMMANDS:
        assert form in str(info.value)
    assert arena.requests == []


# --- validate_streams goes through the module's _arena_json ---

STREAMS = (
    "- {name: a, stream_id: stream/a, harness: claude@1, "
    "expected_reward_ref: {key: reward-a, version: '1'}}\n"
)
REWARD = {"key": "reward-a", "version": "1"}
TASK = {"status": "DONE", "harness_ref": {"key": "claude", "version": "1"}, "reward_ref": REWARD}


def fake_arena_json(calls: list):
    answers = {
        "get": {
            "data": {
                "stream": {
                    "stream_id": "stream/a",
                    "status": "ACTIVE",
                    "default_reward_ref": REWARD,
                }
            }
        },
        "version-get": {"data": {"status": "PUBLISHED"}},
        "dataset": {"data": {"total": 7}},
        "tasks": {"data": [TASK, TASK]},
    }

    def _arena_json(base_url, args, *, retries, client=None):
        calls.append((base_url, [str(a) for a in args], retries, client))
        return answers[args[1]]

    return _arena_json


def test_validate_streams_calls_through_a_patched_arena_json_with_its_client(monkeypatch, tmp_path):
    calls: list = []
    monkeypatch.setattr(arena_preflight, "_arena_json", fake_arena_json(calls))
    path = tmp_path / "streams.yaml"
    path.write_text(STREAMS)

    (record,) = arena_preflight.validate_streams(
        str(path), base_url=BASE, retries=2, recent_tasks=50
    )

    assert [args for _, args, _, _ in calls] == [
        ["stream", "get", "stream/a"],
        ["harness", "version-get", "claude", "1"],
        ["stream", "dataset", "stream/a", "--limit", "1"],
        ["stream", "tasks", "stream/a", "--limit", "50", "--offset", "0"],
    ]
    assert {base for base, _, _, _ in calls} == {f"{BASE}/openapi/v1"}
    assert {retries for _, _, retries, _ in calls} == {2}
    (client,) = {client for _, _, _, client in calls}  # one client shared by every call
    assert isinstance(client, httpx.Client)
    assert client.is_closed  # validate_streams opened it, so it closed it
    assert (record["dataset_total"], record["recent_terminal_tasks"]) == (7, 2)


def test_validate_streams_counts_health_through_the_module_recent_health(monkeypatch, tmp_path):
    monkeypatch.setattr(arena_preflight, "_arena_json", fake_arena_json([]))
    seen: list = []

    def _recent_health(rows, *, harness, reward_ref):
        seen.append((rows, harness, reward_ref))
        return 5, 1

    monkeypatch.setattr(arena_preflight, "_recent_health", _recent_health)
    path = tmp_path / "streams.yaml"
    path.write_text(STREAMS)

    (record,) = arena_preflight.validate_streams(str(path), base_url=BASE)

    assert seen == [([TASK, TASK], ("claude", "1"), ("reward-a", "1"))]
    # failure rate 1 / 5 = 0.2
    assert (record["recent_terminal_tasks"], record["recent_failures"]) == (5, 1)
    assert record["recent_failure_rate"] == 0.2


# --- _recent_health ---


def task(status, harness=("claude", "1"), reward=("reward-a", "1")) -> dict:
    row: dict = {"status": status}
    if harness:
        row["harness_ref"] = {"key": harness[0], "version": harness[1]}
    if reward:
        row["reward_ref"] = {"key": reward[0], "version": reward[1]}
    return row


ROWS = [
    task("DONE"),  # terminal
    task("FAILED"),  # terminal, failure
    {"task": task("OK")},  # wrapped: terminal
    task("RUNNING"),  # not yet terminal: not counted
    task("DONE", harness=("claude", "2")),  # another Harness version: ignored
    task("FAILED", harness=("codex", "1")),  # another Harness: ignored
    task("DONE", reward=("reward-a", "2")),  # another grader version: ignored
    task("FAILED", reward=("reward-b", "1")),  # another grader: ignored
    task("DONE", harness=None),  # no Harness provenance: ignored
    task("FAILED", reward=None),  # no reward provenance: ignored
    "junk",  # not an object: ignored
]


@pytest.mark.parametrize(
    ("harness", "reward_ref"),
    [
        ("claude@1", "reward-a@1"),
        ({"key": "claude", "version": "1"}, {"key": "reward-a", "version": "1"}),
        (("claude", "1"), ArenaRewardRefConfig(key="reward-a", version="1")),
    ],
    ids=["strings", "mappings", "pair-and-config"],
)
def test_recent_health_counts_only_exact_harness_and_reward_provenance(harness, reward_ref):
    # Counted: DONE, FAILED, wrapped OK -> 3 terminal, 1 failure.
    assert arena_preflight._recent_health(ROWS, harness=harness, reward_ref=reward_ref) == (3, 1)


@pytest.mark.parametrize("reward_ref", [None, "", ("", "")])
def test_recent_health_without_a_grader_leaves_reward_provenance_unchecked(reward_ref):
    # Adds the two other-grader rows and the one without reward_ref to the 3 exact ones:
    # DONE, FAILED, OK, DONE (reward-a@2), FAILED (reward-b), FAILED (none) -> 6 terminal,
    # 3 failures.
    counts = arena_preflight._recent_health(ROWS, harness="claude@1", reward_ref=reward_ref)
    assert counts == (6, 3)


def test_recent_health_of_nothing_and_of_a_bad_harness():
    assert arena_preflight._recent_health([], harness="claude@1", reward_ref="reward-a@1") == (0, 0)
    with pytest.raises(TypeError, match="harness must be key@version"):
        arena_preflight._recent_health(ROWS, harness=42, reward_ref="reward-a@1")
