"""Split reasoning off generated text and parse tool calls out of it (Qwen, Ling 3 formats).

Natively handled formats:

* JSON in tags (``qwen``, ``qwen25``, ``hermes``, ``qwen3``)::

      <tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>

* XML (``qwen3_coder``)::

      <tool_call><function=f><parameter=x>1</parameter></function></tool_call>

* GLM-4.5-style XML (``ling3``, in :mod:`areal.proxy.ling3`; reasoning ``ling3`` too)::

      <tool_call>f
      <arg_key>x</arg_key><arg_value>1</arg_value>
      </tool_call>

Any other parser name is delegated to SGLang's parsers when ``sglang`` is importable; the
names SGLang 0.5.23 registers are listed here, so that a config naming neither is refused at
load time without importing SGLang. Tool arguments always leave this module as
``dump_arguments(<object>)`` so that the proxy's own conversions of arguments (string ->
object -> string) are byte-exact round trips.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import secrets
from typing import Any, Literal, Protocol

from areal.utils.logging import getLogger

__all__ = [
    "SGLANG_REASONING_PARSERS",
    "SGLANG_TOOL_CALL_PARSERS",
    "SUPPORTED_REASONING_PARSERS",
    "SUPPORTED_TOOL_CALL_PARSERS",
    "JsonToolCallParser",
    "ReasoningParser",
    "ToolCall",
    "ToolCallParser",
    "XmlToolCallParser",
    "check_parser_name",
    "dump_arguments",
    "get_reasoning_parser",
    "get_reasoning_parser_or_none",
    "get_tool_call_parser",
    "get_tool_call_parser_or_none",
    "new_tool_call_id",
    "process_tool_calls",
]

logger = getLogger("proxy.parsers")

# {"id": "call_<24 hex>", "type": "function", "function": {"name": str, "arguments": str}}
ToolCall = dict[str, Any]

_JSON_TOOL_CALL_PARSERS = ("qwen", "qwen25", "hermes", "qwen3")
_XML_TOOL_CALL_PARSERS = ("qwen3_coder",)
_LING3 = "ling3"
SUPPORTED_TOOL_CALL_PARSERS: tuple[str, ...] = (
    _JSON_TOOL_CALL_PARSERS + _XML_TOOL_CALL_PARSERS + (_LING3,)
)
# Reasoning parser name -> force_reasoning (DeepSeek-R1 templates open <think> in the prompt).
_NATIVE_REASONING = {"qwen3": False, "deepseek-r1": True, "deepseek_r1": True}
SUPPORTED_REASONING_PARSERS: tuple[str, ...] = (*_NATIVE_REASONING, _LING3)
_NO_PARSER = ("", "none")
# The keys of SGLang 0.5.23's parser registries (FunctionCallParser.ToolCallParserEnum and
# ReasoningParser.DetectorMap); tests/conformance checks them against the wheel.
SGLANG_TOOL_CALL_PARSERS: tuple[str, ...] = tuple(
    """
    apertus2509 beam cohere_command4 deepseekv3 deepseekv31 deepseekv32 deepseekv4
    deepseekv41 dots gemma4 gigachat3 gigachat35 glm glm45 glm47 gpt-oss hermes hunyuan
    inkling interns1 iquest_q1 k2_horizon kimi_k2 kimi_k3 lfm2 ling3 llama3 mimo minicpm5
    minimax-m2 minimax-m3 mistral muse nanbeige poolside_v1 pythonic qwen qwen25 qwen3_coder
    response_template spark25 step3 step3p5 trinity
    """.split()  # noqa: SIM905 - a compact, sorted list
)
SGLANG_REASONING_PARSERS: tuple[str, ...] = tuple(
    """
    apertus2509 beam cohere_command4 deepseek-r1 deepseek-v3 deepseek-v4 deepseek-v41 dots
    gemma4 gigachat35 glm45 gpt-oss granite_thinking_parser hunyuan inkling interns1
    iquest_q1 k2_horizon kimi kimi_k2 kimi_k3 ling3 mimo minimax minimax-append-think
    minimax-m3 mistral muse nanbeige nemotron_3 poolside_v1 qwen3 qwen3-thinking
    response_template step3 step3p5
    """.split()  # noqa: SIM905 - a compact, sorted list
)


def dump_arguments(arguments: Any) -> str:
    """Canonical JSON text of tool arguments; a string is taken as already dumped."""
    if isinstance(arguments, str):
        return arguments
    return json.dumps(arguments, ensure_ascii=False)


def new_tool_call_id() -> str:
    """``call_`` followed by 24 random lowercase hex characters."""
    return "call_" + secrets.token_hex(12)


def _make_call(name: str, arguments: Any) -> ToolCall:
    return {
        "id": new_tool_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": dump_arguments(arguments)},
    }


def _tool_functions(tools: list[dict] | None) -> list[dict[str, Any]]:
    """The function specs of OpenAI chat tools, nested (``{"function": {...}}``) or flat."""
    functions = []
    for tool in tools or []:
        function = tool.get("function")
        functions.append(function if isinstance(function, dict) else tool)
    return functions


# --- reasoning ---


class ReasoningParser:
    """Splits one ``start`` ... ``end`` think block off generated text.

    With ``force_reasoning`` the output is taken to begin inside the block (the chat template
    opened it in the prompt), so text before a lone ``end`` is reasoning.
    """

    def __init__(
        self, start: str = "<think>", end: str = "</think>", force_reasoning: bool = False
    ) -> None:
        self.start = start
        self.end = end
        self.force_reasoning = force_reasoning

    def _span(self, text: str) -> tuple[int, int, int, int] | None:
        """``(block_start, reasoning_start, reasoning_end, block_end)`` offsets, or None."""
        begin = text.find(self.start)
        if begin >= 0:
            inner = begin + len(self.start)
            close = text.find(self.end, inner)
            if close < 0:  # unterminated: the block runs to the end of the text
                return begin, inner, len(text), len(text)
            return begin, inner, close, close + len(self.end)
        if self.force_reasoning:
            close = text.find(self.end)
            if close >= 0:
                return 0, 0, close, close + len(self.end)
        return None

    def split(self, text: str) -> tuple[str | None, str]:
        """``(reasoning, rest)``; text before the block is kept at the front of ``rest``."""
        span = self._span(text)
        if span is None:
            return None, text
        begin, inner, close, after = span
        return text[inner:close], text[:begin] + text[after:]

    def split_inline(self, text: str) -> tuple[str | None, str, str]:
        """``(reasoning, head, tail)`` with ``head + tail == text``.

        ``head`` is the text up to and including the end of the think block, verbatim; it is
        empty when there is no block.
        """
        span = self._span(text)
        if span is None:
            return None, "", text
        _, inner, close, after = span
        return text[inner:close], text[:after], text[after:]


# --- tool calls ---


class ToolCallParser(Protocol):
    """Finds tool calls in generated text (reasoning already split off)."""

    def has_tool_call(self, text: str) -> bool: ...

    def parse(self, text: str, tools: list[dict]) -> tuple[list[ToolCall], str]:
        """``(calls, remaining_text)``: the text with the tool-call blocks removed."""
        ...


class JsonToolCallParser:
    """``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (Qwen 2.5 / Qwen3 / Hermes)."""

    _BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

    def has_tool_call(self, text: str) -> bool:
        return "<tool_call>" in text

    def parse(self, text: str, tools: list[dict]) -> tuple[list[ToolCall], str]:
        """Raises ``ValueError`` (``json.JSONDecodeError`` included) on a malformed block.

        Calls to names outside ``tools`` are kept: the agent decides what to do with them.
        """
        calls = [self._parse_block(m.group(1)) for m in self._BLOCK.finditer(text)]
        return calls, self._BLOCK.sub("", text).strip()

    @staticmethod
    def _parse_block(body: str) -> ToolCall:
        call = json.loads(body)
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            raise ValueError(f"tool call is not an object with a string 'name': {body!r}")
        arguments = call["arguments"] if "arguments" in call else call.get("parameters")
        if arguments is None:
            arguments = {}
        if isinstance(arguments, str):
            arguments = json.loads(arguments)
        if not isinstance(arguments, dict):
            raise ValueError(f"tool call arguments are not a JSON object: {body!r}")
        return _make_call(call["name"], arguments)


_INTEGER = re.compile(r"\s*[-+]?[0-9]+\s*")
_NUMBER = re.compile(r"\s*[-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?\s*")


def _coerce(value: str, schema: Any) -> Any:
    """``value`` converted to the JSON-schema type in ``schema``; the raw string on failure."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):  # e.g. ["integer", "null"]
        kind = next((k for k in kind if k != "null"), None)
    if kind == "boolean" and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    if kind == "integer" and _INTEGER.fullmatch(value):
        return int(value)
    if kind == "number" and _NUMBER.fullmatch(value):
        if _INTEGER.fullmatch(value):
            return int(value)
        number = float(value)
        return number if math.isfinite(number) else value
    if kind in ("array", "object"):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        if isinstance(parsed, list if kind == "array" else dict):
            return parsed
    return value


