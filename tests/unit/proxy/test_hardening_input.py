"""Proxy hardening: malformed input and bad sampling values are client errors (4xx).

Every case here used to reach the engine, crash inside the proxy (HTTP 500), or flag the
session with ``system_error`` so that the workflow rejected its rollout as an
infrastructure failure. A bad request is the client's own error: a 4xx naming the field,
the engine is never called, and the session's diagnostics stay clean.
"""

from __future__ import annotations

import math

import httpx
import orjson
import pytest
from transformers import AutoTokenizer

from areal.proxy.errors import ChatRequestError
from areal.proxy.validation import check_chat_request, check_sampling
from tests.unit.proxy.conftest import ADMIN, ScriptedEngine, bearer, running_proxy, start_session

USER = [{"role": "user", "content": "hi"}]
CHAT = {"model": "m", "messages": USER, "max_tokens": 4}
MESSAGES = {"model": "claude", "max_tokens": 4, "messages": USER}
RESPONSES = {"model": "codex", "input": "hi", "max_output_tokens": 4}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def chat(**fields):
    return ("/v1/chat/completions", {**CHAT, **fields})


def chat_messages(*messages):
    return chat(messages=[*USER, *messages])


def anthropic(**fields):
    return ("/v1/messages", {**MESSAGES, **fields})


def responses(**fields):
    return ("/v1/responses", {**RESPONSES, **fields})


def raw(path: str, data: bytes):
    return (path, data)


