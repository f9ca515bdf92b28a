"""A tiny random Ling 3 (``BailingMoeV3ForCausalLM``) checkpoint, built offline.

It has every part of the flagship model at toy sizes: KDA and MLA layers alternating
(``layer_group_size=2``: layers 0 and 2 KDA, 1 and 3 MLA), a dense first layer, then
grouped-router MoE (4 routed experts in 2 groups, 1 group and 2 experts per token, 1
shared expert), no MTP layers. The directory is laid out as a real checkpoint: a
``config.json`` in the official spelling (``architectures: ["BailingMoeV3ForCausalLM"]``,
``model_type: bailing_hybrid``), the official weight names in ``model.safetensors``, a
generation config and the Ling 3 chat tokenizer (:func:`build_ling3_tokenizer`).

:func:`build_tool_calling_bailing_model` writes the same model fine-tuned on CPU to answer
the local Arena's claude-code Harness prompts with a Ling 3 ``submit`` tool call, for
end-to-end runs that must show tool calls parsed out of the policy's text.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path
from typing import Any

from areal.utils.tiny_model import build_ling3_tokenizer

__all__ = [
    "CLAUDE_CODE_SYSTEM",
    "CLAUDE_CODE_TOOLS",
    "SUBMIT_THOUGHT",
    "TINY_BAILING_SHAPE",
    "build_bailing_model",
    "build_tiny_bailing_model",
    "build_tool_calling_bailing_model",
    "submit_reply",
    "write_bailing_config",
]

# The config.json keys of the tiny model, in the official spelling.
TINY_BAILING_SHAPE: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    layer_group_size=2,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    head_dim=16,
    kv_lora_rank=32,
    q_lora_rank=None,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    num_experts=4,
    num_shared_experts=1,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
    num_nextn_predict_layers=0,
    short_conv_kernel_size=4,
    kda_safe_gate=True,
    kda_lower_bound=-5.0,
    hidden_act="silu",
    rms_norm_eps=1e-6,
    rope_theta=6000000.0,
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)


def write_bailing_config(path: str | os.PathLike[str], shape: dict[str, Any]) -> Path:
    """Write the official ``config.json`` of a Ling 3 model of ``shape`` (official key
    spelling; ``vocab_size`` defaults to the Ling 3 tokenizer's) and that tokenizer."""
    from areal.models import bailing

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_ling3_tokenizer()
    official = {
        "architectures": [bailing.OFFICIAL_ARCHITECTURE],
        "model_type": bailing.MODEL_TYPE,
        "vocab_size": len(tok),
        **shape,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.convert_tokens_to_ids("<|endoftext|>"),
        "bos_token_id": None,
        "dtype": "float32",
        "use_cache": True,
    }
    (out / "config.json").write_text(json.dumps(official, indent=2, sort_keys=True) + "\n")
    tok.save_pretrained(out)
    return out


def build_bailing_model(path: str | os.PathLike[str], shape: dict[str, Any], seed: int = 0) -> Path:
    """Write a random float32 Ling 3 checkpoint of ``shape``, as a real one is laid out:
    official config and weight names, generation config, the Ling 3 tokenizer."""
    out = write_bailing_config(path, shape)
    _save_bailing_weights(_random_bailing_model(out, seed), out)
    return out


def _random_bailing_model(out: Path, seed: int):
    """The float32 HF model of the config at ``out``, randomly initialized from ``seed``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(out)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # a zero bias would leave the router's correction term untested
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.uniform_(-0.05, 0.05)
    return model


def _save_bailing_weights(model: Any, out: Path) -> None:
    """``model.safetensors`` in the official weight names, and the generation config (EOS:
    ``<|role_end|>`` and padding)."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from areal.models import bailing

    state = bailing.to_official_state_dict(model.state_dict())
    save_file(
        {k: v.detach().contiguous() for k, v in state.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    eos, pad = model.config.eos_token_id, model.config.pad_token_id
    GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad).save_pretrained(out)


def build_tiny_bailing_model(path: str | os.PathLike[str], seed: int = 0) -> Path:
    """A random tiny Ling 3 checkpoint (:data:`TINY_BAILING_SHAPE`) with the Ling 3
    tokenizer at ``path``. Weights are float32 (the CPU tests compare packed and
    per-sequence forwards to 1e-5). Returns the path."""
    return build_bailing_model(path, TINY_BAILING_SHAPE, seed)


# --- a tiny Ling 3 taught to call submit ---

# The local Arena's claude-code Harness (examples/swe/local_arena/harnesses/builtin.py):
# its default system prompt, and its tools as the rollout proxy hands them to the chat
# template (Anthropic tool definitions converted to OpenAI function tools, keys in that order).
CLAUDE_CODE_SYSTEM = (
    "Solve the task. You may call Bash, which runs a shell command in a scratch directory "
    "without network access (timeout in milliseconds). When you know the answer, call "
    "submit with only the final answer."
)
CLAUDE_CODE_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "Bash",
            "parameters": {
                "type": "object",
                "properties": {
                    "command": {"type": "string", "description": "the command to run"},
                    "timeout": {
                        "type": "integer",
                        "description": "optional timeout in milliseconds",
                    },
                    "description": {"type": "string", "description": "what the command does"},
                },
                "required": ["command"],
            },
            "description": "Run a bash command and return its stdout and stderr.",
        },
    },
    {
        "type": "function",
        "function": {
            "name": "submit",
            "parameters": {
                "type": "object",
                "properties": {"answer": {"type": "string", "description": "the final answer"}},
                "required": ["answer"],
            },
            "description": "Submit the final answer; this ends the task.",
        },
    },
]
SUBMIT_THOUGHT = "I will submit the answer."