def _strip_one_newline(value: str) -> str:
    value = value.removeprefix("\n")
    return value.removesuffix("\n")


class XmlToolCallParser:
    """``<tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>``.

    The ``<tool_call>`` wrapper is optional. Values are strings typed by the tool's JSON schema.
    """

    _FUNCTION = re.compile(
        r"(?:<tool_call>\s*)?<function=([^>]*)>(.*?)</function>(?:\s*</tool_call>)?", re.DOTALL
    )
    _PARAMETER = re.compile(r"<parameter=([^>]*)>(.*?)</parameter>", re.DOTALL)

    def has_tool_call(self, text: str) -> bool:
        return "<function=" in text

    def parse(self, text: str, tools: list[dict]) -> tuple[list[ToolCall], str]:
        """No calls and the text unchanged when any function body is malformed.

        Function blocks without parameters are skipped and stay in the text.
        """
        properties: dict[str, dict[str, Any]] = {}
        for function in _tool_functions(tools):
            parameters = function.get("parameters")
            props = parameters.get("properties") if isinstance(parameters, dict) else None
            properties[str(function.get("name"))] = props if isinstance(props, dict) else {}

        blocks = list(self._FUNCTION.finditer(text))
        # A nested or unclosed <parameter= means we cannot tell where values end.
        for block in blocks:
            body = block.group(2)
            if body.count("<parameter=") != body.count("</parameter>"):
                return [], text
            if any("<parameter=" in value for _, value in self._PARAMETER.findall(body)):
                return [], text

        calls: list[ToolCall] = []
        pieces: list[str] = []
        position = 0
        for block in blocks:
            parameters = self._PARAMETER.findall(block.group(2))
            if not parameters:
                continue
            name = block.group(1).strip()
            schema = properties.get(name, {})
            arguments = {
                key.strip(): _coerce(_strip_one_newline(value), schema.get(key.strip()))
                for key, value in parameters
            }
            calls.append(_make_call(name, arguments))
            pieces.append(text[position : block.start()])
            position = block.end()
        if not calls:
            return [], text
        pieces.append(text[position:])
        return calls, "".join(pieces).replace("<|im_end|>", "").strip()


