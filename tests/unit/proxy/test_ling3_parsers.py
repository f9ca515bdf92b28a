"""The native Ling 3 tool-call and reasoning parsers, alone and behind every proxy protocol.

Expected answers are SGLang 0.5.23's (tests/conformance compares the two on generated
replies); here each edge case is written out by hand.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import anthropic
import openai
import pytest

from areal.proxy.ling3 import Ling3ReasoningParser, Ling3ToolCallParser
from areal.proxy.parsers import (
    SUPPORTED_REASONING_PARSERS,
    SUPPORTED_TOOL_CALL_PARSERS,
    get_reasoning_parser,
    get_tool_call_parser,
    process_tool_calls,
)
from tests.unit.proxy.conftest import ScriptedEngine, running_proxy, start_session

WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    },
}
CONFIGURE = {
    "name": "configure",
    "parameters": {
        "type": "object",
        "properties": {
            "verbose": {"type": "boolean"},
            "ratio": {"type": "number"},
            "options": {"type": "object"},
            "tags": {"type": "array"},
            "label": {"type": "string"},
            "limit": {"type": ["integer", "null"]},
        },
    },
}
TOOLS = [{"type": "function", "function": WEATHER}, {"type": "function", "function": CONFIGURE}]
ROME = "<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>"


def parse(text: str) -> tuple[list[tuple[str, Any]], str]:
    calls, rest = Ling3ToolCallParser().parse(text, TOOLS)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls], rest


def arguments(body: str, function: str = "configure") -> dict[str, Any]:
    calls, _ = parse(f"<tool_call>{function}\n{body}\n</tool_call>")
    assert len(calls) == 1
    return calls[0][1]


# --- registry ---


def test_ling3_is_native_and_loads_without_sglang(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)  # hides an installed sglang
    assert "ling3" in SUPPORTED_TOOL_CALL_PARSERS and "ling3" in SUPPORTED_REASONING_PARSERS
    assert isinstance(get_tool_call_parser("ling3"), Ling3ToolCallParser)
    reasoning = get_reasoning_parser("ling3")
    assert isinstance(reasoning, Ling3ReasoningParser)
    assert reasoning.force_reasoning is False  # SGLang's ling3 default


# --- tool calls: layout ---


@pytest.mark.parametrize(
    "after_name",
    ["\n", "\\n", "", "\n  \n", "\\n\n"],
    ids=["newline", "escaped-newline", "direct", "newline-and-blanks", "escaped-then-real"],
)
def test_every_separator_after_the_name(after_name: str) -> None:
    text = f"<tool_call>get_weather{after_name}{ROME}\n</tool_call>"
    assert parse(text) == ([("get_weather", {"city": "Rome"})], "")


@pytest.mark.parametrize("between", ["", "\n", "\\n", " \n\t", "\\n\\n"])
def test_separators_between_key_and_value(between: str) -> None:
    body = f"<arg_key>city</arg_key>{between}<arg_value>Oslo</arg_value>"
    assert arguments(body, "get_weather") == {"city": "Oslo"}


def test_several_calls_keep_only_the_text_before_the_first() -> None:
    text = (
        "  Let me check both.\n"
        f"<tool_call>get_weather\n{ROME}\n</tool_call>\nand then\n"
        "<tool_call>configure\\n<arg_key>verbose</arg_key>\\n<arg_value>true</arg_value>"
        "\\n</tool_call> trailing words"
    )
    calls, rest = parse(text)
    assert calls == [("get_weather", {"city": "Rome"}), ("configure", {"verbose": True})]
    assert rest == "Let me check both."  # stripped; text between and after calls is dropped


@pytest.mark.parametrize(
    "text", ["<tool_call>configure</tool_call>", "<tool_call>configure\n</tool_call>"]
)
def test_a_call_without_arguments(text: str) -> None:
    calls, rest = Ling3ToolCallParser().parse(text, TOOLS)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("configure", "{}")
    ]
    assert rest == ""


def test_keys_are_stripped_and_a_repeated_key_keeps_its_last_value() -> None:
    body = (
        "<arg_key> city </arg_key><arg_value>Rome</arg_value>"
        "<arg_key>city</arg_key><arg_value>Oslo</arg_value>"
    )
    assert arguments(body, "get_weather") == {"city": "Oslo"}


def test_a_key_runs_to_the_first_close_tag_that_a_value_follows() -> None:
    body = "<arg_key>days</arg_key>no value<arg_key>city</arg_key><arg_value>R</arg_value>"
    assert arguments(body, "get_weather") == {"days</arg_key>no value<arg_key>city": "R"}
    assert arguments("<arg_key>days</arg_key>no value", "get_weather") == {}


# --- tool calls: values typed by the schema ---


@pytest.mark.parametrize(
    ("key", "raw", "value"),
    [
        ("label", "plain text", "plain text"),
        ("label", '"quoted"', "quoted"),  # JSON string
        ("label", "'single'", "single"),  # one pair of quotes dropped
        ("label", "42", "42"),  # JSON read, then back to text
        ("label", "true", "True"),  # ... with Python's spelling
        ("label", '{"a": [1]}', '{"a": [1]}'),
        ("label", "a\\nb", "a\\nb"),  # an escaped newline inside text stays as written
        ("ratio", "2.5", 2.5),
        ("ratio", "3", 3),  # a whole number stays an int
        ("ratio", "1e3", 1000.0),
        ("ratio", '"2.5"', 2.5),  # number: a JSON string holding a number
        ("ratio", "\n7\n", 7),  # JSON allows the surrounding whitespace
        ("limit", '"5"', "5"),  # integer: no such conversion
        ("limit", "null", None),
        ("verbose", "false", False),
        ("verbose", "True", True),  # a Python literal
        ("verbose", "yes", "yes"),  # nothing reads it: the raw text
        (
            "options",
            '{"depth": {"max": 3}, "on": [true, null]}',
            {"depth": {"max": 3}, "on": [True, None]},
        ),
        ("options", "{'a': None}", {"a": None}),  # a Python literal
        ("options", '{\\"a\\": 1}', {"a": 1}),  # the body of a JSON string
        ("options", "{bad json", "{bad json"),  # unreadable: the raw text
        ("tags", '[1, "two", [3.0]]', [1, "two", [3.0]]),
        ("tags", "(1, 2)", [1, 2]),  # a Python tuple is a JSON array
        ("tags", "[1, 2", "[1, 2"),
        ("undeclared", "12", 12),  # no schema: JSON
        ("undeclared", "twelve", "twelve"),
    ],
)
def test_values_are_typed_by_the_schema(key: str, raw: str, value: Any) -> None:
    assert arguments(f"<arg_key>{key}</arg_key><arg_value>{raw}</arg_value>") == {key: value}


def test_values_are_dumped_canonically() -> None:
    calls, _ = Ling3ToolCallParser().parse(
        '<tool_call>configure\n<arg_key>options</arg_key><arg_value>{"x":1,"é":[1,2]}'
        "</arg_value></tool_call>",
        TOOLS,
    )
    assert calls[0]["function"]["arguments"] == '{"options": {"x": 1, "é": [1, 2]}}'


# --- tool calls: what does not parse ---


def test_calls_to_undeclared_functions_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    text = (
        "Launching.\n<tool_call>launch_rockets\n<arg_key>n</arg_key><arg_value>3</arg_value>"
        f"</tool_call><tool_call>get_weather \n{ROME}</tool_call>"  # "get_weather " (space)
        f"<tool_call>get_weather\n{ROME}</tool_call>"
    )
    with caplog.at_level(logging.WARNING, logger="areal.proxy.ling3"):
        assert parse(text) == ([("get_weather", {"city": "Rome"})], "Launching.")
    assert "'launch_rockets'" in caplog.text and "'get_weather '" in caplog.text


def test_a_name_followed_by_other_text_is_not_a_known_name() -> None:
    # the name only ends where a newline is followed by <arg_key> (or the end)
    assert parse(f"<tool_call>get_weather\nplease\n{ROME}</tool_call>") == ([], "")


def test_an_unclosed_call_is_dropped_and_closed_ones_before_it_kept() -> None:
    assert parse(f"Checking.\n<tool_call>get_weather\n{ROME}") == ([], "Checking.")
    text = f"<tool_call>get_weather\n{ROME}</tool_call>\n<tool_call>configure\n<arg_key>x"
    assert parse(text) == ([("get_weather", {"city": "Rome"})], "")


@pytest.mark.parametrize("raw", ["{1, 2}", "1j", "b'bytes'"])
def test_a_value_json_cannot_hold_fails_the_whole_reply(raw: str) -> None:
    text = (
        f"Plan.\n<tool_call>get_weather\n{ROME}</tool_call>"
        f"<tool_call>configure\n<arg_key>tags</arg_key><arg_value>{raw}</arg_value></tool_call>"
    )
    assert Ling3ToolCallParser().parse(text, TOOLS) == ([], text)


def test_without_tools_or_without_a_call_the_text_is_unchanged() -> None:
    text = f"x <tool_call>get_weather\n{ROME}</tool_call>"
    assert Ling3ToolCallParser().parse(text, []) == ([], text)
    assert Ling3ToolCallParser().parse("no call here ", TOOLS) == ([], "no call here ")
    assert not Ling3ToolCallParser().has_tool_call("<tool_cal")


# --- reasoning ---


@pytest.mark.parametrize(
    ("text", "force", "split", "inline"),
    [
        ("<think>r</think>c", False, ("r", "c"), ("r", "<think>r</think>", "c")),
        ("<think>r<tool_call>x", False, ("r", "<tool_call>x"), ("r", "<think>r", "<tool_call>x")),
        ("<think></think>c", False, ("", "c"), ("", "<think></think>", "c")),
        ("<think><think>r</think>c", False, ("r", "c"), ("r", "<think><think>r</think>", "c")),
        # text before <think> is reasoning too, <think> included
        ("p<think>r</think>c", False, ("p<think>r", "c"), ("p<think>r", "p<think>r</think>", "c")),
        # </think> ends it even after a <tool_call>
        ("<think>a<tool_call>b</think>c", False, ("a<tool_call>b", "c"), None),
        # no content left: the reasoning is the content
        ("<think>only</think>", False, (None, "only"), (None, "", "<think>only</think>")),
        ("<think>never ends", False, (None, "never ends"), (None, "", "<think>never ends")),
        # without <think>, only force_reasoning (a template that opened the block) splits
        ("r</think>c", False, (None, "r</think>c"), (None, "", "r</think>c")),
        ("r</think>c", True, ("r", "c"), ("r", "r</think>", "c")),
        ("plain", False, (None, "plain"), (None, "", "plain")),
        ("plain", True, (None, "plain"), (None, "", "plain")),
        ("Sure <tool_call>x", True, ("Sure ", "<tool_call>x"), ("Sure ", "Sure ", "<tool_call>x")),
        ("", True, (None, ""), (None, "", "")),
    ],
)
def test_reasoning_split(text: str, force: bool, split: tuple, inline: tuple | None) -> None:
    parser = Ling3ReasoningParser(force_reasoning=force)
    assert parser.split(text) == split
    reasoning, head, tail = parser.split_inline(text)
    assert head + tail == text
    if inline is not None:
        assert (reasoning, head, tail) == inline


# --- both, as the proxy runs them ---


def test_process_keeps_the_think_block_inline_and_finds_the_calls() -> None:
    text = f"<think>Rome, then.</think>Checking.\n<tool_call>get_weather\n{ROME}\n</tool_call>"
    calls, content, finish = process_tool_calls(
        text, TOOLS, Ling3ToolCallParser(), Ling3ReasoningParser(), "stop"
    )
    assert calls is not None and calls[0]["function"]["arguments"] == '{"city": "Rome"}'
    assert (content, finish) == ("<think>Rome, then.</think>Checking.", "tool_calls")


def test_process_a_call_that_ends_an_unclosed_think_block() -> None:
    text = f"<think>Rome, then.<tool_call>get_weather\n{ROME}</tool_call>"
    calls, content, _ = process_tool_calls(
        text, TOOLS, Ling3ToolCallParser(), Ling3ReasoningParser(), "stop"
    )
    assert calls is not None and len(calls) == 1 and content == "<think>Rome, then."


def test_process_ignores_a_call_inside_the_reasoning() -> None:
    text = f"<think>maybe <tool_call>get_weather\n{ROME}</tool_call></think>No call."
    result = process_tool_calls(text, TOOLS, Ling3ToolCallParser(), Ling3ReasoningParser(), "stop")
    assert result == (None, text, "stop")


# --- through a running proxy: chat completions, Responses, Anthropic Messages ---

WELL_FORMED = (
    "<think>The user wants Rome.</think>Let me look.\n"
    f"<tool_call>get_weather\n{ROME}\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n"
    "</tool_call>\n<tool_call>configure\\n<arg_key>options</arg_key>\\n"
    '<arg_value>{"depth": 2}</arg_value>\\n</tool_call>'
)
WELL_FORMED_CALLS = [
    ("get_weather", {"city": "Rome", "days": 3}),
    ("configure", {"options": {"depth": 2}}),
]
NOT_JSON = (
    "Tags:\n<tool_call>configure\n<arg_key>tags</arg_key><arg_value>{1, 2}</arg_value></tool_call>"
)
# case -> (scripted reply, content the client sees, calls); the think block stays inline in
# chat content, and becomes a thinking block / reasoning item elsewhere
REPLIES = {
    "well-formed": (
        WELL_FORMED,
        "<think>The user wants Rome.</think>Let me look.",
        WELL_FORMED_CALLS,
    ),
    "unclosed": (f"Checking.\n<tool_call>get_weather\n{ROME}", "Checking.", []),
    "undeclared": ("Launching.\n<tool_call>launch_rockets\n</tool_call>", "Launching.", []),
    "bad-json": (
        "<tool_call>configure\n<arg_key>options</arg_key>"
        "<arg_value>{depth: 2</arg_value></tool_call>",
        "",
        [("configure", {"options": "{depth: 2"})],  # the argument is the raw text
    ),
    "not-json": (NOT_JSON, NOT_JSON, []),  # the reply stays text, unchanged
}


@pytest.fixture(scope="module")
def ling3_proxy(tokenizer):
    def reply(request) -> str:
        prompt = tokenizer.decode(request.input_ids)
        return next(text for name, (text, _, _) in REPLIES.items() if f"case {name}." in prompt)

    engine = ScriptedEngine(tokenizer, reply)
    parsers = {
        "tool_call_parser": get_tool_call_parser("ling3"),
        "reasoning_parser": get_reasoning_parser("ling3"),
    }
    with running_proxy(engine, tokenizer, **parsers) as (url, _):
        _, key = start_session(url)
        yield url, key


def _chat(url: str, key: str, prompt: str, stream: bool) -> tuple[str, list, str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    request = {"model": "m", "messages": [{"role": "user", "content": prompt}], "tools": TOOLS}
    if not stream:
        choice = client.chat.completions.create(**request, max_tokens=400).choices[0]
        calls = choice.message.tool_calls or []
        named = [(c.function.name, json.loads(c.function.arguments)) for c in calls]
        return choice.message.content or "", named, choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(**request, max_tokens=400, stream=True):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            name, args = calls.get(call.index, ("", ""))
            calls[call.index] = (name + (call.function.name or ""), args + call.function.arguments)
        finish = chunk.choices[0].finish_reason or finish
    return content, [(n, json.loads(a)) for n, a in calls.values()], finish


def _responses(url: str, key: str, prompt: str, stream: bool) -> tuple[str, list, str]:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
    tools = [{"type": "function", **function} for function in (WEATHER, CONFIGURE)]
    request = {"model": "m", "input": prompt, "tools": tools, "max_output_tokens": 400}
    if stream:
        with client.responses.stream(**request) as events:
            assert [e.type for e in events][-1] == "response.completed"
            response = events.get_final_response()
    else:
        response = client.responses.create(**request)
    thinking = [i.summary[0].text for i in response.output if i.type == "reasoning"]
    calls = [
        (i.name, json.loads(i.arguments)) for i in response.output if i.type == "function_call"
    ]
    return _inline(thinking, response.output_text), calls, response.status


def _anthropic(url: str, key: str, prompt: str, stream: bool) -> tuple[str, list, str]:
    client = anthropic.Anthropic(base_url=url, api_key=key, max_retries=0)
    tools = [{"name": f["name"], "input_schema": f["parameters"]} for f in (WEATHER, CONFIGURE)]
    request = {"model": "c", "max_tokens": 400, "tools": tools}
    request["messages"] = [{"role": "user", "content": prompt}]
    if stream:
        with client.messages.stream(**request) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**request)
    thinking = [b.thinking for b in message.content if b.type == "thinking"]
    text = "".join(b.text for b in message.content if b.type == "text")
    calls = [(b.name, b.input) for b in message.content if b.type == "tool_use"]
    return _inline(thinking, text), calls, message.stop_reason


def _inline(thinking: list[str], text: str) -> str:
    """A thinking block / reasoning item written back as the chat content carries it."""
    return "".join(f"<think>{t}</think>" for t in thinking) + text


PROTOCOLS = {"chat": _chat, "responses": _responses, "anthropic": _anthropic}
CALL_FINISH = {"chat": "tool_calls", "responses": "completed", "anthropic": "tool_use"}


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("protocol", list(PROTOCOLS))
@pytest.mark.parametrize("case", list(REPLIES))
def test_each_protocol_serves_ling3_replies(ling3_proxy, protocol, stream, case) -> None:
    """Well-formed calls become tool calls (thinking blocks / reasoning items included);
    malformed ones come back as plain content with HTTP 200 (an SDK raises otherwise)."""
    url, key = ling3_proxy
    content, calls, finish = PROTOCOLS[protocol](url, key, f"case {case}.", stream)
    _, expected_content, expected_calls = REPLIES[case]
    assert (content, calls) == (expected_content, expected_calls)
    if calls:
        assert finish == CALL_FINISH[protocol]
