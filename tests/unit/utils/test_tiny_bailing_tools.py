"""The tool-calling tiny Ling 3 checkpoint answers claude-code Harness prompts with a
``submit`` call that the rollout proxy parses.

Prompts are rendered as the local Arena's ``claude-code@builtin-1.0.0`` Harness's requests
reach the policy: its Anthropic Messages body (system prompt, the question, ``Bash`` and
``submit``), converted by the proxy's Anthropic adapter and rendered with the chat template
and the generation prompt. Completions are sampled at temperature 1 over the whole
vocabulary, decoded and parsed as the proxy does (stop tokens dropped, special tokens kept,
the ``ling3`` reasoning parser, then the ``ling3`` tool-call parser).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from areal.proxy.adapters.anthropic import messages_to_chat
from areal.proxy.parsers import get_reasoning_parser, get_tool_call_parser, process_tool_calls
from areal.utils.tiny_bailing import CLAUDE_CODE_SYSTEM, CLAUDE_CODE_TOOLS
from examples.swe.local_arena.harnesses.builtin import TOOLSETS
from examples.swe.local_arena.harnesses.llm import AnthropicWire

# From the arith-claude-code Stream's dataset (arithmetic_multistep.jsonl): none of them
# is a training prompt.
QUESTIONS = [
    "What is 37 * 48? Answer with a number.",
    "A school orders 24 boxes of 36 pencils and hands out 150 pencils. How many pencils "
    "are left? Answer with a number.",
    "What is 2 to the power of 20? Answer with a number.",
]
SAMPLES_PER_QUESTION = 8
DIGITS = re.compile(r"[0-9]{1,4}")


def harness_chat(question: str) -> dict:
    """The chat request the proxy makes of the claude-code Harness's first LLM call."""
    tools, system = TOOLSETS["claude-code"]
    wire = AnthropicWire()
    return messages_to_chat(wire.body("policy", system, wire.start(system, question), tools, {}))


def test_the_model_is_taught_the_prompts_the_claude_code_harness_sends():
    chat = harness_chat(QUESTIONS[0])
    assert chat["messages"][0] == {"role": "system", "content": CLAUDE_CODE_SYSTEM}
    assert chat["tools"] == CLAUDE_CODE_TOOLS


@pytest.fixture(scope="module")
def sampled_replies(bailing_tool_model_dir) -> list[tuple[list[int], dict]]:
    """``(generated ids, chat request)`` for each sample, SAMPLES_PER_QUESTION a question."""
    tokenizer = AutoTokenizer.from_pretrained(bailing_tool_model_dir)
    model = AutoModelForCausalLM.from_pretrained(bailing_tool_model_dir).eval()
    torch.manual_seed(0)
    samples = []
    for question in QUESTIONS:
        chat = harness_chat(question)
        text = tokenizer.apply_chat_template(
            chat["messages"], tools=chat["tools"], add_generation_prompt=True, tokenize=False
        )
        prompt = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])
        with torch.no_grad():
            output = model.generate(
                prompt,
                do_sample=True,
                temperature=1.0,
                top_k=0,  # the whole distribution, as the rollout engine samples it
                top_p=1.0,
                max_new_tokens=64,
                num_return_sequences=SAMPLES_PER_QUESTION,
            )
        samples.extend((row, chat) for row in output[:, prompt.shape[1] :].tolist())
    return samples


def parsed_answer(tokenizer, generated: list[int], chat: dict) -> str | None:
    """The ``answer`` of the one ``submit`` call in a reply that ended at EOS, else None."""
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    if eos not in generated:
        return None
    end = generated.index(eos)
    if any(token != pad for token in generated[end + 1 :]):  # generate pads finished rows
        return None
    text = tokenizer.decode(generated[:end], skip_special_tokens=False)
    calls, _, finish_reason = process_tool_calls(
        text,
        chat["tools"],
        get_tool_call_parser("ling3"),
        get_reasoning_parser("ling3"),
        "stop",
    )
    if finish_reason != "tool_calls" or not calls or len(calls) != 1:
        return None
    function = calls[0]["function"]
    arguments = json.loads(function["arguments"])
    if function["name"] != "submit" or list(arguments) != ["answer"]:
        return None
    answer = arguments["answer"]
    return answer if isinstance(answer, str) and DIGITS.fullmatch(answer) else None


def test_sampled_replies_are_submit_calls_of_varied_answers(
    bailing_tool_model_dir, sampled_replies
):
    tokenizer = AutoTokenizer.from_pretrained(bailing_tool_model_dir)
    answers = [parsed_answer(tokenizer, row, chat) for row, chat in sampled_replies]
    good = [a for a in answers if a is not None]
    assert len(answers) == 24
    assert len(good) >= 0.9 * len(answers), answers
    # Each question is a GRPO group: its answers must differ in value and in length.
    for start in range(0, len(answers), SAMPLES_PER_QUESTION):
        group = [a for a in answers[start : start + SAMPLES_PER_QUESTION] if a is not None]
        assert len(set(group)) > 1, group
        assert len({len(a) for a in group}) > 1, group


def test_the_checkpoint_is_a_ling3_one(bailing_tool_model_dir):
    config = json.loads((bailing_tool_model_dir / "config.json").read_text())
    assert config["architectures"] == ["BailingMoeV3ForCausalLM"]
    assert config["dtype"] == "float32"
