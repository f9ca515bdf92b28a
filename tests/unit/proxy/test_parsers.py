"""Reasoning split and tool-call parsing (JSON and XML families) for the rollout proxy."""

from __future__ import annotations

import json
import logging
import re
import sys
from typing import Any

import pytest

from areal.proxy.parsers import (
    SUPPORTED_REASONING_PARSERS,
    SUPPORTED_TOOL_CALL_PARSERS,
    JsonToolCallParser,
    ReasoningParser,
    XmlToolCallParser,
    dump_arguments,
    get_reasoning_parser,
    get_reasoning_parser_or_none,
    get_tool_call_parser,
    get_tool_call_parser_or_none,
    new_tool_call_id,
    process_tool_calls,
)

CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            },
        },
    },
    # flat form, as some agents send it
    {
        "type": "function",
        "name": "configure",
        "parameters": {
            "type": "object",
            "properties": {
                "verbose": {"type": "boolean"},
                "retries": {"type": "integer"},
                "ratio": {"type": "number"},
                "tags": {"type": "array"},
                "options": {"type": "object"},
                "label": {"type": "string"},
                "limit": {"type": ["integer", "null"]},
            },
        },
    },
]


def names_and_args(calls: list[dict[str, Any]]) -> list[tuple[str, str]]:
    for call in calls:
        assert CALL_ID.match(call["id"])
        assert call["type"] == "function"
    return [(c["function"]["name"], c["function"]["arguments"]) for c in calls]


# --- helpers ---


def test_new_tool_call_id_format_and_uniqueness() -> None:
    ids = {new_tool_call_id() for _ in range(50)}
    assert len(ids) == 50
    assert all(CALL_ID.match(i) for i in ids)


def test_dump_arguments_canonical_form() -> None:
    assert dump_arguments({"a": 1, "b": [1, 2]}) == '{"a": 1, "b": [1, 2]}'
    assert dump_arguments({"city": "北京"}) == '{"city": "北京"}'  # not \u-escaped
    assert dump_arguments('{"a":1}') == '{"a":1}'  # strings pass through


def test_dump_arguments_round_trip_nested_unicode() -> None:
    value = {"q": "café ✓", "nested": {"list": [1, 2.5, None, True, "日本"], "e": {}}, "n": -3}
    dumped = dump_arguments(value)
    assert dump_arguments(json.loads(dumped)) == dumped


# --- reasoning ---


def test_reasoning_split_normal_block_is_verbatim() -> None:
    parser = ReasoningParser()
    assert parser.split("<think>\nhmm\n</think>\n\nAnswer") == ("\nhmm\n", "\n\nAnswer")


def test_reasoning_split_keeps_text_before_start() -> None:
    assert ReasoningParser().split("pre <think>r</think> post") == ("r", "pre  post")


def test_reasoning_split_unterminated_swallows_rest() -> None:
    assert ReasoningParser().split("a<think>still thinking") == ("still thinking", "a")


def test_reasoning_split_without_block() -> None:
    assert ReasoningParser().split("plain </think> text") == (None, "plain </think> text")


def test_reasoning_split_force_reasoning_starts_inside_block() -> None:
    parser = ReasoningParser(force_reasoning=True)
    assert parser.split("thinking</think>answer") == ("thinking", "answer")
    assert parser.split("no end here") == (None, "no end here")
    # an explicit start still wins
    assert parser.split("x<think>r</think>y") == ("r", "xy")


def test_reasoning_split_inline_head_plus_tail_is_text() -> None:
    parser = ReasoningParser()
    assert parser.split_inline("pre<think>r</think>post") == ("r", "pre<think>r</think>", "post")
    assert parser.split_inline("<think>open") == ("open", "<think>open", "")
    assert parser.split_inline("none") == (None, "", "none")


def test_reasoning_parser_registry() -> None:
    assert SUPPORTED_REASONING_PARSERS == ("qwen3", "deepseek-r1", "deepseek_r1", "ling3")
    assert get_reasoning_parser("qwen3").force_reasoning is False
    assert get_reasoning_parser("deepseek-r1").force_reasoning is True
    assert get_reasoning_parser("deepseek_r1").split("r</think>a") == ("r", "a")
    assert get_reasoning_parser_or_none("") is None
    assert get_reasoning_parser_or_none("none") is None
    assert isinstance(get_reasoning_parser_or_none("qwen3"), ReasoningParser)


# --- JSON family ---


def test_json_single_call_and_remaining_text() -> None:
    text = (
        "Let me check.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n'
        "</tool_call>"
    )
    calls, rest = JsonToolCallParser().parse(text, TOOLS)
    assert names_and_args(calls) == [("get_weather", '{"city": "Paris", "days": 2}')]
    assert rest == "Let me check."


