"""Protocol adapters: request translation and exact round trips of assistant turns."""

from __future__ import annotations

import json

import pytest

from areal.proxy.adapters.anthropic import (
    AnthropicRequestError,
    chat_to_message,
    message_stream_events,
    messages_to_chat,
)
from areal.proxy.adapters.chat_stream import chat_stream_chunks
from areal.proxy.adapters.responses import (
    chat_to_response,
    response_stream_events,
    responses_to_chat,
)
from areal.proxy.messages import prepare_messages


def completion(message: dict, finish: str = "stop") -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "message": message, "finish_reason": finish}],
        "usage": {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15},
    }


ASSISTANT_TURNS = [
    {"role": "assistant", "content": "Hello there."},
    {"role": "assistant", "content": "<think>\nplan it\n</think>\n\nDone."},
    {
        "role": "assistant",
        "content": "<think>check</think>",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "Bash", "arguments": '{"command": "ls -la", "n": 2}'},
            }
        ],
    },
    {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call_2",
                "type": "function",
                "function": {"name": "Read", "arguments": '{"path": "é.txt"}'},
            },
            {"id": "call_3", "type": "function", "function": {"name": "Bash", "arguments": "{}"}},
        ],
    },
]


@pytest.mark.parametrize("turn", ASSISTANT_TURNS)
def test_anthropic_round_trip_is_exact(turn):
    message = chat_to_message(completion(turn, "tool_calls" if "tool_calls" in turn else "stop"))
    echoed = messages_to_chat(
        {
            "messages": [
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": message["content"]},
            ]
        }
    )
    assert echoed["messages"][1] == turn


@pytest.mark.parametrize("turn", ASSISTANT_TURNS)
def test_responses_round_trip_is_exact(turn):
    response = chat_to_response(completion(turn), {"model": "m"}, set())
    items = [{"role": "user", "content": "q"}, *response["output"]]
    chat, _ = responses_to_chat({"input": items})
    assert chat["messages"][1] == turn


def test_anthropic_thinking_block_has_a_signature_and_stop_reasons_map():
    message = chat_to_message(completion(ASSISTANT_TURNS[2], "tool_calls"))
    kinds = [b["type"] for b in message["content"]]
    assert kinds == ["thinking", "tool_use"] and message["content"][0]["signature"].startswith(
        "sig-"
    )
    assert message["stop_reason"] == "tool_use"
    assert chat_to_message(completion(ASSISTANT_TURNS[0], "length"))["stop_reason"] == "max_tokens"
    assert message["usage"]["input_tokens"] == 10 and message["usage"]["output_tokens"] == 5