# (path, JSON body or raw bytes): every one must get a 4xx and leave the session clean
MALFORMED = {
    # --- chat completions ---
    "chat-bad-json": raw("/v1/chat/completions", b'{"model": "m", "messages": ['),
    "chat-not-utf8": raw(
        "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe"}]}'
    ),
    "chat-top-level-array": raw("/v1/chat/completions", orjson.dumps(USER)),
    "chat-top-level-string": raw("/v1/chat/completions", b'"hi"'),
    "chat-nested-too-deep": raw("/v1/chat/completions", b"[" * 5000 + b"]" * 5000),
    "chat-messages-missing": ("/v1/chat/completions", {"model": "m"}),
    "chat-messages-string": chat(messages="hi"),
    "chat-messages-empty": chat(messages=[]),
    "chat-message-not-object": chat(messages=["hi"]),
    "chat-role-missing": chat(messages=[{"content": "hi"}]),
    "chat-role-unknown": chat(messages=[{"role": "robot", "content": "hi"}]),
    "chat-role-not-string": chat(messages=[{"role": 5, "content": "hi"}]),
    "chat-content-number": chat(messages=[{"role": "user", "content": 5}]),
    "chat-content-missing": chat(messages=[{"role": "user"}]),
    "chat-content-part-number": chat(messages=[{"role": "user", "content": [5]}]),
    "chat-text-part-not-string": chat(
        messages=[{"role": "user", "content": [{"type": "text", "text": {"a": 1}}]}]
    ),
    "chat-tool-calls-string": chat_messages({"role": "assistant", "tool_calls": "call"}),
    "chat-tool-call-without-function": chat_messages(
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function"}]}
    ),
    "chat-tool-call-name-number": chat_messages(
        {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": 5}}]}
    ),
    "chat-tool-call-arguments-number": chat_messages(
        {"role": "assistant", "tool_calls": [{**CALL, "function": {"name": "f", "arguments": 5}}]}
    ),
    "chat-tool-calls-on-user": chat(
        messages=[{"role": "user", "content": "x", "tool_calls": [CALL]}]
    ),
    "chat-tool-call-id-number": chat_messages(
        {"role": "assistant", "tool_calls": [CALL]},
        {"role": "tool", "content": "r", "tool_call_id": 5},
    ),
    "chat-tools-string": chat(tools="search"),
    "chat-tools-item-number": chat(tools=[5]),
    "chat-tool-without-name": chat(tools=[{"type": "function", "function": {"parameters": {}}}]),
    "chat-tool-parameters-string": chat(
        tools=[{"type": "function", "function": {"name": "f", "parameters": "x"}}]
    ),
    "chat-tool-choice-unknown": chat(tool_choice="sometimes"),
    "chat-stop-number": chat(stop=5),
    "chat-stop-numbers": chat(stop=[1, 2]),
    "chat-stream-string": chat(stream="yes"),
    "chat-store-string": chat(store="no"),
    "chat-metadata-list": chat(metadata=[1]),
    "chat-extra-body-string": chat(extra_body="x"),
    "chat-template-kwargs-string": chat(extra_body={"chat_template_kwargs": "x"}),
    "chat-template-kwargs-render-option": chat(
        extra_body={"chat_template_kwargs": {"tokenize": True}}
    ),
    "chat-temperature-string": chat(temperature="hot"),
    "chat-max-tokens-string": chat(max_tokens="ten"),
    "chat-max-tokens-huge": chat(max_tokens=2**40),
    "chat-n-string": chat(n="2"),
    "chat-seed-string": chat(seed="abc"),
    # --- responses ---
    "responses-bad-json": raw("/v1/responses", b"{'input': 'hi'}"),
    "responses-input-missing": ("/v1/responses", {"model": "codex"}),
    "responses-input-number": responses(input=5),
    "responses-item-string": responses(input=["hi"]),
    "responses-role-unknown": responses(
        input=[{"type": "message", "role": "robot", "content": "x"}]
    ),
    "responses-role-unhashable": responses(
        input=[{"type": "message", "role": ["user"], "content": "x"}]
    ),
    "responses-call-without-call-id": responses(
        input=[{"type": "function_call", "name": "f", "arguments": "{}"}]
    ),
    "responses-output-without-call-id": responses(
        input=[{"type": "function_call_output", "output": "r"}]
    ),
    "responses-tool-without-name": responses(tools=[{"type": "function"}]),
    "responses-instructions-list": responses(instructions=["be terse"]),
    "responses-max-output-tokens-string": responses(max_output_tokens="many"),
    # --- anthropic messages ---
    "messages-not-utf8": raw("/v1/messages", b'{"max_tokens": 4, "messages": "\xc3\x28"}'),
    "messages-string": anthropic(messages="hi"),
    "messages-item-string": anthropic(messages=["hi"]),
    "messages-role-unknown": anthropic(messages=[{"role": "robot", "content": "x"}]),
    "messages-content-number": anthropic(messages=[{"role": "user", "content": 5}]),
    "messages-tool-use-without-id": anthropic(
        messages=[
            *USER,
            {"role": "assistant", "content": [{"type": "tool_use", "name": "f", "input": {}}]},
        ]
    ),
    "messages-tool-result-without-id": anthropic(
        messages=[{"role": "user", "content": [{"type": "tool_result", "content": "r"}]}]
    ),
    "messages-assistant-block-string": anthropic(
        messages=[*USER, {"role": "assistant", "content": ["x"]}]
    ),
    "messages-tools-item-number": anthropic(tools=[5]),
    "messages-tool-without-name": anthropic(tools=[{"input_schema": {"type": "object"}}]),
    "messages-tool-schema-string": anthropic(tools=[{"name": "f", "input_schema": "x"}]),
    "messages-system-number": anthropic(system=5),
    "messages-stop-sequences-string": anthropic(stop_sequences="STOP"),
    "messages-max-tokens-string": anthropic(max_tokens="many"),
    # --- session endpoints ---
    "reward-string": ("/rl/set_reward", {"reward": "1"}),
    "reward-interaction-id-list": ("/rl/set_reward", {"reward": 1.0, "interaction_id": [1]}),
    "reward-body-array": raw("/rl/set_reward", b"[1.0]"),
    "reward-bad-json": raw("/rl/set_reward", b"{reward: 1}"),
}

