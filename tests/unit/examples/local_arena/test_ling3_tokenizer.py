"""The offline Ling 3 tokenizer and chat template (areal/utils/tiny_model.py).

The rollout proxy renders every prompt with the chat template and records the engine's
tokens, so the properties checked here are the ones it relies on: each tag is one id in
both directions, a conversation renders in Ling 3's turn layout, and a conversation
re-rendered after a reply starts with the prompt's tokens followed by the reply's own.
"""

from __future__ import annotations

from typing import Any

import pytest
from transformers import AutoTokenizer

from areal.utils.tiny_model import LING3_ROLE_TOKENS, LING3_SPECIAL_TOKENS, LING3_TAG_TOKENS

ALL_TAGS = LING3_SPECIAL_TOKENS + LING3_ROLE_TOKENS + LING3_TAG_TOKENS

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "Bash",
            "description": "Run a command.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
                "required": ["command"],
            },
        },
    }
]
PROMPT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 37 * 48?"},
]
# What the policy writes for its first turn, and the message the proxy records for it:
# the think block stays inline in the content, the call becomes typed arguments.
REPLY_TEXT = (
    "<think>\nUse the shell.\n</think>\n<tool_call>Bash\n<arg_key>command</arg_key>\n"
    "<arg_value>echo $((37 * 48))</arg_value>\n<arg_key>timeout</arg_key>\n"
    "<arg_value>5000</arg_value>\n</tool_call>"
)
REPLY = {
    "role": "assistant",
    "content": "<think>\nUse the shell.\n</think>",
    "tool_calls": [
        {
            "id": "call_1",
            "type": "function",
            "function": {
                "name": "Bash",
                "arguments": {"command": "echo $((37 * 48))", "timeout": 5000},
            },
        }
    ],
}
TOOL_RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "1776"}


def ids(encoded: Any) -> list[int]:
    """``apply_chat_template(..., tokenize=True)`` gives a BatchEncoding in transformers 5."""
    return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def encode(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@pytest.mark.parametrize("tag", ALL_TAGS)
def test_every_tag_is_one_id_both_ways(ling3_tokenizer, tag) -> None:
    tag_id = ling3_tokenizer.convert_tokens_to_ids(tag)
    assert tag_id != ling3_tokenizer.unk_token_id and isinstance(tag_id, int)
    assert encode(ling3_tokenizer, tag) == [tag_id]
    # inside text, glued to its neighbours, the tag still splits off as its own id
    around = encode(ling3_tokenizer, f"x1{tag}y2")
    assert around.count(tag_id) == 1
    assert ling3_tokenizer.decode(around) == f"x1{tag}y2"
    assert ling3_tokenizer.decode([tag_id]) == tag


def test_end_of_turn_and_padding(ling3_tokenizer) -> None:
    assert ling3_tokenizer.eos_token == "<|role_end|>"
    assert ling3_tokenizer.pad_token == "<|endoftext|>"
    assert len({ling3_tokenizer.convert_tokens_to_ids(t) for t in ALL_TAGS}) == len(ALL_TAGS)
    # role markers are structure (dropped when skipping special tokens); content tags stay
    text = "<role>HUMAN</role><think>a</think><tool_call>b</tool_call><|role_end|>"
    assert (
        ling3_tokenizer.decode(encode(ling3_tokenizer, text), skip_special_tokens=True)
        == "HUMAN<think>a</think><tool_call>b</tool_call>"
    )


def test_multi_turn_conversation_renders_in_the_ling3_layout(ling3_tokenizer) -> None:
    final = {"role": "assistant", "content": "<think>\nIt printed 1776.\n</think>\n1776"}
    text = ling3_tokenizer.apply_chat_template(
        [*PROMPT, REPLY, TOOL_RESULT, {**TOOL_RESULT, "content": "done"}, final],
        tools=TOOLS,
        tokenize=False,
    )
    schema = (
        '{"name": "Bash", "description": "Run a command.", "parameters": {"type": "object", '
        '"properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}}, '
        '"required": ["command"]}}'
    )
    assert text == (
        "<role>SYSTEM</role>Be brief.\n\n# Tools\nCall a tool by answering <tool_call>NAME\n"
        "<arg_key>ARGUMENT</arg_key>\n<arg_value>VALUE</arg_value>\n</tool_call>, one key and "
        "value pair per argument. The tools, one JSON schema a line:\n<tools>\n"
        f"{schema}\n</tools><|role_end|>"
        "<role>HUMAN</role>What is 37 * 48?<|role_end|>"
        f"<role>ASSISTANT</role>{REPLY_TEXT}<|role_end|>"
        # consecutive tool results share one observation turn
        "<role>OBSERVATION</role>\n<tool_response>\n1776\n</tool_response>"
        "\n<tool_response>\ndone\n</tool_response><|role_end|>"
        "<role>ASSISTANT</role><think>\nIt printed 1776.\n</think>\n1776<|role_end|>"
    )
    assert ling3_tokenizer.decode(encode(ling3_tokenizer, text)) == text


def test_several_calls_and_reasoning_content(ling3_tokenizer) -> None:
    message = {
        "role": "assistant",
        "content": "",
        "reasoning_content": "two steps",
        "tool_calls": [
            {"function": {"name": "f", "arguments": {"a": "x", "b": [1, 2], "c": True}}},
            {"function": {"name": "g", "arguments": {}}},
        ],
    }
    text = ling3_tokenizer.apply_chat_template([message], tokenize=False)
    assert text == (
        "<role>ASSISTANT</role><think>two steps</think>\n<tool_call>f\n"
        "<arg_key>a</arg_key>\n<arg_value>x</arg_value>\n"
        "<arg_key>b</arg_key>\n<arg_value>[1, 2]</arg_value>\n"
        "<arg_key>c</arg_key>\n<arg_value>true</arg_value>\n</tool_call>"
        "\n<tool_call>g\n</tool_call><|role_end|>"
    )


def test_generation_prompt_and_system_less_render(ling3_tokenizer) -> None:
    text = ling3_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert text == "<role>HUMAN</role>hi<|role_end|><role>ASSISTANT</role>"


def test_re_rendered_conversation_extends_the_prompt_with_the_reply_tokens(
    ling3_tokenizer,
) -> None:
    prompt = ids(
        ling3_tokenizer.apply_chat_template(
            PROMPT, tools=TOOLS, add_generation_prompt=True, tokenize=True
        )
    )
    generated = [*encode(ling3_tokenizer, REPLY_TEXT), ling3_tokenizer.eos_token_id]
    after_reply = ids(ling3_tokenizer.apply_chat_template([*PROMPT, REPLY], tools=TOOLS))
    assert after_reply == prompt + generated
    # and so does the next prompt, after the tool result
    following = ids(
        ling3_tokenizer.apply_chat_template(
            [*PROMPT, REPLY, TOOL_RESULT], tools=TOOLS, add_generation_prompt=True
        )
    )
    assert following[: len(prompt) + len(generated)] == prompt + generated


def test_the_saved_model_directory_reloads_the_same_tokenizer(
    ling3_tokenizer, ling3_model_dir
) -> None:
    reloaded = AutoTokenizer.from_pretrained(ling3_model_dir)
    assert len(reloaded) == len(ling3_tokenizer)
    assert reloaded.chat_template == ling3_tokenizer.chat_template
    assert reloaded.eos_token_id == ling3_tokenizer.eos_token_id
    conversation = [*PROMPT, REPLY, TOOL_RESULT]
    expected = ids(ling3_tokenizer.apply_chat_template(conversation, tools=TOOLS))
    assert ids(reloaded.apply_chat_template(conversation, tools=TOOLS)) == expected
