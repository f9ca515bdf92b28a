"""The proxy's native Ling 3 parsers give SGLang 0.5.23's answers, and its SGLang fallback works.

* ``ling3``: over 600 replies go through SGLang 0.5.23's own ``ling3`` tool-call and reasoning
  parsers in a worker, and through ours here (no SGLang in this interpreter): hand-written
  edge cases, replies generated (seeded) from the format with every separator, value type,
  reasoning form and kind of damage, and seeded markup soup. Per reply: the tool-call parse
  (normal text exactly, call names, and arguments both as decoded objects and as text), the
  reasoning split with ``force_reasoning`` off and on, and the calls found when the
  reasoning is split off first (SGLang's chat serving; the proxy's ``process_tool_calls``).
* The parser names the config check accepts through SGLang are SGLang 0.5.23's registries.
* The fallback (``glm45`` tool calls, ``kimi`` reasoning: names not handled natively) runs
  against both supported SGLang versions.
"""

from __future__ import annotations

import json
import random
from typing import Any

import pytest

from areal.api.config.inference import MAX_SGLANG_VERSION
from areal.proxy.ling3 import Ling3ReasoningParser, Ling3ToolCallParser
from areal.proxy.parsers import (
    SGLANG_REASONING_PARSERS,
    SGLANG_TOOL_CALL_PARSERS,
    process_tool_calls,
)
from tests.conformance.worker_client import SGLangWorker

pytestmark = pytest.mark.sglang

MIN_CASES = 300
GENERATED_CASES = 420


def _function(name: str, parameters: dict[str, Any] | None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": f"{name} tool"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


TOOLS = [
    _function(
        "get_weather",
        {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "units": {"enum": ["celsius", "fahrenheit"]},
            },
        },
    ),
    _function(
        "configure",
        {
            "type": "object",
            "properties": {
                "verbose": {"type": "boolean"},
                "ratio": {"type": "number"},
                "retries": {"type": "integer"},
                "options": {"type": "object"},
                "tags": {"type": "array", "items": {"type": "string"}},
                "label": {"type": "string"},
                "limit": {"type": ["integer", "null"]},
                "mode": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                "level": {"oneOf": [{"type": "integer"}, {"type": "number"}]},
                "payload": {"properties": {"a": {"type": "string"}}},
                "rows": {"items": {"type": "integer"}},
                "anything": {},
                "choice": {"enum": [1, 2.5]},
                "nothing": {"type": "null"},
                "combined": {"allOf": [{"type": "string"}, {"type": "integer"}]},
            },
        },
    ),
    _function("ping", None),
    _function(
        "union_args",
        {"anyOf": [{"properties": {"x": {"type": "number"}}}, {"properties": {"y": {}}}]},
    ),
]
KEYS = {
    "get_weather": ["city", "days", "units"],
    "configure": list(TOOLS[1]["function"]["parameters"]["properties"]),
    "ping": [],
    "union_args": ["x", "y"],
}