def test_json_multiple_calls_string_arguments_and_parameters_alias() -> None:
    text = (
        '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\":\\"Oslo\\"}"}</tool_call>\n'
        '<tool_call> {"name": "configure", "parameters": {"verbose":true}} </tool_call>\n'
        "done"
    )
    calls, rest = JsonToolCallParser().parse(text, TOOLS)
    # string arguments are parsed then re-dumped canonically (spaces after ':' and ',')
    assert names_and_args(calls) == [
        ("get_weather", '{"city": "Oslo"}'),
        ("configure", '{"verbose": true}'),
    ]
    assert calls[0]["id"] != calls[1]["id"]
    assert rest == "done"


def test_json_unknown_tool_name_is_kept() -> None:
    calls, rest = JsonToolCallParser().parse(
        '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', TOOLS
    )
    assert names_and_args(calls) == [("rm_rf", "{}")]
    assert rest == ""


def test_json_invalid_block_raises() -> None:
    with pytest.raises(ValueError):
        JsonToolCallParser().parse('<tool_call>{"name": "get_weather", </tool_call>', TOOLS)
    with pytest.raises(ValueError):
        JsonToolCallParser().parse('<tool_call>{"arguments": {}}</tool_call>', TOOLS)


def test_json_has_tool_call_and_registry() -> None:
    parser = JsonToolCallParser()
    assert parser.has_tool_call("x <tool_call>")
    assert not parser.has_tool_call("x <function=f>")
    for name in ("qwen", "qwen25", "hermes", "qwen3"):
        assert isinstance(get_tool_call_parser(name), JsonToolCallParser)
    assert isinstance(get_tool_call_parser("qwen3_coder"), XmlToolCallParser)
    assert SUPPORTED_TOOL_CALL_PARSERS == (
        "qwen",
        "qwen25",
        "hermes",
        "qwen3",
        "qwen3_coder",
        "ling3",
    )
    assert get_tool_call_parser_or_none("none") is None
    assert get_tool_call_parser_or_none("") is None


# --- XML family ---


def xml_call(name: str, params: dict[str, str], wrap: bool = True) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    block = f"<function={name}>\n{body}</function>"
    return f"<tool_call>\n{block}\n</tool_call>" if wrap else block


def test_xml_coerces_every_schema_type() -> None:
    text = xml_call(
        "configure",
        {
            "verbose": "TRUE",
            "retries": "3",
            "ratio": "0.25",
            "tags": '["a", "b"]',
            "options": '{"depth": 2}',
            "label": "42",
            "limit": "7",
            "extra": "not in schema",
        },
    )
    calls, rest = XmlToolCallParser().parse(text, TOOLS)
    assert names_and_args(calls) == [
        (
            "configure",
            '{"verbose": true, "retries": 3, "ratio": 0.25, "tags": ["a", "b"], '
            '"options": {"depth": 2}, "label": "42", "limit": 7, "extra": "not in schema"}',
        )
    ]
    assert rest == ""


def test_xml_integral_number_stays_integer() -> None:
    calls, _ = XmlToolCallParser().parse(xml_call("configure", {"ratio": "2"}), TOOLS)
    assert calls[0]["function"]["arguments"] == '{"ratio": 2}'


def test_xml_coercion_failures_keep_raw_string() -> None:
    params = {
        "verbose": "yes",
        "retries": "three",
        "ratio": "nan",
        "tags": '{"not": "a list"}',
        "options": "{broken",
    }
    calls, _ = XmlToolCallParser().parse(xml_call("configure", params), TOOLS)
    assert json.loads(calls[0]["function"]["arguments"]) == params


def test_xml_strips_exactly_one_newline_each_side() -> None:
    text = "<function=get_weather><parameter=city>\n\n  Rome \n\n</parameter></function>"
    calls, _ = XmlToolCallParser().parse(text, TOOLS)
    assert calls[0]["function"]["arguments"] == '{"city": "\\n  Rome \\n"}'


def test_xml_without_wrapper_and_im_end_removed() -> None:
    text = "Calling now.\n" + xml_call("get_weather", {"city": "Lima"}, wrap=False) + "<|im_end|>"
    parser = XmlToolCallParser()
    assert parser.has_tool_call(text)
    calls, rest = parser.parse(text, TOOLS)
    assert names_and_args(calls) == [("get_weather", '{"city": "Lima"}')]
    assert rest == "Calling now."


def test_xml_multiple_calls_and_unknown_tool() -> None:
    text = (
        xml_call("get_weather", {"city": "Kyiv", "days": "5"})
        + "\n"
        + xml_call("shell", {"cmd": "ls", "n": "1"})
    )
    calls, rest = XmlToolCallParser().parse(text, TOOLS)
    # the unknown tool has no schema, so its values stay strings
    assert names_and_args(calls) == [
        ("get_weather", '{"city": "Kyiv", "days": 5}'),
        ("shell", '{"cmd": "ls", "n": "1"}'),
    ]
    assert rest == ""