# --- SGLang fallback for formats not handled here ---


class _SGLangToolCallParser:
    """Delegates a tool-call format this module does not handle to SGLang's detectors."""

    def __init__(self, name: str) -> None:
        from sglang.srt.function_call.function_call_parser import FunctionCallParser

        if name not in FunctionCallParser.ToolCallParserEnum:
            raise ValueError(f"unknown tool call parser {name!r} (neither native nor SGLang's)")
        self._parser_class = FunctionCallParser
        self.name = name

    def has_tool_call(self, text: str) -> bool:
        # The detector itself: since 0.5.23 the parser answers False for a call without tools.
        return bool(self._parser_class([], self.name).detector.has_tool_call(text))

    def parse(self, text: str, tools: list[dict]) -> tuple[list[ToolCall], str]:
        from sglang.srt.entrypoints.openai.protocol import Function, Tool

        sglang_tools = [
            Tool(
                type="function",
                function=Function(
                    name=function["name"],
                    description=function.get("description"),
                    parameters=function.get("parameters"),
                ),
            )
            for function in _tool_functions(tools)
        ]
        normal_text, items = self._parser_class(sglang_tools, self.name).parse_non_stream(text)
        calls = [_make_call(item.name, json.loads(item.parameters or "{}")) for item in items]
        return calls, normal_text


class _SGLangReasoningParser(ReasoningParser):
    """SGLang's reasoning detector; its think tokens locate the block for ``split_inline``."""

    def __init__(self, name: str) -> None:
        from sglang.srt.parser.reasoning_parser import ReasoningParser as SGLangReasoningParser

        self._parser = SGLangReasoningParser(model_type=name, stream_reasoning=False)
        detector = self._parser.detector
        super().__init__(
            getattr(detector, "think_start_token", "<think>"),
            getattr(detector, "think_end_token", "</think>"),
            force_reasoning=bool(getattr(detector, "_in_reasoning", False)),
        )

    def split(self, text: str) -> tuple[str | None, str]:
        reasoning, normal_text = self._parser.parse_non_stream(text)
        return reasoning or None, normal_text or ""


