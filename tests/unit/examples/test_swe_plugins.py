"""SWE proxy plugins: message preprocessors, the prefix matcher, and loading them by path."""

from __future__ import annotations

import copy
import json

import pytest

from areal.proxy.chat import ChatGenerator
from areal.proxy.interaction import InteractionCache
from areal.proxy.parsers import get_tool_call_parser
from areal.proxy.plugins import load_message_preprocessors, load_prefix_matcher
from examples.swe.prefix_matchers import swe_prefix_matcher
from examples.swe.preprocessors import (
    NormalizeToolCallArguments,
    StripAllSystemReminders,
    StripAnthropicBillingHeader,
    StripAnthropicCacheFields,
)
from tests.unit.examples.test_profiles import load
from tests.unit.proxy.conftest import ScriptedEngine


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


BILLING = "x-anthropic-billing-header: cc_version=2.1.197.abc; cc_entrypoint=sdk-cli;"


def test_billing_header_line_is_dropped_from_system_messages_only():
    messages = [
        {"role": "system", "content": f"{BILLING}\nYou are a Claude agent.\nBe brief."},
        {"role": "user", "content": f"{BILLING} is just text here"},
    ]
    before = copy.deepcopy(messages)
    out = StripAnthropicBillingHeader()(messages)
    assert out[0]["content"] == "You are a Claude agent.\nBe brief."
    assert out[1] == messages[1]  # user text is left alone
    assert messages == before  # the input is not mutated
    blocks = [{"role": "system", "content": [{"type": "text", "text": BILLING}]}]
    assert StripAnthropicBillingHeader()(blocks)[0]["content"] == [{"type": "text", "text": ""}]


def test_system_reminders_are_removed_everywhere():
    text = (
        "<system-reminder>\nToday's date is 2026-11-29.\n</system-reminder>\n"
        "Fix the bug<system-reminder>todo nag</system-reminder> in a.py"
    )
    messages = [
        {"role": "user", "content": text},
        {"role": "tool", "tool_call_id": "t1", "content": "ok<system-reminder>x</system-reminder>"},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]
    out = StripAllSystemReminders()(messages)
    assert out[0]["content"] == "Fix the bug in a.py"
    assert out[1]["content"] == "ok"
    assert out[2] == messages[2]
    assert "<system-reminder>" in messages[0]["content"]  # input untouched


def test_cache_control_is_removed_at_any_depth():
    messages = [
        {
            "role": "user",
            "cache_control": {"type": "ephemeral"},
            "content": [
                {"type": "image", "source": {"data": "x"}, "cache_control": {"type": "ephemeral"}},
                {"type": "text", "text": "look", "cache_control": {"type": "ephemeral"}},
            ],
        }
    ]
    out = StripAnthropicCacheFields()(messages)
    assert "cache_control" not in json.dumps(out)
    assert out[0]["content"][1] == {"type": "text", "text": "look"}
    assert "cache_control" in json.dumps(messages)


def test_tool_call_arguments_become_one_canonical_json_text():
    def call(arguments):
        return {
            "id": "c1",
            "type": "function",
            "function": {"name": "bash", "arguments": arguments},
        }

    messages = [
        {"role": "assistant", "content": "", "tool_calls": [call({"cmd": "ls", "n": 1})]},
        {"role": "assistant", "content": "", "tool_calls": [call('{"cmd":"ls","n":1}')]},
        {"role": "assistant", "content": "", "tool_calls": [call('{"cmd":  "ls", "n": 1}')]},
        {"role": "assistant", "content": "", "tool_calls": [call("not json {")]},
        {"role": "user", "content": "hi"},
    ]
    out = NormalizeToolCallArguments()(messages)
    args = [m["tool_calls"][0]["function"]["arguments"] for m in out[:4]]
    assert args[0] == args[1] == args[2] == '{"cmd": "ls", "n": 1}'
    assert args[3] == "not json {"
    assert out[4] is messages[4]
    assert messages[0]["tool_calls"][0]["function"]["arguments"] == {"cmd": "ls", "n": 1}


def test_swe_prefix_matcher_rules():
    def assistant(content="", ids=("c1",), args="{}", thinking=None):
        calls = [{"id": i, "function": {"name": "bash", "arguments": args}} for i in ids]
        message = {"role": "assistant", "content": content, "tool_calls": calls}
        if thinking is not None:
            message["thinking"] = thinking
        return message

    user = {"role": "user", "content": "task"}
    tool = {"role": "tool", "tool_call_id": "c1", "content": "output v1"}
    prefix = [user, assistant(args='{"a": 1}'), tool]
    # tool results match on the call id; arguments may be serialized differently
    rerendered = [
        user,
        assistant(args='{"a":1}'),
        {**tool, "content": "output v2 (truncated)"},
        {"role": "user", "content": "next"},
    ]
    assert swe_prefix_matcher(prefix, rerendered)
    assert not swe_prefix_matcher(prefix, rerendered[:2])  # longer than the messages
    assert not swe_prefix_matcher([user], [{"role": "user", "content": "other"}])
    assert not swe_prefix_matcher([assistant(ids=("c1",))], [assistant(ids=("c2",))])
    assert not swe_prefix_matcher([assistant(thinking="a")], [assistant(thinking="b")])
    assert not swe_prefix_matcher([{**tool}], [{**tool, "tool_call_id": "c9"}])
    assert not swe_prefix_matcher([user], [{**user, "role": "system"}])
    assert swe_prefix_matcher([{"role": "assistant", "content": None}], [
        {"role": "assistant", "content": ""}])  # fmt: skip