ADMIN_MALFORMED = {
    "start-task-id-number": ("/rl/start_session", {"task_id": 5}),
    "start-task-id-slash": ("/rl/start_session", {"task_id": "a b/c"}),
    "start-api-key-number": ("/rl/start_session", {"task_id": "t", "api_key": 5}),
    "start-metadata-list": ("/rl/start_session", {"task_id": "t", "metadata": [1]}),
    # the export cases name the test's (ended) session
    "export-discount-string": ("/export_trajectories", {"discount": "x"}),
    "export-discount-negative": ("/export_trajectories", {"discount": -0.5}),
    "export-style-number": ("/export_trajectories", {"style": 5}),
    "export-orphans-string": ("/export_trajectories", {"drop_retry_orphans": "yes"}),
    "export-last-reward-string": ("/export_trajectories", {"last_reward": "zero"}),
}


@pytest.fixture(scope="module")
def proxy(tokenizer):
    engine = ScriptedEngine(tokenizer)
    with running_proxy(engine, tokenizer, engine_max_tokens=200) as (url, server):
        yield url, server, engine


@pytest.fixture
def session(proxy):
    url, server, _ = proxy
    session_id, key = start_session(url, "malformed")
    yield server.store.get(session_id), key


def send(url: str, path: str, body, key: str) -> httpx.Response:
    headers = {**bearer(key), "content-type": "application/json"}
    data = body if isinstance(body, bytes) else orjson.dumps(body)
    return httpx.post(f"{url}{path}", headers=headers, content=data, timeout=30)


def assert_client_error(response: httpx.Response, session, engine, calls_before: int) -> None:
    assert 400 <= response.status_code < 500, response.text
    assert not session.system_error, session.system_error_message
    assert len(engine.requests) == calls_before  # the engine never saw it


@pytest.mark.parametrize("case", list(MALFORMED), ids=list(MALFORMED))
def test_malformed_input_is_a_client_error_and_never_a_system_failure(proxy, session, case):
    url, _, engine = proxy
    state, key = session
    path, body = MALFORMED[case]
    calls = len(engine.requests)
    response = send(url, path, body, key)
    assert_client_error(response, state, engine, calls)
    diagnostics = httpx.post(f"{url}/rl/end_session", headers=bearer(key)).json()
    assert diagnostics["system_error"] is False and diagnostics["interaction_count"] == 0


@pytest.mark.parametrize("case", list(ADMIN_MALFORMED), ids=list(ADMIN_MALFORMED))
def test_malformed_admin_input_is_a_client_error(proxy, session, case):
    url, server, engine = proxy
    state, _ = session
    path, body = ADMIN_MALFORMED[case]
    httpx.post(f"{url}/grant_capacity", headers=bearer(ADMIN)).raise_for_status()
    if path == "/export_trajectories":
        httpx.post(f"{url}/rl/end_session", headers=bearer(state.api_key)).raise_for_status()
        body = {"session_id": state.session_id, **body}
    response = send(url, path, body, ADMIN)
    assert_client_error(response, state, engine, len(engine.requests))
    assert server.store.get(state.session_id) is state  # a refused export removes nothing


# --- sampling parameters, as SGLang validates them, under each protocol's own names ---

BAD_SAMPLING = [
    ("chat_completions", "frequency_penalty", 1e300),
    ("chat_completions", "frequency_penalty", -1e300),
    ("chat_completions", "frequency_penalty", 2.5),
    ("chat_completions", "presence_penalty", -3),
    ("chat_completions", "temperature", -0.5),
    ("chat_completions", "temperature", "hot"),
    ("chat_completions", "top_p", -0.1),
    ("chat_completions", "top_p", 1.5),
    ("chat_completions", "top_k", 0),
    ("chat_completions", "top_k", -2),
    ("chat_completions", "top_k", 1.5),
    ("chat_completions", "min_p", 1.5),
    ("chat_completions", "repetition_penalty", 3.0),
    ("chat_completions", "max_tokens", -1),
    ("chat_completions", "max_completion_tokens", 2**40),
    ("chat_completions", "seed", 1.5),
    ("chat_completions", "n", 0),
    ("responses", "temperature", -1),
    ("responses", "top_p", 2),
    ("responses", "max_output_tokens", -5),
    ("anthropic", "temperature", -1),
    ("anthropic", "top_p", -1),
    ("anthropic", "top_k", 0),
    ("anthropic", "max_tokens", -1),
]
PATHS = {
    "chat_completions": ("/v1/chat/completions", CHAT),
    "responses": ("/v1/responses", RESPONSES),
    "anthropic": ("/v1/messages", MESSAGES),
}


