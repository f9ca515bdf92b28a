"""ArenaOpenAPIClient against a scripted HTTP peer (README_arena.md#the-arena-client;
cases C/D/R/T)."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import pytest

from examples.swe.arena_client import (
    ArenaAPIError,
    ArenaOpenAPIClient,
    ArenaTaskFailedError,
    infer_llm_protocol,
    infer_llm_protocol_from_harness,
    resolve_arena_credentials,
    resolve_llm_protocol,
)
from tests.conftest import SECRET_SENTINEL
from tests.fakes.scripted_http import ScriptedHTTP, reply

BASE = "https://arena.test"
TOKEN = f"tok-{SECRET_SENTINEL}"
LLM_KEY = f"llm-{SECRET_SENTINEL}"
STREAMS = "/openapi/v1/streams"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in (
        "ARENA_OPENAPI_BASE",
        "ARENA_OPENAPI_TOKEN",
        "ARENA_LLM_API_KEY",
        "ARENA_LLM_BASE_URL",
    ):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def http() -> ScriptedHTTP:
    return ScriptedHTTP()


@pytest.fixture
def sleeps() -> list[float]:
    return []


@pytest.fixture
def make_client(http, sleeps):
    async def async_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    def make(**kwargs) -> ArenaOpenAPIClient:
        kwargs.setdefault("request_retries", 3)
        kwargs.setdefault("poll_interval", 0.5)
        return ArenaOpenAPIClient(
            base_url=kwargs.pop("base_url", BASE),
            api_token=TOKEN,
            transport=http.transport,
            async_transport=http.transport,
            sleep=sleeps.append,
            async_sleep=async_sleep,
            **kwargs,
        )

    return make


def count_instances(monkeypatch, cls: type) -> list:
    """Record every ``cls`` instance created from now on (HTTP clients here)."""
    created: list = []
    real_init = cls.__init__

    def counting_init(self, *args, **kwargs):
        created.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(cls, "__init__", counting_init)
    return created


def stream(stream_id: str = "stream-a", **extra) -> dict:
    return {"stream_id": stream_id, "status": "ACTIVE", **extra}


# --- credentials and protocols ---


def test_credentials_from_arguments_or_environment(monkeypatch):
    assert resolve_arena_credentials("https://x//", "t") == ("https://x", "t")
    monkeypatch.setenv("ARENA_OPENAPI_BASE", "https://env/")
    monkeypatch.setenv("ARENA_OPENAPI_TOKEN", "env-token")
    assert resolve_arena_credentials() == ("https://env", "env-token")


def test_credentials_errors_name_the_settings(monkeypatch):
    with pytest.raises(ValueError, match=r"econfig\.arena_base_url.*ARENA_OPENAPI_BASE"):
        resolve_arena_credentials("", "t")
    with pytest.raises(ValueError, match="ARENA_OPENAPI_TOKEN"):
        resolve_arena_credentials("https://x", "")


def test_protocol_inference():  # C5
    assert infer_llm_protocol_from_harness("Claude-Code-With-Skills@5.0.1") == "anthropic"
    assert infer_llm_protocol_from_harness("openai-codex") == "responses"
    assert infer_llm_protocol_from_harness("swe-agent") == "chat_completions"
    assert infer_llm_protocol({"default_harness_ref": {"key": "claude-code"}}) == "anthropic"
    assert infer_llm_protocol({}) == "chat_completions"
    assert infer_llm_protocol({"default_harness_ref": {"key": 3}}) == "chat_completions"
    claude = {"default_harness_ref": {"key": "claude-code"}}
    assert resolve_llm_protocol(claude, "responses") == "responses"
    assert resolve_llm_protocol(claude) == "anthropic"
    with pytest.raises(ValueError, match="Unsupported Arena LLM protocol override"):
        resolve_llm_protocol(claude, "grpc")


def test_gateway_key_is_only_needed_for_routes(http, make_client):  # C2
    http.on("GET", STREAMS, reply(200, {"items": [stream()]}))
    client = make_client()
    with pytest.raises(ValueError, match="ARENA_LLM_API_KEY"):
        _ = client.llm_gateway_api_key
    assert client.resolve_stream_id() == "stream-a"
    assert make_client(llm_api_key=LLM_KEY).llm_gateway_api_key == LLM_KEY


def test_gateway_base_url_override(monkeypatch, make_client):
    assert make_client().llm_gateway_base_url == f"{BASE}/api"
    monkeypatch.setenv("ARENA_LLM_BASE_URL", "https://gateway.test:8443/v2/")
    assert make_client().llm_gateway_base_url == "https://gateway.test:8443/v2"


@pytest.mark.parametrize(
    "url",
    [
        "ftp://gateway",
        "https://user:pw@gateway",
        "https://gateway?x=1",
        "https://gateway#f",
        "https://gate way",
        "https://gateway:99999",
        "https://",
    ],
)
def test_invalid_gateway_base_url(monkeypatch, make_client, url):
    monkeypatch.setenv("ARENA_LLM_BASE_URL", url)
    with pytest.raises(ValueError, match="ARENA_LLM_BASE_URL"):
        make_client()


def test_non_http_arena_base_fails_at_construction(make_client):
    with pytest.raises(ValueError, match="ARENA_OPENAPI_BASE"):
        make_client(base_url="file:///arena")


# --- Streams ---


def test_first_active_stream(http, make_client):  # C1
    http.on("GET", STREAMS, reply(200, {"items": ["junk", stream("first"), stream("second")]}))
    assert make_client().resolve_stream_id() == "first"
    (seen,) = http.requests
    assert seen.params == {"status": "ACTIVE"}
    assert seen.headers["authorization"] == f"Bearer {TOKEN}"


def test_list_streams_drops_non_objects_and_omits_empty_status(http, make_client):
    http.on("GET", STREAMS, reply(200, {"items": [1, stream("a"), None]}))
    assert make_client().list_streams(status=None) == [stream("a")]
    assert http.requests[0].params == {}


def test_list_and_resolve_errors(http, make_client):
    http.on("GET", STREAMS, reply(200, {"items": []}), reply(200, {"streams": []}))
    client = make_client()
    with pytest.raises(ArenaAPIError, match="no active Streams"):
        client.resolve_stream()
    with pytest.raises(ArenaAPIError, match="missing an 'items' array"):
        client.list_streams()


def test_explicit_stream_is_a_direct_get(http, make_client):  # C3
    body = stream("stream/a", default_harness_ref={"key": "claude-code", "version": "1.0"})
    http.on("GET", f"{STREAMS}/stream%2Fa", reply(200, {"data": {"stream": body}}))
    assert make_client().resolve_stream("stream/a") == body
    (seen,) = http.requests
    assert seen.params == {} and seen.raw_path == f"{STREAMS}/stream%2Fa"


async def test_explicit_stream_async_flat_envelope(http, make_client):  # C3
    http.on("GET", f"{STREAMS}/stream-a", reply(200, stream(default_harness_ref={"key": "codex"})))
    resolved = await make_client().resolve_stream_async("stream-a", timeout=5.0)
    assert resolved["default_harness_ref"] == {"key": "codex"}


def test_direct_get_returning_another_id(http, make_client):  # C4
    http.on("GET", f"{STREAMS}/stream-a", reply(200, stream("stream-b")))
    with pytest.raises(ArenaAPIError, match="returned id"):
        make_client().resolve_stream("stream-a")


def test_direct_get_of_inactive_stream(http, make_client):
    http.on("GET", f"{STREAMS}/stream-a", reply(200, {"stream_id": "stream-a", "status": "PAUSED"}))
    with pytest.raises(ArenaAPIError, match="not ACTIVE"):
        make_client().resolve_stream("stream-a")


def test_stream_without_status_is_accepted(http, make_client):
    http.on("GET", f"{STREAMS}/stream-a", reply(200, {"data": {"stream_id": "stream-a"}}))
    assert make_client().resolve_stream_id("stream-a") == "stream-a"


# --- retries ---


def test_read_timeout_then_success_reuses_one_client(http, make_client, sleeps, monkeypatch):  # C6
    created = count_instances(monkeypatch, httpx.Client)
    http.on("GET", STREAMS, httpx.ReadTimeout("slow"), reply(200, {"items": [stream()]}))
    client = make_client(request_retries=1)
    assert client.list_streams() == [stream()]
    assert len(http.requests) == 2 and sleeps == [1.0]
    client.list_streams()
    assert len(created) == 1  # one pooled client for the retries and the next call


def test_5xx_then_success(http, make_client, sleeps):  # C7
    http.on("GET", STREAMS, reply(504, text="gateway timeout"), reply(200, {"items": []}))
    assert make_client().list_streams() == []
    assert len(http.requests) == 2 and sleeps == [1.0]


def test_spanner_403_is_retried_but_plain_403_is_not(http, make_client, sleeps):  # C8
    marked = reply(403, text="denied: spanner-http-ant-group-watch-all (transient)")
    http.on("GET", STREAMS, marked, reply(200, {"items": []}))
    http.on("GET", f"{STREAMS}/x", reply(403, text="forbidden"))
    client = make_client(request_retries=1)
    assert client.list_streams() == []
    assert len(http.requests) == 2
    with pytest.raises(ArenaAPIError, match="HTTP 403"):
        client.resolve_stream("x")
    assert len(http.calls("GET", f"{STREAMS}/x")) == 1


def test_429_and_5xx_exhaust_into_an_http_error(http, make_client, sleeps):
    http.on("GET", STREAMS, reply(429, text="slow down"))
    with pytest.raises(ArenaAPIError, match="HTTP 429"):
        make_client(request_retries=2).list_streams()
    assert len(http.requests) == 3 and sleeps == [1.0, 2.0]


def test_backoff_is_capped_at_ten_seconds(http, make_client, sleeps):
    http.on("GET", STREAMS, reply(500))
    with pytest.raises(ArenaAPIError, match="HTTP 500"):
        make_client(request_retries=6).list_streams()
    assert sleeps == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]


def test_zero_retries_is_one_attempt(http, make_client, sleeps):
    http.on("GET", STREAMS, reply(503))
    with pytest.raises(ArenaAPIError):
        make_client(request_retries=0).list_streams()
    assert len(http.requests) == 1 and sleeps == []


def test_transport_errors_name_only_the_exception_class(http, make_client, sleeps):
    http.on("GET", STREAMS, httpx.ConnectError(f"cannot connect with {TOKEN}"))
    with pytest.raises(ArenaAPIError) as info:
        make_client(request_retries=2).list_streams()
    message = str(info.value)
    assert "request failed after 3 attempts" in message and "ConnectError" in message
    assert "cannot connect" not in message and SECRET_SENTINEL not in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_marked_302_is_retried_on_a_sync_list(http, make_client, sleeps):  # C9
    waiting = reply(302, headers={"location": "https://gw.test/wait?fromspanner=apigwmoe_502"})
    http.on("GET", STREAMS, waiting)
    with pytest.raises(ArenaAPIError, match="HTTP 302"):
        make_client(request_retries=2).list_streams()
    assert [(r.method, r.raw_path) for r in http.requests] == [("GET", STREAMS)] * 3


async def test_marked_302_on_a_poll_resends_the_same_get(http, make_client, sleeps):  # C9
    waiting = reply(302, headers={"location": "https://gw.test/wait?fromspanner=apigwmoe_502"})
    http.on(
        "POST", f"{STREAMS}/s/launch_one_task", reply(202, {"task_id": "t1", "status": "PENDING"})
    )
    http.on(
        "GET",
        "/openapi/v1/tasks/t1/result",
        waiting,
        reply(200, {"task_id": "t1", "status": "DONE", "score": 1}),
    )
    result = await make_client(request_retries=1).launch_one_task_result(
        "s", "d1", "stream-areal-m", "http://proxy", "key"
    )
    assert result.score == 1.0
    assert len(http.calls("POST")) == 1 and len(http.calls("GET")) == 2
    assert sleeps == [1.0]  # the first poll follows the launch at once; then the backoff


@pytest.mark.parametrize(
    "location",
    [
        "https://gw.test/wait?fromspanner=other",
        "https://gw.test/wait?fromspanner=apigwmoe_502&fromspanner=x",
        "https://elsewhere.test/",
    ],
)
async def test_other_302s_are_errors(http, make_client, location):  # C9
    http.on(
        "POST", f"{STREAMS}/s/launch_one_task", reply(202, {"task_id": "t1", "status": "PENDING"})
    )
    http.on("GET", "/openapi/v1/tasks/t1/result", reply(302, headers={"location": location}))
    with pytest.raises(ArenaAPIError, match="HTTP 302"):
        await make_client().launch_one_task_result("s", "d1", "stream-areal-m", "http://p", "k")
    assert len(http.calls("POST")) == 1 and len(http.calls("GET")) == 1


def test_non_json_body(http, make_client):
    http.on("GET", STREAMS, reply(200, text="<html>"))
    with pytest.raises(ArenaAPIError, match="non-JSON"):
        make_client().list_streams()


# --- dataset ---


def dataset_server(total: int, *, tags=None, mutate=None):
    def handle(request: httpx.Request) -> httpx.Response:
        limit, offset = int(request.url.params["limit"]), int(request.url.params["offset"])
        ids = [f"data-{i}" for i in range(offset, min(total, offset + limit))]
        page = {
            "total": total,
            "offset": offset,
            "limit": limit,
            "count": len(ids),
            "data_ids": ids,
        }
        if tags is not None:
            page["items"] = [{"data_id": i, "tags": tags.get(i)} for i in ids]
        if mutate:
            mutate(page)
        return httpx.Response(200, json=page)

    return handle


def test_dataset_total_three(http, make_client):  # D1
    tags = {
        "data-0": ["domain:swe"],
        "data-1": ["domain:math", "level:hard"],
        "data-2": ["level:easy"],
    }
    http.on("POST", f"{STREAMS}/stream-a/dataset", dataset_server(3, tags=tags))
    rows = make_client().get_all_dataset_rows("stream-a")
    assert [(r.params["limit"], r.params["offset"]) for r in http.requests] == [
        ("1", "0"),
        ("3", "0"),
    ]
    assert all(r.body == b"" for r in http.requests)  # POST without a body
    assert rows == [
        {
            "data_id": "data-0",
            "stream_id": "stream-a",
            "llm_protocol": "chat_completions",
            "arena_task_type": "swe",
        },
        {
            "data_id": "data-1",
            "stream_id": "stream-a",
            "llm_protocol": "chat_completions",
            "arena_task_type": "math",
        },
        {
            "data_id": "data-2",
            "stream_id": "stream-a",
            "llm_protocol": "chat_completions",
            "arena_task_type": "unknown",
        },
    ]


def test_dataset_malformed_tags_are_unknown(http, make_client):  # D2
    tags = {
        "data-0": ["domain:math", "domain:swe"],
        "data-1": ["domain:swe", 1],
        "data-2": {"domain": "swe"},
    }
    http.on("POST", f"{STREAMS}/s/dataset", dataset_server(3, tags=tags))
    rows = make_client().get_all_dataset_rows("s", "anthropic")
    assert {r["arena_task_type"] for r in rows} == {"unknown"}
    assert {r["llm_protocol"] for r in rows} == {"anthropic"}


def test_dataset_single_row_uses_the_probe(http, make_client):
    http.on("POST", f"{STREAMS}/s/dataset", dataset_server(1))
    assert [r["data_id"] for r in make_client().get_all_dataset_rows("s")] == ["data-0"]
    assert len(http.requests) == 1


def test_dataset_pagination_1001(http, make_client):  # D3
    http.on("POST", f"{STREAMS}/s/dataset", dataset_server(1001))
    rows = make_client().get_all_dataset_rows("s")
    assert [(r.params["limit"], r.params["offset"]) for r in http.requests] == [
        ("1", "0"),
        ("1000", "0"),
        ("1", "1000"),
    ]
    assert (
        len(rows) == 1001 and rows[0]["data_id"] == "data-0" and rows[-1]["data_id"] == "data-1000"
    )


async def test_dataset_async_pages_concurrently_with_same_rows(http, make_client):
    http.on("POST", f"{STREAMS}/s/dataset", dataset_server(5500, tags={}))
    client = make_client()
    rows = await client.get_all_dataset_rows_async("s", concurrency=4)
    assert [r["data_id"] for r in rows] == [f"data-{i}" for i in range(5500)]
    assert len(http.requests) == 1 + 6


@pytest.mark.parametrize(
    ("total", "message"),
    [
        (0, "contains no dataset rows"),
        (-1, "invalid total"),
        (True, "invalid total"),
        ("3", "invalid total"),
    ],
)
def test_dataset_probe_errors(http, make_client, total, message):
    http.on("POST", f"{STREAMS}/s/dataset", reply(200, {"total": total, "data_ids": []}))
    with pytest.raises(ArenaAPIError, match=message):
        make_client().get_all_dataset_rows("s")


def test_dataset_total_changed(http, make_client):  # D4
    calls = []

    def mutate(page):
        calls.append(1)
        if len(calls) == 3:
            page["total"] = 1002

    http.on("POST", f"{STREAMS}/s/dataset", dataset_server(1001, mutate=mutate))
    with pytest.raises(ArenaAPIError, match="total changed during pagination"):
        make_client().get_all_dataset_rows("s")


def test_dataset_duplicate_ids_across_pages(http, make_client):  # D5
    def mutate(page):
        if page["offset"] == 1000:
            page["data_ids"] = ["data-5"]

    http.on("POST", f"{STREAMS}/s/dataset", dataset_server(1001, mutate=mutate))
    with pytest.raises(ArenaAPIError, match="pagination returned duplicate ids"):
        make_client().get_all_dataset_rows("s")


@pytest.mark.parametrize(("field", "value"), [("offset", 7), ("limit", 2), ("count", 99)])
def test_dataset_page_field_mismatch(http, make_client, field, value):  # D6
    def mutate(page):
        if page["limit"] != 1:
            page[field] = value

    http.on("POST", f"{STREAMS}/s/dataset", dataset_server(3, mutate=mutate))
    with pytest.raises(ArenaAPIError, match=f"pagination returned {field}"):
        make_client().get_all_dataset_rows("s")


@pytest.mark.parametrize(
    ("items", "message"),
    [
        (
            [{"data_id": "data-0"}, {"data_id": "data-0"}, {"data_id": "data-2"}],
            "items contain duplicate ids",
        ),
        ([{"data_id": "data-0"}, {"data_id": "data-1"}, {"data_id": "other"}], "do not match"),
        ([{"data_id": "data-0"}], "do not match"),
        ([{"data_id": ""}, {}, {}], "without a data_id"),
    ],
)
def test_dataset_item_errors(http, make_client, items, message):
    def mutate(page):
        if page["limit"] == 3:
            page["items"] = items

    http.on("POST", f"{STREAMS}/s/dataset", dataset_server(3, mutate=mutate))
    with pytest.raises(ArenaAPIError, match=message):
        make_client().get_all_dataset_rows("s")


def test_dataset_invalid_ids(http, make_client):
    def mutate(page):
        if page["limit"] == 3:
            page["data_ids"] = ["data-0", "", "data-2"]

    http.on("POST", f"{STREAMS}/s/dataset", dataset_server(3, mutate=mutate))
    with pytest.raises(ArenaAPIError, match="invalid data_ids"):
        make_client().get_all_dataset_rows("s")


# --- LLM routes ---


def test_register_and_delete(http, make_client):  # R1
    http.on("POST", "/openapi/v1/llm/models", reply(200, {"model_name": "stream-areal-abc"}))
    http.on("DELETE", "/openapi/v1/llm/models/stream-areal-abc", reply(204))
    client = make_client()
    result = client.register_llm_proxy(
        "stream-areal-abc", "http://10.0.0.1:8000/v1/", "session-key", deployment_id="dep-1"
    )
    assert result == (f"{BASE}/api", "stream-areal-abc")
    post = http.calls("POST")[0]
    assert post.headers["authorization"] == f"Bearer {TOKEN}"
    assert post.json() == {
        "model_name": "stream-areal-abc",
        "endpoints": [
            {
                "endpoint_id": "dep-1",
                "upstream_model": "stream-areal-abc",
                "base_url": "http://10.0.0.1:8000/v1",
                "api_key": "session-key",
                "inbound_protos": ["chat"],
                "enabled": True,
            }
        ],
        "enabled": True,
        "metadata": {"deployment_id": "dep-1"},
    }
    client.delete_llm_proxy("stream-areal-abc")
    assert http.calls("DELETE")[0].raw_path == "/openapi/v1/llm/models/stream-areal-abc"


@pytest.mark.parametrize("protocol", ["anthropic", "responses", "chat_completions"])
async def test_every_protocol_registers_a_chat_upstream(http, make_client, protocol):  # R3
    http.on("POST", "/openapi/v1/llm/models", reply(201, {"model_name": "stream-areal-x"}))
    await make_client().register_llm_proxy_async(
        "stream-areal-x", "http://up", "k", "dep", protocol=protocol
    )
    assert http.requests[0].json()["endpoints"][0]["inbound_protos"] == ["chat"]


def test_register_default_deployment_id_is_a_uuid(http, make_client):
    http.on("POST", "/openapi/v1/llm/models", reply(200, {"model_name": "stream-areal-x"}))
    make_client().register_llm_proxy("stream-areal-x", "http://up", "k")
    body = http.requests[0].json()
    assert len(body["metadata"]["deployment_id"]) == 36
    assert body["endpoints"][0]["endpoint_id"] == body["metadata"]["deployment_id"]


def test_register_validation(make_client):
    client = make_client()
    with pytest.raises(ValueError, match="stream-areal-"):
        client.register_llm_proxy("other-name", "http://up", "k")
    with pytest.raises(ValueError, match="upstream"):
        client.register_llm_proxy("stream-areal-x", "", "k")
    with pytest.raises(ValueError, match="upstream"):
        client.register_llm_proxy("stream-areal-x", "http://up", "")
    with pytest.raises(ValueError, match="protocol"):
        client.register_llm_proxy("stream-areal-x", "http://up", "k", protocol="grpc")


@pytest.mark.parametrize("payload", [{"model_name": "stream-areal-other"}, {}, [1]])
def test_register_response_must_echo_the_name(http, make_client, payload):
    http.on("POST", "/openapi/v1/llm/models", reply(200, payload))
    with pytest.raises(ArenaAPIError, match="model_name"):
        make_client().register_llm_proxy("stream-areal-x", "http://up", "k")


async def test_route_probe(http, make_client):  # R2
    path = "/openapi/v1/llm/models/stream-areal-x"
    http.on(
        "GET",
        path,
        reply(200, {"model_name": "stream-areal-x"}),
        reply(404),
        reply(200, {"data": {"model_name": "stream-areal-x"}}),
        reply(200, {"model_name": "stream-areal-y"}),
    )
    client = make_client()
    assert await client.llm_proxy_exists_async("stream-areal-x") is True
    assert await client.llm_proxy_exists_async("stream-areal-x") is False
    assert await client.llm_proxy_exists_async("stream-areal-x") is True
    with pytest.raises(ArenaAPIError, match="unexpected model_name"):
        await client.llm_proxy_exists_async("stream-areal-x")
    with pytest.raises(ValueError, match="stream-areal-"):
        await client.llm_proxy_exists_async("x")


async def test_route_renewal(http, make_client):  # R4
    path = "/openapi/v1/llm/models/stream-areal-x"
    http.on(
        "PATCH",
        path,
        reply(200, {"model_name": "stream-areal-x"}),
        reply(404),
        reply(200, {"model_name": "wrong"}),
        reply(403, text="nope"),
    )
    client = make_client()
    assert await client.renew_llm_proxy_async("stream-areal-x") is True
    assert http.requests[0].json() == {}
    assert await client.renew_llm_proxy_async("stream-areal-x") is False
    with pytest.raises(ArenaAPIError, match="unexpected model_name"):
        await client.renew_llm_proxy_async("stream-areal-x")
    with pytest.raises(ArenaAPIError, match="HTTP 403"):
        await client.renew_llm_proxy_async("stream-areal-x")


async def test_delete_tolerates_absent_routes_and_fails_on_errors(http, make_client):
    path = "/openapi/v1/llm/models/stream-areal-x"
    http.on("DELETE", path, reply(404), reply(200, {"ok": True}), reply(400, text="bad"))
    client = make_client()
    await client.delete_llm_proxy_async("stream-areal-x")
    await client.delete_llm_proxy_async("stream-areal-x")
    with pytest.raises(ArenaAPIError, match="HTTP 400"):
        await client.delete_llm_proxy_async("stream-areal-x")


# --- tasks ---

LAUNCH = f"{STREAMS}/stream-a/launch_one_task"


async def launch(client: ArenaOpenAPIClient, **kwargs):
    return await client.launch_one_task_result(
        "stream-a", "data-1", "stream-areal-m", "http://proxy:8000", "proxy-key", **kwargs
    )


async def test_launch_body_and_managed_envs(http, make_client):
    http.on("POST", LAUNCH, reply(200, {"task_id": "t1", "status": "DONE", "score": 0.5}))
    launched = []
    result = await launch(
        make_client(),
        session_id="sess-1",
        harness="claude-code-with-skills@5.0.1",
        task_envs={"MODEL_NAME": "user", "EXTRA": "1"},
        on_launch_success=launched.append,
    )
    assert result.score == 0.5 and launched == ["t1"]
    assert http.requests[0].json() == {
        "data_id": "data-1",
        "model_name": "stream-areal-m",
        "base_url": "http://proxy:8000",
        "api_key": "proxy-key",
        "envs": {
            "MODEL_NAME": "stream-areal-m",
            "EXTRA": "1",
            "BASE_URL": "http://proxy:8000",
            "API_KEY": "proxy-key",
        },
        "session_id": "sess-1",
        "harness": "claude-code-with-skills@5.0.1",
    }


async def test_launch_omits_empty_session_and_harness(http, make_client):
    http.on("POST", LAUNCH, reply(200, {"status": "DONE", "score": 1}))
    launched = []
    result = await launch(make_client(), on_launch_success=launched.append)
    body = http.requests[0].json()
    assert "session_id" not in body and "harness" not in body
    assert result.task_id == "launch_one_task" and launched == [None]


async def test_launch_rejects_bad_task_envs(make_client):
    with pytest.raises(ValueError, match="must be strings"):
        await launch(make_client(), task_envs={"N": 1})


async def test_pending_then_harness_failed(http, make_client):  # T1
    http.on("POST", LAUNCH, reply(202, {"task_id": "t1", "status": "PENDING"}))
    http.on(
        "GET",
        "/openapi/v1/tasks/t1/result",
        reply(200, {"task_id": "t1", "status": "HARNESS_FAILED", "raw": {"e": 1}}),
    )
    with pytest.raises(ArenaAPIError, match="HARNESS_FAILED") as info:
        await launch(make_client())
    assert isinstance(info.value, ArenaTaskFailedError)
    assert info.value.task_id == "t1" and info.value.result.raw == {"e": 1}  # T7
    assert info.value.payload["raw"] == {"e": 1} and info.value.harness_result is None


async def test_pending_placeholder_score_is_ignored(http, make_client, sleeps):  # T2
    http.on("POST", LAUNCH, reply(202, {"task_id": "t1", "status": "PENDING", "score": 0}))
    http.on(
        "GET",
        "/openapi/v1/tasks/t1/result",
        reply(200, {"task_id": "t1", "status": "DONE", "score": 1}),
    )
    launched = []
    assert (
        await make_client().launch_one_task(
            "stream-a",
            "data-1",
            "stream-areal-m",
            "http://p",
            "k",
            on_launch_success=launched.append,
        )
        == 1.0
    )
    assert len(http.calls("GET")) == 1 and launched == ["t1"]


async def test_polls_until_terminal(http, make_client, sleeps):
    http.on("POST", LAUNCH, reply(202, {"task_id": "t1", "status": "pending"}))
    http.on(
        "GET",
        "/openapi/v1/tasks/t1/result",
        reply(200, {"task_id": "t1", "status": "AGENT_RUNNING"}),
        reply(200, {"task_id": "t1", "status": " ok ", "score": 0.75, "trace_id": "tr"}),
    )
    result = await launch(make_client())
    assert (result.status, result.score, result.trace_id) == ("OK", 0.75, "tr")
    # The first poll right after the launch, the second one poll_interval later.
    assert len(http.calls("GET")) == 2 and sleeps == [0.5]


async def test_first_poll_follows_the_launch_without_waiting():
    events: list[str] = []

    def arena(request: httpx.Request) -> httpx.Response:
        if request.method == "POST":
            events.append("launch")
            return reply(202, {"task_id": "t1", "status": "PENDING"})
        events.append("poll")
        done = events.count("poll") == 3
        return reply(200, {"task_id": "t1", "status": "DONE" if done else "RUNNING", "score": 1})

    async def async_sleep(seconds: float) -> None:
        events.append(f"sleep {seconds:g}")

    client = ArenaOpenAPIClient(
        base_url=BASE,
        api_token=TOKEN,
        poll_interval=7.0,
        async_transport=httpx.MockTransport(arena),
        async_sleep=async_sleep,
    )
    assert (await launch(client)).score == 1.0
    assert events == ["launch", "poll", "sleep 7", "poll", "sleep 7", "poll"]


async def test_failed_launch_even_with_a_score(http, make_client):  # T3
    http.on("POST", LAUNCH, reply(200, {"task_id": "t1", "status": "HARNESS_FAILED", "score": 0}))
    with pytest.raises(ArenaTaskFailedError, match="HARNESS_FAILED"):
        await launch(make_client())
    assert http.calls("GET") == []


async def test_done_without_top_level_score(http, make_client):  # T6
    http.on("POST", LAUNCH, reply(202, {"task_id": "t1", "status": "PENDING"}))
    http.on(
        "GET",
        "/openapi/v1/tasks/t1/result",
        reply(200, {"task_id": "t1", "status": "DONE", "raw": {"score": 1.0, "reward": 1.0}}),
    )
    with pytest.raises(ArenaAPIError, match="top-level 'score'"):
        await launch(make_client())
    http.on("POST", f"{STREAMS}/b/launch_one_task", reply(200, {"task_id": "t2", "status": "OK"}))
    with pytest.raises(ArenaAPIError, match="top-level 'score'"):
        await make_client().launch_one_task_result("b", "d", "stream-areal-m", "http://p", "k")


async def test_pending_without_task_id(http, make_client):
    http.on("POST", LAUNCH, reply(202, {"status": "PENDING"}))
    with pytest.raises(ArenaAPIError, match="no task_id to poll"):
        await launch(make_client())


async def test_poll_returning_another_task(http, make_client):
    http.on("POST", LAUNCH, reply(202, {"task_id": "t1", "status": "PENDING"}))
    http.on(
        "GET",
        "/openapi/v1/tasks/t1/result",
        reply(200, {"task_id": "t9", "status": "DONE", "score": 1}),
    )
    with pytest.raises(ArenaAPIError, match="unexpected task_id"):
        await launch(make_client())


async def test_pooled_async_clients_bound_requests_in_flight(monkeypatch):
    created = count_instances(monkeypatch, httpx.AsyncClient)
    in_flight, peak = 0, 0

    async def slow_arena(request: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        in_flight += 1
        peak = max(peak, in_flight)
        await asyncio.sleep(0.01)
        in_flight -= 1
        body = json.loads(request.content)
        return httpx.Response(200, json={"task_id": body["data_id"], "status": "DONE", "score": 1})

    client = ArenaOpenAPIClient(
        base_url=BASE,
        api_token=TOKEN,
        max_connections=10,
        async_transport=httpx.MockTransport(slow_arena),
    )
    for _ in range(2):
        results = await asyncio.gather(
            *(
                client.launch_one_task_result(
                    "stream-a", f"d{i}", "stream-areal-m", "http://p", "k"
                )
                for i in range(40)
            )
        )
        assert sorted(r.task_id for r in results) == sorted(f"d{i}" for i in range(40))
    # 10 connections as shards of 4 + 4 + 2, created once per event loop and reused
    assert peak == 10 and len(created) == 3
    await client.aclose()
    assert all(c.is_closed for c in created)


async def test_light_load_uses_one_shard(http, make_client, monkeypatch):
    created = count_instances(monkeypatch, httpx.AsyncClient)
    http.on("GET", STREAMS, reply(200, {"items": []}))
    client = make_client()
    for _ in range(5):
        await client.list_streams_async()
    assert len(created) == 1
    await client.aclose()


# --- harness versions and recent tasks (used by preflight) ---


def test_harness_version_and_tasks(http, make_client):
    http.on(
        "GET",
        "/openapi/v1/harnesses/claude%2Fcode/versions/1.2.4",
        reply(200, {"data": {"status": "PUBLISHED"}}),
    )
    http.on("GET", f"{STREAMS}/stream%2Fa/tasks", reply(200, {"data": [{"status": "DONE"}]}))
    client = make_client()
    assert client.get_harness_version("claude/code", "1.2.4") == {"status": "PUBLISHED"}
    assert client.list_stream_tasks("stream/a", limit=100, offset=23) == [{"status": "DONE"}]
    assert http.requests[1].params == {"limit": "100", "offset": "23"}


# --- secrets ---


def test_token_never_leaks_into_errors_repr_or_logs(http, make_client, areal_logs):
    echo = f"invalid credentials: Bearer {TOKEN}; gateway key {LLM_KEY}"
    http.on("GET", STREAMS, reply(401, text=echo))
    client = make_client(llm_api_key=LLM_KEY)
    with pytest.raises(ArenaAPIError) as info:
        client.list_streams()
    assert "HTTP 401" in str(info.value)
    for text in (
        str(info.value),
        repr(info.value),
        repr(client),
        repr(client._http),
        areal_logs.text,
    ):
        assert SECRET_SENTINEL not in text
    assert SECRET_SENTINEL not in f"{client.llm_gateway_api_key}"
    assert client.llm_gateway_api_key.reveal() == LLM_KEY
    logging.getLogger("areal.unit").warning("client %r", client)
    assert SECRET_SENTINEL not in areal_logs.text