def test_loading_plugins_by_path_and_clear_errors():
    loaded = load_message_preprocessors(["examples.swe.preprocessors.StripAllSystemReminders"])
    assert isinstance(loaded[0], StripAllSystemReminders)
    assert load_prefix_matcher(None) is None
    assert load_prefix_matcher("examples.swe.prefix_matchers.swe_prefix_matcher") is (
        swe_prefix_matcher
    )
    with pytest.raises(ValueError, match=r"rollout\.agent\.message_preprocessors: .*NoSuch"):
        load_message_preprocessors(["examples.swe.preprocessors.NoSuch"])
    with pytest.raises(ValueError, match=r"rollout\.agent\.message_preprocessors: .*no arguments"):
        load_message_preprocessors(["subprocess.Popen"])
    with pytest.raises(ValueError, match=r"rollout\.agent\.prefix_matcher: .*not callable"):
        load_prefix_matcher("examples.swe.preprocessors.BILLING_HEADER")
    with pytest.raises(ValueError, match=r"rollout\.agent\.prefix_matcher: .*no module"):
        load_prefix_matcher("nosuchpkg.matcher")


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "bash",
            "description": "Run a command",
            "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}},
        },
    }
]


async def _two_turns(tokenizer, preprocessors, matcher) -> tuple[ScriptedEngine, list]:
    """Claude-Code-like history: the 2nd call re-sends turn 1 with a new reminder and
    re-serialized tool arguments, plus the tool result."""
    engine = ScriptedEngine(
        tokenizer,
        ['<tool_call>\n{"name": "bash", "arguments": {"cmd": "ls"}}\n</tool_call>', "done"],
    )
    chat = ChatGenerator(
        engine,
        tokenizer,
        chat_template_type="concat",
        tool_call_parser=get_tool_call_parser("qwen25"),
        engine_max_tokens=4096,
        preprocessors=preprocessors,
    )
    cache = InteractionCache(matcher)

    def history(reminder: str) -> list[dict]:
        return [
            {"role": "system", "content": f"{BILLING}\nYou are a coding agent."},
            {"role": "user", "content": [
                {"type": "text", "text": f"<system-reminder>{reminder}</system-reminder>"},
                {"type": "text", "text": "list files", "cache_control": {"type": "ephemeral"}},
            ]},
        ]  # fmt: skip

    first = await chat.create(
        {"messages": history("date 2026-11-29"), "tools": TOOLS, "max_tokens": 32}, cache=cache
    )
    reply = first.message
    call = reply["tool_calls"][0]
    echoed = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{**call, "function": {**call["function"], "arguments": '{"cmd":"ls"}'}}],
    }
    second_messages = [
        *history("date 2026-11-30"),
        echoed,
        {"role": "tool", "tool_call_id": call["id"], "content": "a.py"},
    ]
    second = await chat.create(
        {"messages": second_messages, "tools": TOOLS, "max_tokens": 32}, cache=cache
    )
    return engine, [first.interaction, second.interaction]


@pytest.mark.asyncio
async def test_flash_v3_plugins_strip_noise_and_keep_the_trajectory_linked(tokenizer, profile_env):
    """The plugins the Flash V3 profile names, loaded by path, on a Claude-Code-like chat."""
    agent = load("arena_flash_v3.yaml").rollout.agent
    preprocessors = load_message_preprocessors(agent.message_preprocessors)
    matcher = load_prefix_matcher(agent.prefix_matcher)
    assert len(preprocessors) == 4

    engine, (first, second) = await _two_turns(tokenizer, preprocessors, matcher)
    for request in engine.requests:
        seen = tokenizer.decode(request.input_ids)
        assert "x-anthropic-billing-header" not in seen and "system-reminder" not in seen
        assert "list files" in seen and "You are a coding agent." in seen
    assert second.parent is first  # one trajectory: turn 2 continues turn 1's tokens
    assert engine.requests[1].input_ids[: len(first.sequence)] == first.sequence

    # without the plugins the changed reminder breaks the link
    _, (first, second) = await _two_turns(tokenizer, [], None)
    assert second.parent is None