# Values as the model writes them: valid JSON of every type, Python literals, JSON strings
# holding other types, escapes, invalid JSON, and a few that fail the whole parse in SGLang
# (a set, a complex number, bytes) -- kept rare so that most replies still carry calls.
VALUES = [
    *("Rome", '"Rome"', "'Rome'", "Zürich 北京", "", " ", '""', "two words", "a\nb"),
    *("line1\\nline2", '\\"quoted\\"', '"\\u00e9t\\u00e9"', '"tab\\there"', "C:\\path\\d+"),
    *("3", "-2", "0", "-0", "3.5", "1e3", "2E-2", "  7 ", "\n12\n", '"5"', '"2.5"', '"1e2"'),
    *("007", "1_000", "0x1F", "NaN", "Infinity", "-Infinity", "12abc", "3.", ".5", "+4"),
    *("true", "false", "True", "FALSE", "yes", "null", "None", '"true"'),
    *('{"a": 1, "b": [1, 2, {"c": null}]}', '{"nested": {"deep": {"x": [true, false]}}}'),
    *("[]", "{}", '[1, "two", 3.0, [4, [5]]]', '[{"k": "v"}, null]', "[1, 2,]", "(1, 2)"),
    *("{'a': 1, 'b': None}", "{1: 'int key'}", '{"tmp": 1}', '"{\\"a\\": 1}"'),
    *("{a: 1", "[1, 2", '{"a": }', '{"a": 1}}', "[1 2]", "{'x': [1, 2}"),
]
FATAL_VALUES = ["{1, 2}", "1j", "b'x'", "{(1, 2): 3}"]
NAME_SEPARATORS = ["\n", "\\n", "", "\n  ", "\\n\n", "\n\n"]
KEY_VALUE_SEPARATORS = ["", "\n", "\\n", " ", "\n\\n ", "\t", "\\n\\n"]
PAIR_SEPARATORS = ["", "\n", "\\n", " \n", "\n\n"]
BETWEEN_CALLS = ["", "\n", "\n\n", " and then ", "text between"]
AFTER_CALLS = ["", "\n", " done.", "<|im_end|>", "\n</think>"]
PREFIXES = ["", "Sure.", "  Let me check.\n\n", "I will call <b>tools</b>:\n"]
REASONING_FORMS = [
    "",  # no reasoning
    "<think>{r}</think>",
    "<think>{r}</think>\n\n",
    "<think>{r}",  # unclosed: a <tool_call> (if any) ends it
    "<think></think>",
    "{r}</think>",  # the template opened the block
    "<think><think>{r}</think>",
    "pre <think>{r}</think>",
    "<think>{r} <tool_call>get_weather\n<arg_key>city</arg_key><arg_value>X</arg_value>"
    "</tool_call> more</think>",  # a call inside the reasoning
    "<think>{r}</think>{r}</think>",
]
REASONING_TEXT = ["The user wants the weather.", "hmm\n\nlet me think", "", "  "]


def _call(rng: random.Random) -> str:
    roll = rng.random()
    if roll < 0.72:
        name = rng.choice(list(KEYS))
    else:  # unknown, empty, a trailing space, wrong case
        name = rng.choice(["launch_rockets", "", "get_weather ", "Get_Weather", "ping "])
    keys = [*KEYS.get(name.strip(), []), "unknown_key", " city ", ""]
    pairs = []
    for _ in range(rng.choice([0, 0, 1, 1, 2, 2, 3, 4])):
        key = rng.choice(keys) if keys else "k"
        value = rng.choice(FATAL_VALUES) if rng.random() < 0.03 else rng.choice(VALUES)
        separator = rng.choice(KEY_VALUE_SEPARATORS)
        pairs.append(f"<arg_key>{key}</arg_key>{separator}<arg_value>{value}</arg_value>")
    if rng.random() < 0.1:  # malformed pair markup
        broken = rng.choice(
            [
                "<arg_key>city</arg_key>x<arg_value>Oslo</arg_value>",
                "<arg_key>city</arg_key>",
                "<arg_key>city<arg_value>Oslo</arg_value>",
                "<arg_value>Oslo</arg_value>",
                "</arg_key>\\n<arg_value>stray</arg_value>",
                "<arg_key>days</arg_key><arg_value>4",  # a value that never ends
            ]
        )
        pairs.insert(rng.randrange(len(pairs) + 1), broken)
    body = rng.choice(PAIR_SEPARATORS).join(pairs)
    if not pairs:
        separator = rng.choice(["", "\n", "\\n", " "])
    else:
        separator = rng.choice(NAME_SEPARATORS)
    closing = rng.choice(["", "\n", "\\n"]) if pairs else ""
    return (
        f"<tool_call>{rng.choice(['', ' ', chr(10)])}{name}{separator}{body}{closing}</tool_call>"
    )


