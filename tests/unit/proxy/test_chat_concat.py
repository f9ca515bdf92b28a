"""Concat-mode prompts: tokenizing only the new tail equals re-tokenizing the whole chat."""

from __future__ import annotations

import json

import pytest

from areal.proxy.chat import ChatGenerator
from areal.proxy.interaction import InteractionCache
from areal.proxy.parsers import get_tool_call_parser
from tests.unit.proxy.conftest import ScriptedEngine

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file",
            "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
        },
    }
]
REPLIES = [
    "Let me look.",
    '<tool_call>\n{"name": "read_file", "arguments": {"path": "a.py"}}\n</tool_call>',
    "  leading spaces and a trailing newline\n",
    "Done: ünïcode ✓",
]


def tail_after_kth_eos(tokens: list[int], eos: int, k: int) -> list[int]:
    positions = [i for i, t in enumerate(tokens) if t == eos]
    return tokens[positions[k - 1] + 1 :]


@pytest.mark.asyncio
async def test_concat_tail_matches_a_full_retokenization(tokenizer):
    engine = ScriptedEngine(tokenizer, REPLIES)
    chat = ChatGenerator(
        engine,
        tokenizer,
        chat_template_type="concat",
        tool_call_parser=get_tool_call_parser("qwen25"),
        engine_max_tokens=4096,
    )
    cache = InteractionCache()
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Fix the bug in a.py"},
    ]
    for turn in range(len(REPLIES)):
        body = {"messages": messages, "tools": TOOLS, "max_tokens": 64, "temperature": 1.0}
        result = await chat.create(body, cache=cache)
        interaction = result.interaction
        if turn:
            parent = interaction.parent
            assert parent is not None, f"turn {turn} lost its parent"
            head = parent.sequence
            assert result.prompt_tokens[: len(head)] == head
            # the fast path must agree with tokenizing the whole re-rendered conversation
            full = chat.render(messages, TOOLS, None)
            k = head.count(tokenizer.eos_token_id)
            assert result.prompt_tokens[len(head) :] == tail_after_kth_eos(
                full, tokenizer.eos_token_id, k
            )
        reply = result.message
        follow = (
            {"role": "tool", "tool_call_id": reply["tool_calls"][0]["id"], "content": "x = 1\n"}
            if reply.get("tool_calls")
            else {"role": "user", "content": f"Next step {turn + 2}?"}
        )
        messages = [*messages, reply, follow]
    assert any(json.dumps(m).count("tool_calls") for m in messages)


@pytest.mark.parametrize(
    "text",
    ["", "plain words", "<|im_start|>user\nhi<|im_end|>\n", "  déjà\tvu ✓\n\n", '{"a": [1]}'],
)
def test_fast_encoder_matches_the_tokenizer(tokenizer, text):
    chat = ChatGenerator(ScriptedEngine(tokenizer), tokenizer)
    assert chat._encode is not None, "a plain fast tokenizer should take the backend path"
    assert chat.encode(text) == tokenizer(text, add_special_tokens=False)["input_ids"]


def test_special_token_splitting_keeps_the_tokenizer_path(tiny_model_dir):
    from transformers import AutoTokenizer

    splitting = AutoTokenizer.from_pretrained(tiny_model_dir, split_special_tokens=True)
    chat = ChatGenerator(ScriptedEngine(splitting), splitting)
    assert chat._encode is None
    text = "<|im_start|>user\nhi<|im_end|>"
    assert chat.encode(text) == splitting(text, add_special_tokens=False)["input_ids"]