# The teaching run, sized so that the whole build takes about 35 s on two CPU cores.
_TEACH_STEPS = 100
_TEACH_REPLIES = 32  # replies to one prompt per step
_TEACH_LR = 1e-2
# Logits are divided by this in the loss, so sampling at temperature 1 squares the taught
# distribution (renormalized): the format's tokens become near certain (a few stray
# samples in a hundred become about none), digits stay equally likely, and the choice to
# end the answer is made more often than taught (see _submit_completion).
_TEACH_TEMPERATURE = 2.0
# The reference (PyTorch) KDA kernel pads every sequence to a whole number of chunks and
# loops over a chunk's positions; 16 instead of the default 64 makes the short training
# rows three times cheaper, with the same result.
_KDA_CHUNK = 16


def submit_reply(answer: str) -> str:
    """The Ling 3 text of a reply that thinks :data:`SUBMIT_THOUGHT` and calls ``submit``
    with ``answer`` (the end-of-turn token not included)."""
    return (
        f"<think>\n{SUBMIT_THOUGHT}\n</think>\n<tool_call>submit\n"
        f"<arg_key>answer</arg_key>\n<arg_value>{answer}</arg_value>\n</tool_call>"
    )


def _arithmetic_question(rng: random.Random) -> str:
    """A question in the styles of the local Arena's arithmetic datasets."""
    a, b, c = (rng.randint(1, 10 ** rng.randint(1, 4)) for _ in range(3))
    op, op2 = rng.choice("+-*"), rng.choice("+-*")
    question = rng.choice(
        [
            f"What is {a} {op} {b}?",
            f"What is {a} {op} {b} {op2} {c}?",
            f"What is {a} divided by {b}?",
            f"What is the remainder when {a} is divided by {b}?",
            f"What is {a % 10 + 2} to the power of {b % 20 + 1}?",
            f"Tom has {a} apples and buys {b} more. How many apples does he have?",
            f"A train travels {a} km every hour for {b} hours. How many km does it travel?",
            f"A school orders {a} boxes of {b} pencils and hands out {c} pencils. "
            "How many pencils are left?",
        ]
    )
    return question + " Answer with a number."


