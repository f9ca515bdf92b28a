"""Ling 3 (``BailingMoeV3``) tool calls and reasoning, read as SGLang 0.5.23's ``ling3`` reads them.

A tool call is GLM-4.5-style XML::

    <tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Rome</arg_value>
    </tool_call>

After the function name comes a newline, the two characters ``\\n``, or directly the first
``<arg_key>``; a call without arguments may close right after its name. Values are typed by
the tool's JSON schema. Reasoning sits between ``<think>`` and ``</think>``, and a
``<tool_call>`` also ends it when ``</think>`` is missing.

Why SGLang's rules, edge cases included: the Flash V3 rollout serves the model through an
SGLang without these parsers, so the proxy parses natively, and agents must get the answers
an SGLang server would give them (``tests/conformance`` compares the two on generated
replies). Those rules, in short:

* only the text before the first ``<tool_call>`` is content (stripped); text between and
  after calls is dropped, and so is an unclosed call or a call to an undeclared function;
* a value is read as JSON, then as the body of a JSON string, then (type ``string``) as
  raw text without one pair of surrounding quotes, then as a Python literal, then as raw
  text; type ``number`` turns a JSON string that holds a number into the number, and type
  ``string`` turns anything else back into text;
* a value that then cannot be dumped as JSON (a Python set, complex or bytes literal) fails
  the whole reply: no calls, and the text unchanged.
"""

from __future__ import annotations

import ast
import json
import re
import threading
import warnings
from collections.abc import Iterator
from typing import Any

from areal.proxy.parsers import ReasoningParser, ToolCall, _make_call, _tool_functions
from areal.utils.logging import getLogger

__all__ = ["Ling3ReasoningParser", "Ling3ToolCallParser"]

logger = getLogger("proxy.ling3")

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
KEY_START, KEY_END = "<arg_key>", "</arg_key>"
VALUE_START, VALUE_END = "<arg_value>", "</arg_value>"
THINK_START, THINK_END = "<think>", "</think>"
ESCAPED_NEWLINE = "\\n"  # backslash and n, which the model may write instead of a newline


# --- tool calls ---


class Ling3ToolCallParser:
    """``<tool_call>NAME`` then ``<arg_key>K</arg_key><arg_value>V</arg_value>`` pairs, then
    ``</tool_call>``."""

    def has_tool_call(self, text: str) -> bool:
        return CALL_START in text

    def parse(self, text: str, tools: list[dict]) -> tuple[list[ToolCall], str]:
        """``(calls, the text before the first <tool_call>, stripped)``; never raises.

        Without tools, or without ``<tool_call>``, the text comes back unchanged, and so it
        does when a value cannot be converted (see the module docstring).
        """
        if not tools or CALL_START not in text:
            return [], text
        try:
            functions = {
                function.get("name"): function
                for function in _tool_functions(tools)
                if isinstance(function.get("name"), str)
            }
            calls = []
            for name, body in _call_blocks(text):
                arguments = _arguments(body, functions.get(name))
                if name and name in functions:
                    calls.append(_make_call(name, arguments))
                else:
                    logger.warning("Ling 3 reply calls an undeclared function %.80r: dropped", name)
        except Exception as exc:  # any failure: the reply stays text, never an HTTP error
            logger.warning("Ling 3 tool call parsing failed; returning the text unchanged: %r", exc)
            return [], text
        return calls, text[: text.index(CALL_START)].strip()


def _call_blocks(text: str) -> Iterator[tuple[str, str]]:
    """``(name, arguments text)`` of every closed call, in order."""
    position = 0
    while (start := text.find(CALL_START, position)) >= 0:
        end = text.find(CALL_END, start + len(CALL_START))
        if end < 0:  # unclosed: not a call, and nothing after it can be one
            return
        yield _split_name(text[start + len(CALL_START) : end])
        position = end + len(CALL_END)


# The first character of <arg_key>, of an escaped newline, or a newline.
_NAME_END_CANDIDATE = re.compile(r"[<\\\n]")


