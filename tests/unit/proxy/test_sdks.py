"""The official openai and anthropic SDKs against the proxy (real engine, tiny model), and a
tool-call round trip on every API with a scripted engine reply."""

from __future__ import annotations

import json

import anthropic
import httpx
import openai
import pytest

from tests.unit.proxy.conftest import ADMIN, ScriptedEngine, bearer, running_proxy, start_session

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather now",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
TOOL_REPLY = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def proxy(real_engine, tokenizer):
    with running_proxy(real_engine, tokenizer, chat_template_type="concat") as (url, server):
        yield url, server


def session_count(server, session_id: str) -> int:
    return len(server.store.get(session_id).cache)


def test_openai_chat_plain_and_streaming(proxy):
    url, server = proxy
    session_id, key = start_session(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key)
    reply = client.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=1.0
    )
    assert reply.choices[0].message.role == "assistant"
    assert reply.usage.completion_tokens >= 1 and reply.usage.prompt_tokens > 0
    chunks = list(
        client.chat.completions.create(
            model="policy",
            messages=[{"role": "user", "content": "yo"}],
            max_tokens=6,
            temperature=1.0,
            stream=True,
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert (
        chunks[-1].choices[0].finish_reason in ("stop", "length") and chunks[-1].usage is not None
    )
    assert session_count(server, session_id) == 2
    # the legacy path without /v1 works too
    legacy = openai.OpenAI(base_url=url, api_key=key)
    legacy.chat.completions.create(
        model="policy", messages=[{"role": "user", "content": "x"}], max_tokens=2
    )


def test_openai_responses_plain_and_streaming(proxy):
    url, server = proxy
    session_id, key = start_session(url)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key)
    response = client.responses.create(
        model="policy", input="hi there", max_output_tokens=8, instructions="be brief"
    )
    assert response.status == "completed" and response.usage.output_tokens >= 1
    with client.responses.stream(
        model="policy",
        input=[{"role": "developer", "content": "rules"}, {"role": "user", "content": "go"}],
        max_output_tokens=8,
    ) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_response()
    assert events[0] == "response.created" and events[-1] == "response.completed"
    assert final.status == "completed"
    assert session_count(server, session_id) == 2


def test_anthropic_messages_plain_and_streaming(proxy):
    url, server = proxy
    session_id, key = start_session(url)
    client = anthropic.Anthropic(base_url=url, api_key=key)
    message = client.messages.create(
        model="claude-x",
        max_tokens=8,
        system="be brief",
        messages=[{"role": "user", "content": "hello"}],
    )
    assert message.role == "assistant" and message.stop_reason in ("end_turn", "max_tokens")
    with client.messages.stream(
        model="claude-x",
        max_tokens=8,
        messages=[{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert final.content and text == "".join(b.text for b in final.content if b.type == "text")
    assert session_count(server, session_id) == 2


def test_claude_code_style_request_with_beta_query(proxy):
    url, server = proxy
    session_id, key = start_session(url)
    body = {
        "model": "some-model",
        "max_tokens": 16,
        "stream": False,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1"},
            {"type": "text", "text": "You are an agent", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "<system-reminder>today</system-reminder>"},
                    {"type": "text", "text": "say hi", "cache_control": {"type": "ephemeral"}},
                ],
            },
            {"role": "system", "content": "Available agent types: none"},
        ],
        "tools": [{"name": "Bash", "description": "run", "input_schema": {"type": "object"}}],
        "thinking": {"type": "adaptive"},
        "output_config": {"effort": "high"},
        "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
        "metadata": {"user_id": json.dumps({"session_id": "abc"})},
    }
    assert httpx.head(f"{url}/").status_code == 200
    response = httpx.post(
        f"{url}/v1/messages?beta=true",
        json=body,
        headers={
            "x-api-key": key,
            "anthropic-version": "2023-06-01",
            "anthropic-beta": "claude-code-20250219",
        },
    )
    assert response.status_code == 200, response.text
    assert response.json()["type"] == "message"
    recorded = server.store.get(session_id).cache.values()[0]
    assert [m["role"] for m in recorded.messages] == ["system", "user", "system"]


@pytest.mark.parametrize("api", ["chat", "responses", "anthropic"])
def test_tool_call_round_trip(tokenizer, api):
    engine = ScriptedEngine(tokenizer, [TOOL_REPLY, "It is sunny in Paris."])
    with running_proxy(engine, tokenizer, chat_template_type="concat") as (url, server):
        session_id, key = start_session(url)
        if api == "chat":
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key)
            first = client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "weather?"}],
                tools=TOOLS,
                max_tokens=64,
            )
            call = first.choices[0].message.tool_calls[0]
            assert first.choices[0].finish_reason == "tool_calls"
            assert (call.function.name, json.loads(call.function.arguments)) == (
                "get_weather",
                {"city": "Paris"},
            )
            second = client.chat.completions.create(
                model="m",
                max_tokens=64,
                tools=TOOLS,
                messages=[
                    {"role": "user", "content": "weather?"},
                    first.choices[0].message.model_dump(exclude_none=True),
                    {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
                ],
            )
            assert second.choices[0].message.content == "It is sunny in Paris."
        elif api == "responses":
            client = openai.OpenAI(base_url=f"{url}/v1", api_key=key)
            tools = [
                {
                    "type": "function",
                    "name": "get_weather",
                    "parameters": TOOLS[0]["function"]["parameters"],
                }
            ]
            first = client.responses.create(
                model="m", input="weather?", tools=tools, max_output_tokens=64
            )
            call = next(item for item in first.output if item.type == "function_call")
            assert json.loads(call.arguments) == {"city": "Paris"}
            second = client.responses.create(
                model="m",
                tools=tools,
                max_output_tokens=64,
                input=[
                    {"role": "user", "content": "weather?"},
                    {
                        "type": "function_call",
                        "call_id": call.call_id,
                        "name": call.name,
                        "arguments": call.arguments,
                    },
                    {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"},
                ],
            )
            assert second.output_text == "It is sunny in Paris."
        else:
            client = anthropic.Anthropic(base_url=url, api_key=key)
            tools = [{"name": "get_weather", "input_schema": TOOLS[0]["function"]["parameters"]}]
            first = client.messages.create(
                model="c",
                max_tokens=64,
                tools=tools,
                messages=[{"role": "user", "content": "weather?"}],
            )
            use = next(block for block in first.content if block.type == "tool_use")
            assert first.stop_reason == "tool_use" and use.input == {"city": "Paris"}
            second = client.messages.create(
                model="c",
                max_tokens=64,
                tools=tools,
                messages=[
                    {"role": "user", "content": "weather?"},
                    {
                        "role": "assistant",
                        "content": [b.model_dump(exclude_none=True) for b in first.content],
                    },
                    {
                        "role": "user",
                        "content": [
                            {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}
                        ],
                    },
                ],
            )
            assert second.content[0].text == "It is sunny in Paris."
        # the second call continues the first: in concat mode its prompt starts with the
        # first call's exact tokens (prompt + reply)
        cache = server.store.get(session_id).cache
        first_i, second_i = cache.values()
        assert second_i.parent is first_i
        assert second_i.prompt_tokens[: len(first_i.sequence)] == first_i.sequence
        httpx.post(f"{url}/rl/end_session", headers=bearer(key)).raise_for_status()
        exported = httpx.post(
            f"{url}/export_trajectories",
            headers=bearer(ADMIN),
            json={"session_id": session_id, "style": "concat"},
        ).json()["interactions"]
        assert [i["id"] for i in exported] == [second_i.id]


def test_streaming_tool_calls_in_chunks(tokenizer):
    engine = ScriptedEngine(tokenizer, [TOOL_REPLY])
    with running_proxy(engine, tokenizer) as (url, _):
        _, key = start_session(url)
        client = openai.OpenAI(base_url=f"{url}/v1", api_key=key)
        chunks = list(
            client.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "w?"}],
                tools=TOOLS,
                stream=True,
                max_tokens=64,
            )
        )
        calls = [
            c.choices[0].delta.tool_calls
            for c in chunks
            if c.choices and c.choices[0].delta.tool_calls
        ]
        assert calls[0][0].function.name == "get_weather" and calls[0][0].function.arguments == ""
        assert json.loads(calls[1][0].function.arguments) == {"city": "Paris"}
        assert chunks[-1].choices[0].finish_reason == "tool_calls"