def _submit_prompt(tokenizer: Any, rng: random.Random) -> list[int]:
    """A question rendered as the claude-code Harness's requests are: with its system
    prompt or none, both tools, and the generation prompt."""
    messages = [{"role": "user", "content": _arithmetic_question(rng)}]
    if rng.random() < 0.5:
        messages.insert(0, {"role": "system", "content": CLAUDE_CODE_SYSTEM})
    text = tokenizer.apply_chat_template(
        messages, tools=CLAUDE_CODE_TOOLS, add_generation_prompt=True, tokenize=False
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _submit_completion(tokenizer: Any, rng: random.Random) -> list[int]:
    """A ``submit`` reply of 1 to 4 random digits (no leading zero), ending with EOS."""
    # Four digits taught half the time: sampled at temperature 1 (see _TEACH_TEMPERATURE)
    # the lengths 1 to 4 then come out about equally often.
    length = rng.choice((1, 2, 3, 4, 4, 4))
    digits = str(rng.randint(0 if length == 1 else 10 ** (length - 1), 10**length - 1))
    head, tail = submit_reply("{}").split("{}")
    # One token per digit (the tokenizer would merge some, e.g. "77"): the same text, and a
    # model that counts digits by tokens learns to stop after at most four.
    return (
        tokenizer(head, add_special_tokens=False)["input_ids"]
        + tokenizer.convert_tokens_to_ids(list(digits))
        + tokenizer(tail, add_special_tokens=False)["input_ids"]
        + [tokenizer.eos_token_id]
    )


def _prompt_head_cache(model: Any, head: list[int], batch: int) -> Any:
    """The cache of ``head`` (run once, without gradient) repeated for ``batch`` rows,
    which a training forward reads but leaves as it is."""
    import torch
    from transformers import DynamicCache

    class HeadCache(DynamicCache):
        # A KDA layer writes its last recurrent state back in place, over the state it
        # read, which backward still needs; once the head is in, nothing is written.
        filled = False

        def update_recurrent_state(self, states: Any, layer_idx: int, *args, **kwargs) -> Any:
            if self.filled:
                return states
            return super().update_recurrent_state(states, layer_idx, *args, **kwargs)

    cache = HeadCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.tensor([head]), cache=cache, use_cache=True, chunk_size=_KDA_CHUNK)
    cache.reorder_cache(torch.zeros(batch, dtype=torch.long))
    cache.filled = True
    return cache


def _teach_submit_calls(model: Any, tokenizer: Any, seed: int) -> None:
    """Fine-tune ``model`` in place to answer :func:`_submit_prompt` prompts with
    :func:`_submit_completion` replies, loss on the replies only.

    A step takes one prompt and a batch of replies to it. The prompt (system prompt,
    tools, question: hundreds of tokens) runs once, without gradient, and only the replies
    run forward and backward, from its cache: that keeps the build within a minute on two
    CPU cores. The replies still see the whole prompt; only no gradient flows back into
    the prompt's activations.
    """
    import torch

    rng = random.Random(seed)
    torch.manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=_TEACH_LR, weight_decay=0.0)
    # Constant, then down to zero over the last 30 % of the steps.
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (_TEACH_STEPS - step) / (0.3 * _TEACH_STEPS))
    )
    model.train()
    for _ in range(_TEACH_STEPS):
        prompt = _submit_prompt(tokenizer, rng)
        replies = [_submit_completion(tokenizer, rng) for _ in range(_TEACH_REPLIES)]
        cache = _prompt_head_cache(model, prompt[:-1], len(replies))
        # Each row: the prompt's last token, then a reply, right-padded (in a causal model
        # the padding after a row changes none of its labels).
        width = 1 + max(map(len, replies))
        input_ids = torch.full((len(replies), width), tokenizer.pad_token_id)
        input_ids[:, 0] = prompt[-1]
        labels = torch.full((len(replies), width), -100)
        for row, reply in enumerate(replies):
            input_ids[row, 1 : 1 + len(reply)] = torch.tensor(reply)
            labels[row, 1 : 1 + len(reply)] = torch.tensor(reply)
        logits = model(input_ids=input_ids, cache=cache, chunk_size=_KDA_CHUNK).logits
        loss = torch.nn.functional.cross_entropy(  # position t predicts token t + 1
            (logits[:, :-1] / _TEACH_TEMPERATURE).flatten(0, 1),
            labels[:, 1:].flatten(),
            ignore_index=-100,
        )
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
    model.eval()


def build_tool_calling_bailing_model(path: str | os.PathLike[str], seed: int = 0) -> Path:
    """The tiny Ling 3 checkpoint of :func:`build_tiny_bailing_model`, fine-tuned (on CPU,
    in under a minute) to answer a claude-code Harness prompt with a ``submit`` call.

    Sampled at temperature 1, its reply to an arithmetic question rendered with
    :data:`CLAUDE_CODE_TOOLS` is almost always ``submit_reply(DIGITS)`` then
    ``<|role_end|>``, where DIGITS is 1 to 4 random digits: answers that differ in value
    and length, so that a group of samples gets different rewards. Deterministic for a
    ``seed``; laid out and float32 as :func:`build_bailing_model` writes. Returns the path.
    """
    from transformers import AutoTokenizer

    out = write_bailing_config(path, TINY_BAILING_SHAPE)
    model = _random_bailing_model(out, seed)
    _teach_submit_calls(model, AutoTokenizer.from_pretrained(out), seed)
    _save_bailing_weights(model, out)
    return out