def test_xml_function_without_parameters_is_skipped() -> None:
    text = "<function=noop>\n</function>\n" + xml_call("get_weather", {"city": "Baku"})
    calls, rest = XmlToolCallParser().parse(text, TOOLS)
    assert names_and_args(calls) == [("get_weather", '{"city": "Baku"}')]
    assert rest == "<function=noop>\n</function>"
    # only parameterless functions: no calls, text untouched
    only = "<function=noop></function><|im_end|>"
    assert XmlToolCallParser().parse(only, TOOLS) == ([], only)


@pytest.mark.parametrize(
    "body",
    [
        "<parameter=city>Rome</parameter><parameter=days>2",  # 2 opens, 1 close
        "<parameter=city>Rome<parameter=days>2</parameter></parameter>",  # nested value
    ],
)
def test_xml_malformed_parameters_bail_out_for_whole_text(body: str) -> None:
    good = xml_call("get_weather", {"city": "Oslo"})
    text = f"{good}\n<function=get_weather>{body}</function>"
    assert XmlToolCallParser().parse(text, TOOLS) == ([], text)


# --- process_tool_calls ---


def test_process_think_block_stays_inline_and_finish_reason_switches() -> None:
    text = (
        "<think>\nI should call the tool.\n</think>\n\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'
    )
    calls, out, finish = process_tool_calls(
        text, TOOLS, JsonToolCallParser(), ReasoningParser(), "stop"
    )
    assert calls is not None
    assert names_and_args(calls) == [("get_weather", '{"city": "Rome"}')]
    assert out == "<think>\nI should call the tool.\n</think>"
    assert finish == "tool_calls"


def test_process_content_after_think_block_is_kept() -> None:
    text = '<think>r</think>Sure.\n<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    calls, out, finish = process_tool_calls(
        text, TOOLS, JsonToolCallParser(), ReasoningParser(), "stop"
    )
    assert calls is not None and len(calls) == 1
    assert out == "<think>r</think>Sure."
    assert finish == "tool_calls"


def test_process_tool_call_inside_think_block_is_ignored() -> None:
    text = '<think><tool_call>{"name": "f", "arguments": {}}</tool_call></think>Answer'
    assert process_tool_calls(text, TOOLS, JsonToolCallParser(), ReasoningParser(), "stop") == (
        None,
        text,
        "stop",
    )


def test_process_length_finish_reason_not_switched() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": 1}}</tool_call>'
    calls, out, finish = process_tool_calls(text, TOOLS, JsonToolCallParser(), None, "length")
    assert calls is not None and names_and_args(calls) == [("f", '{"a": 1}')]
    assert out == ""
    assert finish == "length"


def test_process_invalid_json_falls_back(caplog: pytest.LogCaptureFixture) -> None:
    text = '<think>r</think>\n<tool_call>{"name": "f", "arguments": </tool_call>'
    with caplog.at_level(logging.WARNING, logger="areal.proxy.parsers"):
        result = process_tool_calls(text, TOOLS, JsonToolCallParser(), ReasoningParser(), "stop")
    assert result == (None, text, "tool_calls")
    assert any("tool call parsing failed" in r.getMessage() for r in caplog.records)


def test_process_xml_bail_out_returns_text_without_calls() -> None:
    text = "<function=get_weather><parameter=city>Rome</function>"
    result = process_tool_calls(text, TOOLS, XmlToolCallParser(), None, "stop")
    assert result == (None, text, "tool_calls")


def test_process_no_tools_or_no_parser_is_untouched() -> None:
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>'
    parser = JsonToolCallParser()
    assert process_tool_calls(text, None, parser, None, "stop") == (None, text, "stop")
    assert process_tool_calls(text, [], parser, None, "stop") == (None, text, "stop")
    assert process_tool_calls(text, TOOLS, None, None, "stop") == (None, text, "stop")


def test_process_without_tool_call_is_untouched() -> None:
    text = "<think>r</think>Just an answer."
    assert process_tool_calls(text, TOOLS, JsonToolCallParser(), ReasoningParser(), "stop") == (
        None,
        text,
        "stop",
    )


# --- names outside the native set ---


def test_unknown_parser_without_sglang_lists_native_names(monkeypatch) -> None:
    # None in sys.modules hides an installed sglang from find_spec, so this runs everywhere
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ValueError) as tool_error:
        get_tool_call_parser("llama3")
    message = str(tool_error.value)
    assert "'llama3'" in message and "sglang is not installed" in message
    assert "qwen, qwen25, hermes, qwen3, qwen3_coder" in message

    with pytest.raises(ValueError) as reasoning_error:
        get_reasoning_parser_or_none("kimi")
    message = str(reasoning_error.value)
    assert "'kimi'" in message and "sglang is not installed" in message
    assert "qwen3, deepseek-r1, deepseek_r1" in message
