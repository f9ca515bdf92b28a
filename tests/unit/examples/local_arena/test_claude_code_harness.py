"""The built-in Claude-Code-style Harness (``claude-code@builtin-1.0.0``): the tool agent
with Claude Code's ``Bash`` tool over the Anthropic protocol, against a scripted upstream.

The upstream and run fixtures (conftest.py) are those of
tests/unit/local_arena/test_harnesses.py: each LLM call gets the next scripted message, in
the protocol's shape, and is recorded.
"""

from __future__ import annotations

import pytest

from examples.swe.local_arena.catalog import DEFAULT_CATALOG, load_catalog
from examples.swe.local_arena.harnesses import run_harness
from examples.swe.local_arena.types import CatalogError, HarnessError, Ref
from tests.unit.local_arena.test_harnesses import spec, tool_call, tool_outputs

BUILTIN = Ref("claude-code", "builtin-1.0.0")


def test_the_catalog_entry_is_the_tool_agent_over_anthropic() -> None:
    catalog = load_catalog(DEFAULT_CATALOG)
    harness = catalog.harness(BUILTIN)
    assert (harness.kind, harness.protocol) == ("tool_agent", "anthropic")
    assert harness.options["toolset"] == "claude-code" and harness.options["stream"] is True
    # any other version is still the real CLI
    assert catalog.harness(Ref("claude-code", "1.2.31-native-direct-sfx-260821")).kind == (
        "claude-code"
    )
    stream = catalog.streams["arith-claude-code"]
    assert stream.default_harness == BUILTIN and stream.status == "ACTIVE"


async def test_bash_with_a_typed_timeout_then_submit(upstream, make_run) -> None:
    bash = {"command": "echo $((6 * 7)) > out.txt; cat out.txt", "timeout": 5000}
    upstream.reset(
        {"content": "", "tool_calls": [tool_call("Bash", {**bash, "description": "multiply"})]},
        {"tool_calls": [tool_call("submit", {"answer": "42"}, "call_2")]},
    )
    run = make_run()
    harness = spec("tool_agent", "anthropic", toolset="claude-code", stream=True)
    output = await run_harness(harness, run)
    assert (output.answer, output.turns) == ("42", 2)
    assert (run.workdir / "out.txt").read_text() == "42\n"
    first, second = upstream.calls()
    assert first.path == "/v1/messages" and first.body["stream"] is True
    tools = {t["name"]: t["input_schema"] for t in first.body["tools"]}
    assert list(tools) == ["Bash", "submit"]
    assert tools["Bash"]["properties"]["timeout"]["type"] == "integer"
    assert "Bash" in first.body["system"]
    # the echoed tool_use keeps the typed input; the result follows as a tool_result
    echoed = second.body["messages"][1]["content"]
    assert [b["type"] for b in echoed] == ["tool_use"]
    assert echoed[0]["input"] == {**bash, "description": "multiply"}
    assert tool_outputs("anthropic", second.body) == ["42"]


async def test_untyped_timeout_goes_back_to_the_model(upstream, make_run) -> None:
    upstream.reset(
        {"tool_calls": [tool_call("Bash", {"command": "true", "timeout": "5000"})]},
        {"tool_calls": [tool_call("bash", {"command": "true"}, "call_2")]},
        {"content": "gave up"},
    )
    harness = spec("tool_agent", "anthropic", toolset="claude-code")
    output = await run_harness(harness, make_run())
    assert output.answer == "gave up"
    # the history grows: the last call carries both tool results
    untyped, lowercase = tool_outputs("anthropic", upstream.calls()[-1].body)
    assert untyped == "error: Bash's timeout must be a positive integer (milliseconds), got '5000'"
    assert lowercase == "error: unknown tool 'bash'; the tools are Bash and submit"


async def test_bash_timeout_is_capped_by_the_harness(upstream, make_run) -> None:
    upstream.reset(
        {"tool_calls": [tool_call("Bash", {"command": "sleep 5", "timeout": 600000})]},
        {"content": "done"},
    )
    harness = spec("tool_agent", "anthropic", toolset="claude-code", tool_timeout=0.5)
    await run_harness(harness, make_run())
    (output,) = tool_outputs("anthropic", upstream.calls()[1].body)
    assert output.endswith("[timed out after 0.5 s]")


async def test_unknown_toolset_is_a_harness_error(make_run) -> None:
    with pytest.raises(HarnessError, match=r"options\.toolset must be one of default, claude-code"):
        await run_harness(spec("tool_agent", "anthropic", toolset="cursor"), make_run())


def test_the_catalog_refuses_an_unknown_toolset(tmp_path) -> None:
    path = tmp_path / "catalog.yaml"
    path.write_text(
        "harnesses:\n"
        "  - {key: cc, version: '1', protocol: anthropic, kind: tool_agent,"
        " options: {toolset: cursor}}\n"
    )
    with pytest.raises(CatalogError, match=r"harnesses\[0\]\.options\.toolset: must be one of"):
        load_catalog(path)