@pytest.mark.parametrize(
    ("protocol", "field", "value"), BAD_SAMPLING, ids=[f"{p}-{f}-{v}" for p, f, v in BAD_SAMPLING]
)
def test_bad_sampling_values_get_400_naming_the_field(proxy, session, protocol, field, value):
    url, _, engine = proxy
    state, key = session
    path, base = PATHS[protocol]
    body = {**base, field: value}
    if field == "max_completion_tokens":
        body.pop("max_tokens")
    calls = len(engine.requests)
    response = send(url, path, body, key)
    assert response.status_code == 400, response.text
    assert field in response.text and response.json()["error"]["param"] == field
    if protocol == "anthropic":
        assert response.json()["type"] == "error"  # Anthropic's error shape
    assert_client_error(response, state, engine, calls)


def test_values_at_the_edges_of_the_ranges_are_served_and_just_past_them_refused(proxy, session):
    url, _, engine = proxy
    state, key = session
    edges = {
        "temperature": 0,
        "top_p": 1.0,
        "top_k": -1,
        "min_p": 0.0,
        "frequency_penalty": 2.0,
        "presence_penalty": -2.0,
        "repetition_penalty": 2.0,
        "seed": 2**63,
    }
    response = send(url, "/v1/chat/completions", {**CHAT, **edges}, key)
    assert response.status_code == 200, response.text
    sent = engine.requests[-1].gconfig
    assert sent.frequency_penalty == 2.0 and sent.greedy
    # top_p 0 is the reference's "unset": served as 1.0
    response = send(url, "/v1/chat/completions", {**CHAT, "top_p": 0}, key)
    assert response.status_code == 200 and engine.requests[-1].gconfig.top_p == 1.0
    for path, base in (PATHS["responses"], PATHS["anthropic"]):
        reply = send(url, path, {**base, "temperature": 0, "top_p": 1.0}, key)
        assert reply.status_code == 200, reply.text
    past = {"frequency_penalty": 2.0001, "presence_penalty": -2.0001, "top_p": 1.0001}
    for field, value in past.items():
        refused = send(url, "/v1/chat/completions", {**CHAT, field: value}, key)
        assert refused.status_code == 400 and refused.json()["error"]["param"] == field
    assert not state.system_error


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("field", ["temperature", "top_p", "frequency_penalty", "presence_penalty"])
def test_non_finite_values_are_refused_for_every_protocol(field, value):
    # JSON cannot carry them, but a caller of the proxy's Python API can
    for protocol in ("chat_completions", "responses", "anthropic"):
        if field.endswith("penalty") and protocol != "chat_completions":
            continue
        with pytest.raises(ChatRequestError, match="finite") as caught:
            check_sampling(protocol, {field: value})
        assert caught.value.param == field
    with pytest.raises(ChatRequestError, match=field):
        check_chat_request({**CHAT, field: value})


def test_a_template_refusal_is_a_client_error_but_an_engine_failure_is_not(
    tiny_model_dir, tokenizer
):
    refusing = AutoTokenizer.from_pretrained(tiny_model_dir)
    refusing.chat_template = "{{ raise_exception('Conversation roles must alternate') }}"
    engine = ScriptedEngine(refusing)
    with running_proxy(engine, refusing) as (url, server):
        session_id, key = start_session(url)
        response = httpx.post(f"{url}/v1/chat/completions", headers=bearer(key), json=CHAT)
        assert response.status_code == 400 and "roles must alternate" in response.text
        assert response.json()["error"]["param"] == "messages"
        assert not server.store.get(session_id).system_error and not engine.requests

    class Broken(ScriptedEngine):
        async def agenerate(self, req):
            raise ConnectionError("inference server gone")

    with running_proxy(Broken(tokenizer), tokenizer) as (url, server):
        session_id, key = start_session(url)
        response = httpx.post(f"{url}/v1/messages", headers=bearer(key), json=MESSAGES)
        assert response.status_code == 500
        assert server.store.get(session_id).system_error  # the proxy's side failed