def test_claude_code_request_translation():
    body = {
        "model": "opus",
        "max_tokens": 32000,
        "stream": True,
        "system": [
            {"type": "text", "text": "billing"},
            {"type": "text", "text": "main", "cache_control": {"type": "ephemeral"}},
        ],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "reminder"},
                    {"type": "text", "text": "do it"},
                ],
            },
            {"role": "system", "content": "agents list"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "hmm", "signature": "whatever"},
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "Bash",
                        "input": {"command": "ls"},
                    },
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_1",
                        "content": [{"type": "text", "text": "a.txt"}],
                        "is_error": False,
                        "cache_control": {"type": "ephemeral"},
                    },
                    {"type": "text", "text": "continue"},
                ],
            },
        ],
        "tools": [
            {"name": "Bash", "description": "shell", "input_schema": {"type": "object"}},
            {"type": "web_search_20250305", "name": "web_search"},
        ],
        "tool_choice": {"type": "any"},
        "temperature": 0.7,
        "stop_sequences": ["END"],
        "thinking": {"type": "enabled", "budget_tokens": 100},
        "metadata": {"user_id": "u"},
    }
    chat = messages_to_chat(body)
    assert chat["messages"] == [
        {"role": "system", "content": "billing\nmain"},
        {"role": "user", "content": "reminder\ndo it"},
        {"role": "system", "content": "agents list"},
        {
            "role": "assistant",
            "content": "<think>hmm</think>",
            "tool_calls": [
                {
                    "id": "toolu_1",
                    "type": "function",
                    "function": {"name": "Bash", "arguments": '{"command": "ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "toolu_1", "content": "a.txt"},
        {"role": "user", "content": "continue"},
    ]
    assert (
        chat["max_completion_tokens"] == 32000
        and chat["temperature"] == 0.7
        and chat["stop"] == ["END"]
    )
    assert [t["function"]["name"] for t in chat["tools"]] == ["Bash"]
    assert chat["tool_choice"] == "required"


def test_anthropic_bad_requests():
    with pytest.raises(AnthropicRequestError, match="role"):
        messages_to_chat({"messages": [{"role": "robot", "content": "x"}]})
    with pytest.raises(AnthropicRequestError, match="empty"):
        messages_to_chat({"messages": []})
    with pytest.raises(AnthropicRequestError):
        messages_to_chat({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]})


def test_anthropic_stream_events_in_order():
    message = chat_to_message(completion(ASSISTANT_TURNS[2], "tool_calls"))
    events = [name for name, _ in message_stream_events(message)]
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    deltas = [
        data["delta"]["type"]
        for name, data in message_stream_events(message)
        if name == "content_block_delta"
    ]
    assert deltas == ["thinking_delta", "signature_delta", "input_json_delta"]


def test_codex_request_translation():
    body = {
        "model": "local",
        "stream": True,
        "store": False,
        "include": ["reasoning.encrypted_content"],
        "client_metadata": {"x": 1},
        "prompt_cache_key": "t",
        "reasoning": {"summary": "auto"},
        "input": [
            {
                "type": "message",
                "id": "msg_1",
                "role": "developer",
                "content": [{"type": "input_text", "text": "sys"}],
            },
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "ctx"},
                    {"type": "input_text", "text": "say hi"},
                ],
            },
            {
                "type": "function_call",
                "id": "fc_1",
                "call_id": "call_a",
                "name": "exec_command",
                "arguments": '{"cmd": "ls"}',
                "status": "completed",
            },
            {"type": "function_call_output", "id": "fco_1", "call_id": "call_a", "output": "a.txt"},
            {
                "type": "custom_tool_call",
                "call_id": "call_b",
                "name": "apply_patch",
                "input": "*** Begin",
            },
            {"type": "custom_tool_call_output", "call_id": "call_b", "output": "ok"},
        ],
        "tools": [
            {
                "type": "function",
                "name": "exec_command",
                "strict": False,
                "parameters": {"type": "object"},
            },
            {
                "type": "namespace",
                "name": "multi_agent_v1",
                "tools": [{"type": "function", "name": "spawn", "parameters": {}}],
            },
            {
                "type": "custom",
                "name": "apply_patch",
                "format": {"type": "grammar", "syntax": "lark", "definition": "x"},
            },
            {"type": "tool_search", "execution": "client", "parameters": {}},
            {"type": "web_search", "external_web_access": False},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
    }
    chat, custom = responses_to_chat(body)
    assert custom == {"apply_patch"}
    assert [t["function"]["name"] for t in chat["tools"]] == [
        "exec_command",
        "spawn",
        "apply_patch",
    ]
    assert chat["messages"] == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "ctx"},
        {"role": "user", "content": "say hi"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_a",
                    "type": "function",
                    "function": {"name": "exec_command", "arguments": '{"cmd": "ls"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_a", "content": "a.txt"},
        {
            "role": "assistant",
            "tool_calls": [
                {
                    "id": "call_b",
                    "type": "function",
                    "function": {"name": "apply_patch", "arguments": '{"input": "*** Begin"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_b", "content": "ok"},
    ]


def test_custom_tool_calls_come_back_as_custom_items():
    turn = {
        "role": "assistant",
        "tool_calls": [
            {
                "id": "call_p",
                "type": "function",
                "function": {"name": "apply_patch", "arguments": '{"input": "diff"}'},
            }
        ],
    }
    response = chat_to_response(completion(turn, "tool_calls"), {"model": "m"}, {"apply_patch"})
    (item,) = response["output"]
    assert (
        item["type"] == "custom_tool_call"
        and item["input"] == "diff"
        and item["call_id"] == "call_p"
    )
    chat, _ = responses_to_chat({"input": [{"role": "user", "content": "q"}, item]})
    assert chat["messages"][1] == turn


def test_responses_stream_always_completes():
    response = chat_to_response(completion(ASSISTANT_TURNS[1]), {"model": "m"}, set())
    events = [e["type"] for e in response_stream_events(response)]
    assert (
        events[:2] == ["response.created", "response.in_progress"]
        and events[-1] == "response.completed"
    )
    assert "response.output_text.delta" in events and "response.output_item.done" in events
    numbers = [e["sequence_number"] for e in response_stream_events(response)]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)


def test_chat_stream_chunks():
    chunks = list(chat_stream_chunks(completion(ASSISTANT_TURNS[3], "tool_calls")))
    deltas = [c["choices"][0]["delta"] for c in chunks]
    assert deltas[0] == {"role": "assistant", "content": ""}
    assert deltas[1]["tool_calls"][0]["function"] == {"name": "Read", "arguments": ""}
    assert json.loads(deltas[2]["tool_calls"][0]["function"]["arguments"]) == {"path": "é.txt"}
    assert (
        chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"
        and chunks[-1]["usage"]["total_tokens"] == 15
    )


def test_message_preparation_flattens_text_blocks():
    messages = prepare_messages(
        [
            {
                "role": "system",
                "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}],
            },
            {"role": "user", "content": [{"type": "text", "text": "b"}, "c"], "name": None},
            {
                "role": "user",
                "content": [{"type": "text", "text": "d"}, {"type": "image", "source": {}}],
            },
        ],
        preprocessors=[lambda ms: [*ms, {"role": "user", "content": "added"}]],
    )
    assert messages[0] == {"role": "system", "content": "a"}  # system: always flattened
    assert messages[1] == {"role": "user", "content": "b\nc"}  # None fields dropped
    assert isinstance(messages[2]["content"], list)  # images keep their block list
    assert messages[3] == {"role": "user", "content": "added"}
