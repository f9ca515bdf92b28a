"""Worker-side requests about SGLang's tool-call and reasoning parsers (see sglang_worker).

Runs inside one SGLang version's interpreter: SGLang's own parsers answer each generated
reply, and the proxy's SGLang fallback (``areal.proxy.parsers`` with a name it does not
handle natively) runs here too, since the project's venv has no SGLang.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HANDLERS"]


def _tools(tools: list[dict[str, Any]]) -> list[Any]:
    from sglang.srt.entrypoints.openai.protocol import Tool

    return [Tool(**tool) for tool in tools]


def _tool_parse(tools: list[Any], parser: str, text: str) -> dict[str, Any]:
    from sglang.srt.function_call.function_call_parser import FunctionCallParser

    normal, items = FunctionCallParser(tools, parser).parse_non_stream(text)
    return {"normal": normal, "calls": [[item.name, item.parameters] for item in items]}


def _reasoning_split(parser: str, text: str, force_reasoning: bool | None) -> dict[str, Any]:
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    split = ReasoningParser(parser, stream_reasoning=False, force_reasoning=force_reasoning)
    reasoning, normal = split.parse_non_stream(text)
    return {"reasoning": reasoning, "normal": normal}


def parse_replies(
    cases: list[dict[str, Any]], tool_parser: str, reasoning_parser: str
) -> list[dict[str, Any]]:
    """For each ``{"text", "tools"}``: SGLang's tool-call parse of the text; its reasoning
    split with ``force_reasoning`` False and True; and, per setting, the tool-call parse of
    the split's normal text (what SGLang's chat serving does with a reply)."""
    answers = []
    for case in cases:
        tools = _tools(case["tools"])
        answer: dict[str, Any] = {"tools": _tool_parse(tools, tool_parser, case["text"])}
        for force in (False, True):
            split = _reasoning_split(reasoning_parser, case["text"], force)
            served = _tool_parse(tools, tool_parser, split["normal"])
            answer[f"force={force}"] = {"split": split, "served": served}
        answers.append(answer)
    return answers


def parser_names() -> dict[str, list[str]]:
    """The keys of SGLang's tool-call and reasoning parser registries."""
    from sglang.srt.function_call.function_call_parser import FunctionCallParser
    from sglang.srt.parser.reasoning_parser import ReasoningParser

    return {
        "tool_call": list(FunctionCallParser.ToolCallParserEnum),
        "reasoning": list(ReasoningParser.DetectorMap),
    }


def proxy_fallback(
    tool_parser: str, reasoning_parser: str, texts: list[str], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    """The proxy's parsers for two names it delegates to SGLang, next to SGLang's own answer
    for each text (tool parse, reasoning split, and the proxy's ``process_tool_calls``)."""
    from areal.proxy import parsers

    assert tool_parser not in parsers.SUPPORTED_TOOL_CALL_PARSERS
    assert reasoning_parser not in parsers.SUPPORTED_REASONING_PARSERS
    tool = parsers.get_tool_call_parser(tool_parser)
    reasoning = parsers.get_reasoning_parser(reasoning_parser)
    results = []
    for text in texts:
        calls, rest = tool.parse(text, tools)
        split = reasoning.split(text)
        processed, content, finish = parsers.process_tool_calls(
            text, tools, tool, reasoning, "stop"
        )
        results.append(
            {
                "classes": [type(tool).__name__, type(reasoning).__name__],
                "has_tool_call": tool.has_tool_call(text),
                "proxy": {
                    "normal": rest,
                    "calls": [[c["function"]["name"], c["function"]["arguments"]] for c in calls],
                    "split": list(split),
                    "inline": list(reasoning.split_inline(text)),
                },
                "processed": {
                    "calls": [
                        [c["function"]["name"], c["function"]["arguments"]] for c in processed or []
                    ],
                    "content": content,
                    "finish": finish,
                },
                "sglang": {
                    "tools": _tool_parse(_tools(tools), tool_parser, text),
                    "split": _reasoning_split(reasoning_parser, text, None),
                },
            }
        )
    return results


HANDLERS = {
    "parse_replies": parse_replies,
    "parser_names": parser_names,
    "proxy_fallback": proxy_fallback,
}