def _split_name(inner: str) -> tuple[str, str]:
    """``(name, arguments text)`` of what lies between ``<tool_call>`` and ``</tool_call>``.

    Leading whitespace is skipped. The name ends at the first place that is the end, or
    ``<arg_key>``, or a newline (real or escaped) after whose whitespace comes ``<arg_key>``
    or the end. The name is kept as written: ``"f \\n"`` names ``"f "``, an unknown function.
    """
    rest = inner.lstrip()
    cut = 0
    while (candidate := _NAME_END_CANDIDATE.search(rest, cut)) is not None:
        cut = candidate.start()
        if rest.startswith(KEY_START, cut):
            return rest[:cut], rest[cut:]
        newline = next((n for n in (ESCAPED_NEWLINE, "\n") if rest.startswith(n, cut)), "")
        if not newline:
            cut += 1
            continue
        after = cut + len(newline)
        while after < len(rest) and rest[after].isspace():
            after += 1
        if after == len(rest) or rest.startswith(KEY_START, after):
            return rest[:cut], rest[after:]
        cut = after  # no place inside that whitespace can end the name either
    return rest, ""


def _argument_pairs(body: str) -> list[tuple[str, str]]:
    """``(key, value)`` of each ``<arg_key>K</arg_key>`` + ``<arg_value>V</arg_value>``.

    Between the two tags only whitespace and escaped newlines may stand; a key runs to the
    first ``</arg_key>`` that is followed that way by a value, and a value to the first
    ``</arg_value>``. A key without such a value is skipped.
    """
    pairs: list[tuple[str, str]] = []
    key_ends = _key_ends_with_values(body)
    key_end = next(key_ends, None)
    position = 0
    while (start := body.find(KEY_START, position)) >= 0:
        key_from = start + len(KEY_START)
        while key_end is not None and key_end[0] < key_from:
            key_end = next(key_ends, None)
        if key_end is None:  # no later key can find a value either
            break
        close, value_from, value_end = key_end
        pairs.append((body[key_from:close], body[value_from:value_end]))
        position = value_end + len(VALUE_END)
    return pairs


def _key_ends_with_values(body: str) -> Iterator[tuple[int, int, int]]:
    """``(</arg_key> offset, value start, value end)`` of every ``</arg_key>`` that a value
    follows, in order (one pass: malformed markup costs linear time, not quadratic)."""
    value_end = -1
    close = body.find(KEY_END)
    while close >= 0:
        value_tag = _skip_separators(body, close + len(KEY_END))
        if body.startswith(VALUE_START, value_tag):
            value_from = value_tag + len(VALUE_START)
            if value_end < value_from:  # else the value ending found before ends this one too
                value_end = body.find(VALUE_END, value_from)
                if value_end < 0:  # no value ends after here
                    return
            yield close, value_from, value_end
        close = body.find(KEY_END, close + 1)


def _skip_separators(text: str, position: int) -> int:
    while position < len(text):
        if text.startswith(ESCAPED_NEWLINE, position):
            position += len(ESCAPED_NEWLINE)
        elif text[position].isspace():
            position += 1
        else:
            break
    return position


def _arguments(body: str, function: dict | None) -> dict[str, Any]:
    pairs = _argument_pairs(body)
    if not pairs:
        return {}
    properties = _schema_properties(function.get("parameters")) if function else {}
    arguments: dict[str, Any] = {}
    for key, raw in pairs:
        key = key.strip()
        kind = _schema_type(properties[key]) if key in properties else None
        arguments[key] = _typed_value(raw, kind)
    return arguments


# --- values ---


def _typed_value(raw: str, kind: Any) -> Any:
    """``raw`` (as written, unstripped) as the value of a property of type ``kind``."""
    value = _decoded(raw, kind)
    if kind != "string" or isinstance(value, str):
        return value
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return str(value)  # e.g. true -> "True", 1.50 -> "1.5", null -> "None"


def _decoded(raw: str, kind: Any) -> Any:
    for decode in (json.loads, _json_in_string_body):
        try:
            value = decode(raw)
        except ValueError:  # json.JSONDecodeError included
            continue
        if kind == "number" and isinstance(value, str):
            return _number(value)
        return value
    if kind == "string":
        quoted = len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'"
        return raw[1:-1] if quoted else raw
    try:
        return _python_literal(raw)
    except (ValueError, SyntaxError):
        return raw


def _json_in_string_body(raw: str) -> Any:
    """``raw`` unescaped as the body of a JSON string (``\\"`` -> ``"``), then read as JSON."""
    return json.loads(json.loads('{"tmp": "' + raw + '"}')["tmp"])


def _number(text: str) -> Any:
    try:
        return float(text) if "." in text or "e" in text.lower() else int(text)
    except ValueError:
        return text


# ast's warnings filter is process-wide state; requests may parse concurrently.
_LITERAL_LOCK = threading.Lock()