def _require_sglang(kind: str, name: str, supported: tuple[str, ...]) -> None:
    if importlib.util.find_spec("sglang") is None:
        raise ValueError(
            f"{kind} parser {name!r} is not handled natively and sglang is not installed; "
            f"native {kind} parsers: {', '.join(supported)}"
        )


def check_parser_name(kind: Literal["tool call", "reasoning"], name: str | None) -> None:
    """Raise ``ValueError`` unless ``name`` is a parser of ``kind`` (``"tool call"`` or
    ``"reasoning"``) the proxy can load: native, SGLang 0.5.23's, or none."""
    if name is None or name.lower() in _NO_PARSER:
        return
    if kind == "tool call":
        native, sglang, known = SUPPORTED_TOOL_CALL_PARSERS, SGLANG_TOOL_CALL_PARSERS, name
    elif kind == "reasoning":  # SGLang looks reasoning names up in lower case
        native, sglang, known = SUPPORTED_REASONING_PARSERS, SGLANG_REASONING_PARSERS, name.lower()
    else:
        raise ValueError(f"unknown parser kind {kind!r}")
    if name in native or known in sglang:
        return
    others = [n for n in sglang if n not in native]
    raise ValueError(
        f"{name!r} is not a {kind} parser the proxy knows; native: {', '.join(native)}; "
        f"through SGLang 0.5.23 (sglang installed beside the proxy): {', '.join(others)}; "
        "or 'none' for no parsing"
    )


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The reasoning parser called ``name`` (native, else SGLang's)."""
    if name == _LING3:
        from areal.proxy.ling3 import Ling3ReasoningParser  # it builds on this module

        return Ling3ReasoningParser()
    if name in _NATIVE_REASONING:
        return ReasoningParser(force_reasoning=_NATIVE_REASONING[name])
    _require_sglang("reasoning", name, SUPPORTED_REASONING_PARSERS)
    return _SGLangReasoningParser(name)


def get_reasoning_parser_or_none(name: str | None) -> ReasoningParser | None:
    """Like ``get_reasoning_parser`` but None for ``None``, ``""`` and ``"none"``."""
    if name is None or name.lower() in _NO_PARSER:
        return None
    return get_reasoning_parser(name)


def get_tool_call_parser(name: str) -> ToolCallParser:
    """The tool-call parser called ``name`` (native, else SGLang's)."""
    if name in _JSON_TOOL_CALL_PARSERS:
        return JsonToolCallParser()
    if name in _XML_TOOL_CALL_PARSERS:
        return XmlToolCallParser()
    if name == _LING3:
        from areal.proxy.ling3 import Ling3ToolCallParser  # it builds on this module

        return Ling3ToolCallParser()
    _require_sglang("tool call", name, SUPPORTED_TOOL_CALL_PARSERS)
    return _SGLangToolCallParser(name)


def get_tool_call_parser_or_none(name: str | None) -> ToolCallParser | None:
    """Like ``get_tool_call_parser`` but None for ``None``, ``""`` and ``"none"``."""
    if name is None or name.lower() in _NO_PARSER:
        return None
    return get_tool_call_parser(name)


def process_tool_calls(
    text: str,
    tools: list[dict] | None,
    tool_call_parser: ToolCallParser | None,
    reasoning_parser: ReasoningParser | None,
    finish_reason: str,
) -> tuple[list[ToolCall] | None, str, str]:
    """``(tool_calls or None, text, finish_reason)`` for one generated completion.

    Only the text after the think block is searched for calls; the think block itself stays
    inline, byte-exact, at the front of the returned text. Once a call marker is seen a
    ``"stop"`` finish becomes ``"tool_calls"``, even if parsing then fails (the original text
    is returned) or yields no call.
    """
    if not tools or tool_call_parser is None:
        return None, text, finish_reason
    head, content = "", text
    if reasoning_parser is not None:
        _, head, content = reasoning_parser.split_inline(text)
    if not tool_call_parser.has_tool_call(content):
        return None, text, finish_reason
    if finish_reason == "stop":
        finish_reason = "tool_calls"
    try:
        calls, rest = tool_call_parser.parse(content, tools)
    except ValueError as exc:  # json.JSONDecodeError is a ValueError
        logger.warning("tool call parsing failed; returning the text unchanged: %s", exc)
        return None, text, finish_reason
    return calls or None, head + rest, finish_reason