def generate_replies(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    replies = []
    for _ in range(count):
        form = rng.choice(REASONING_FORMS)
        text = form.replace("{r}", rng.choice(REASONING_TEXT)) + rng.choice(PREFIXES)
        calls = [_call(rng) for _ in range(rng.choice([0, 1, 1, 1, 2, 2, 3]))]
        text += "".join(call + rng.choice(BETWEEN_CALLS) for call in calls[:-1])
        text += (calls[-1] if calls else "") + rng.choice(AFTER_CALLS)
        if calls and rng.random() < 0.08:  # generation stopped inside the last call
            last = text.rindex("<tool_call>")
            text = text[: rng.randrange(last + 1, len(text))]
        replies.append(text)
    return replies


# Markup soup: tags, fragments and separators in random order, for the scanning rules.
SOUP = [
    *("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"),
    *("<tool_call>get_weather\n", "<tool_call>configure", "<arg_key>city</arg_key>"),
    *("<arg_value>Rome</arg_value>", "<arg_key>options</arg_key>", '<arg_value>{"a": 1}'),
    *("\n", "\\n", " ", "\t", "\\", "<think>", "</think>", "ping", "days", "3", "x", "{"),
]
SOUP_CASES = 200


def soup_replies(seed: int, count: int) -> list[str]:
    rng = random.Random(seed)
    return ["".join(rng.choices(SOUP, k=rng.randrange(1, 30))) for _ in range(count)]


# Hand-written replies that pin one edge case each (the generator covers them too).
EDGE_REPLIES = [
    "",
    "Just an answer.",
    "<tool_call>ping</tool_call>",
    "<tool_call>ping\n</tool_call>",
    "<tool_call>\nping\n</tool_call>",
    "<tool_call>get_weather<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>",
    "<tool_call>get_weather\\n<arg_key>days</arg_key>\\n<arg_value>3</arg_value>\\n</tool_call>",
    "<tool_call>get_weather \n<arg_key>city</arg_key><arg_value>Rome</arg_value></tool_call>",
    "<tool_call>get_weather\nno key\n<arg_key>city</arg_key><arg_value>R</arg_value></tool_call>",
    "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome",
    "Before <tool_call>ping</tool_call> between <tool_call>get_weather</tool_call> after",
    "<tool_call>configure\n<arg_key>options</arg_key><arg_value>{bad json</arg_value></tool_call>",
    "<tool_call>configure\n<arg_key>tags</arg_key><arg_value>{1, 2}</arg_value></tool_call>",
    '<tool_call>configure\n<arg_key>label</arg_key><arg_value>{"a": [1]}</arg_value></tool_call>',
    '<tool_call>configure\n<arg_key>ratio</arg_key><arg_value>"2.5"</arg_value></tool_call>',
    '<tool_call>configure\n<arg_key>retries</arg_key><arg_value>"2"</arg_value></tool_call>',
    "<tool_call>a<tool_call>ping</tool_call>",
    "<think>only reasoning</think>",
    "<think>unclosed reasoning",
    "reasoning</think>answer",
    "<think></think>answer",
    "<think>r</think><tool_call>ping</tool_call>",
    "<think>r<tool_call>ping</tool_call>",
    "<think>r <tool_call>ping</tool_call></think>",
]


def _json_text(value: Any) -> str:
    """Type-exact and NaN-safe: 1, 1.0 and true differ; NaN equals NaN."""
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def _call_diffs(ours: list[list[str]], theirs: list[list[str]]) -> list[str]:
    if [n for n, _ in ours] != [n for n, _ in theirs]:
        return [f"call names {[n for n, _ in ours]} != {[n for n, _ in theirs]}"]
    diffs = []
    for (name, mine), (_, sglang) in zip(ours, theirs, strict=True):
        if _json_text(json.loads(mine)) != _json_text(json.loads(sglang)):
            diffs.append(f"{name} arguments {mine} != {sglang}")
        elif mine != sglang:
            diffs.append(f"{name} arguments text {mine!r} != {sglang!r}")
    return diffs


def _named(calls: list[dict] | None) -> list[list[str]]:
    return [[c["function"]["name"], c["function"]["arguments"]] for c in calls or []]


def _differences(text: str, answer: dict[str, Any]) -> list[str]:
    diffs = []
    calls, normal = Ling3ToolCallParser().parse(text, TOOLS)
    if normal != answer["tools"]["normal"]:
        diffs.append(f"normal text {normal!r} != {answer['tools']['normal']!r}")
    diffs += _call_diffs(_named(calls), answer["tools"]["calls"])
    for force in (False, True):
        sglang = answer[f"force={force}"]
        parser = Ling3ReasoningParser(force_reasoning=force)
        reasoning, rest = parser.split(text)
        split = sglang["split"]
        if (reasoning or "", rest) != (split["reasoning"], split["normal"]):
            diffs.append(f"force={force}: split {(reasoning, rest)!r} != {split!r}")
        processed, _, _ = process_tool_calls(text, TOOLS, Ling3ToolCallParser(), parser, "stop")
        diffs += [
            f"force={force} served: {d}"
            for d in _call_diffs(_named(processed), sglang["served"]["calls"])
        ]
        _, head, tail = parser.split_inline(text)
        if head and tail != split["normal"]:  # the proxy searches the same text for calls
            diffs.append(f"force={force}: searched {tail!r}, SGLang's content {split['normal']!r}")
    return diffs


@pytest.fixture(scope="module")
def newest(sglang_workers: dict[str, SGLangWorker]) -> SGLangWorker:
    worker = sglang_workers[MAX_SGLANG_VERSION]
    worker.wait_ready()
    return worker


def test_ling3_parsers_answer_as_sglang_does(newest: SGLangWorker):
    replies = EDGE_REPLIES + generate_replies(seed=20261206, count=GENERATED_CASES)
    replies += soup_replies(seed=7, count=SOUP_CASES)
    assert len(replies) >= MIN_CASES
    cases = [{"text": text, "tools": TOOLS} for text in replies]
    answers = newest.call(
        "parse_replies", timeout_s=300, cases=cases, tool_parser="ling3", reasoning_parser="ling3"
    )
    assert len(answers) == len(replies)
    mismatches = []
    for index, (text, answer) in enumerate(zip(replies, answers, strict=True)):
        mismatches += [f"case {index} {text!r}: {d}" for d in _differences(text, answer)]
    assert not mismatches, f"{len(mismatches)} differences:\n" + "\n".join(mismatches[:15])
    # the replies reach what they are meant to: calls, dropped calls, and failed replies
    with_calls = sum(bool(a["tools"]["calls"]) for a in answers)
    dropped = sum(
        t.count("</tool_call>") > len(a["tools"]["calls"]) for t, a in zip(replies, answers)
    )
    failed = sum(a["tools"]["normal"] == t and "<tool_call>" in t for t, a in zip(replies, answers))
    assert with_calls > len(replies) // 3 and dropped > 50 and failed >= 5


def test_parser_names_are_sglang_0_5_23s_registries(newest: SGLangWorker):
    names = newest.call("parser_names")
    assert sorted(SGLANG_TOOL_CALL_PARSERS) == sorted(names["tool_call"])
    assert sorted(SGLANG_REASONING_PARSERS) == sorted(names["reasoning"])
    assert len(set(SGLANG_TOOL_CALL_PARSERS)) == len(SGLANG_TOOL_CALL_PARSERS)
    assert len(set(SGLANG_REASONING_PARSERS)) == len(SGLANG_REASONING_PARSERS)


FALLBACK_TOOLS = [TOOLS[0]]
FALLBACK_TEXTS = [
    "Let me check.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
    "◁think▷The user wants the weather.◁/think▷Let me check.\n<tool_call>get_weather\n"
    "<arg_key>city</arg_key>\n<arg_value>Oslo</arg_value>\n</tool_call>",
    "◁think▷No tool needed.◁/think▷It is sunny.",
]


def test_sglang_fallback_parsers_work_on_each_supported_version(sglang: SGLangWorker):
    results = sglang.call(
        "proxy_fallback",
        tool_parser="glm45",
        reasoning_parser="kimi",
        texts=FALLBACK_TEXTS,
        tools=FALLBACK_TOOLS,
    )
    for result in results:  # the fallback gives SGLang's own answers
        assert result["classes"] == ["_SGLangToolCallParser", "_SGLangReasoningParser"]
        assert result["proxy"]["normal"] == result["sglang"]["tools"]["normal"]
        assert not _call_diffs(result["proxy"]["calls"], result["sglang"]["tools"]["calls"])
        reasoning, normal = result["proxy"]["split"]
        sglang_split = result["sglang"]["split"]
        assert (reasoning or "", normal) == (sglang_split["reasoning"], sglang_split["normal"])
    first, second, third = results
    assert first["has_tool_call"] and second["has_tool_call"] and not third["has_tool_call"]
    # hand-checked answers: the calls, and the think block kept inline in front of the content
    assert first["processed"] == {
        "calls": [["get_weather", '{"city": "Rome", "days": 3}']],
        "content": "Let me check.",
        "finish": "tool_calls",
    }
    assert second["proxy"]["inline"] == [
        "The user wants the weather.",
        "◁think▷The user wants the weather.◁/think▷",
        FALLBACK_TEXTS[1].split("◁/think▷")[1],
    ]
    assert second["processed"] == {
        "calls": [["get_weather", '{"city": "Oslo"}']],
        "content": "◁think▷The user wants the weather.◁/think▷Let me check.",
        "finish": "tool_calls",
    }
    assert third["proxy"]["split"] == ["No tool needed.", "It is sunny."]
    assert third["processed"] == {"calls": [], "content": FALLBACK_TEXTS[2], "finish": "stop"}