def _python_literal(raw: str) -> Any:
    with _LITERAL_LOCK, warnings.catch_warnings():
        # "\d" in a literal warns but still reads as backslash + d
        warnings.simplefilter("ignore", SyntaxWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        return ast.literal_eval(raw)


# --- the JSON-schema type of a property ---


def _schema_properties(schema: Any) -> dict[str, Any]:
    """Top-level ``properties``; failing that, those of the anyOf/oneOf/allOf branches (the
    first branch to name a property wins)."""
    if not isinstance(schema, dict):
        return {}
    properties = schema.get("properties")
    if isinstance(properties, dict):
        return properties
    merged: dict[str, Any] = {}
    for keyword in ("anyOf", "oneOf", "allOf"):
        branches = schema.get(keyword)
        for branch in branches if isinstance(branches, list) else []:
            for key, value in _schema_properties(branch).items():
                merged.setdefault(key, value)
    return merged


_ENUM_TYPES = (
    (bool, "boolean"),  # before int: a bool is an int
    (int, "integer"),
    (float, "number"),
    (str, "string"),
    (list, "array"),
    (dict, "object"),
)


def _enum_type(value: Any) -> str | None:
    if value is None:
        return "null"
    return next((name for cls, name in _ENUM_TYPES if isinstance(value, cls)), None)


def _schema_type(schema: Any) -> Any:
    """The type a property schema asks for, or None; by ``type``, then anyOf/oneOf, enum
    values, allOf, ``properties`` (object) and ``items`` (array)."""
    if not isinstance(schema, dict):
        return None
    declared = schema.get("type")
    if isinstance(declared, str):
        return declared
    if isinstance(declared, list) and declared:
        not_null = [t for t in declared if t != "null"]
        return not_null[0] if not_null else "string"
    alternatives = schema.get("anyOf") or schema.get("oneOf")
    if isinstance(alternatives, list):
        types = [t for t in map(_schema_type, alternatives) if t]
        distinct = set(types)
        if len(distinct) == 1:
            return types[0]
        if len(distinct) == 2 and "null" in distinct:  # optional
            return next(t for t in types if t != "null")
        if types:
            return "string" if "string" in distinct else types[0]
    values = schema.get("enum")
    if isinstance(values, list):
        kinds = {_enum_type(v) for v in values} - {None}
        return kinds.pop() if len(kinds) == 1 else "string"
    required = schema.get("allOf")
    if isinstance(required, list):
        typed = (t for t in map(_schema_type, required) if t and t != "string")
        return next(typed, "string")
    if "properties" in schema:
        return "object"
    if "items" in schema:
        return "array"
    return None


# --- reasoning ---


class Ling3ReasoningParser(ReasoningParser):
    """``<think>`` ... ``</think>``, also ended by ``<tool_call>``, as SGLang's ``ling3``.

    * Any ``<think>`` in the reply (or ``force_reasoning``: the template opened the block)
      makes it reasoning up to the first ``</think>``, leading ``<think>`` tags dropped;
      text before a later ``<think>`` is reasoning too.
    * Without ``</think>``, the first ``<tool_call>`` ends the reasoning and starts the
      content.
    * A reply that would have no content (reasoning only, or a block that never ends) is all
      content, without its tags.
    """

    def __init__(self, force_reasoning: bool = False) -> None:
        super().__init__(THINK_START, THINK_END, force_reasoning=force_reasoning)
        self.also_ends_at = CALL_START

    def _block(self, text: str) -> tuple[int, int, int] | None:
        """``(reasoning_start, reasoning_end, content_start)``, the content possibly empty."""
        if not self.force_reasoning and self.start not in text:
            return None
        inner = 0
        while text.startswith(self.start, inner):
            inner += len(self.start)
        close = text.find(self.end, inner)
        if close >= 0:
            return inner, close, close + len(self.end)
        call = text.find(self.also_ends_at, inner)
        return (inner, call, call) if call >= 0 else (inner, len(text), len(text))

    def _span(self, text: str) -> tuple[int, int, int, int] | None:
        block = self._block(text)
        if block is None or block[2] == len(text):  # no content: no think block either
            return None
        inner, close, after = block
        return 0, inner, close, after

    def split(self, text: str) -> tuple[str | None, str]:
        block = self._block(text)
        if block is None:
            return None, text
        inner, close, after = block
        if after == len(text):
            return None, text[inner:close]
        return text[inner:close], text[after:]
