"""Tiny Qwen-style models and a BPE tokenizer built offline (tests, benchmarks, smoke runs).

Nothing here touches a model hub: the tokenizer is trained in a fraction of a second on
text that ships with Python itself, and the model is randomly initialized from a config.
``build_tiny_model(dir)`` writes a directory that ``AutoModelForCausalLM`` and
``AutoTokenizer`` load like any checkpoint, with a chat template that renders system,
user, assistant, tool calls and tool results the way Qwen models do.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path

__all__ = [
    "CHAT_TEMPLATE",
    "QWEN2_05B_SHAPE",
    "SPECIAL_TOKENS",
    "TAG_TOKENS",
    "build_tiny_model",
    "build_tokenizer",
]

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Added as ordinary (non-special) tokens, as Qwen does, so decoding keeps them.
TAG_TOKENS = [
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]

CHAT_TEMPLATE = (
    r"""{%- macro text(content) -%}{%- if content is string -%}{{ content }}"""
    r"""{%- elif content is not none -%}{%- for part in content -%}"""
    r"""{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}"""
    r"""{%- endif -%}{%- endmacro -%}"""
    r"""{%- set ns = namespace(offset=0, system='') -%}"""
    r"""{%- if messages and messages[0].role == 'system' -%}"""
    r"""{%- set ns.system = text(messages[0].content) -%}{%- set ns.offset = 1 -%}"""
    r"""{%- elif tools -%}{%- set ns.system = 'You are a helpful assistant.' -%}{%- endif -%}"""
    r"""{%- if ns.system or tools -%}{{- '<|im_start|>system\n' + ns.system -}}"""
    r"""{%- if tools -%}{{- '\n\n# Tools\nCall a function by answering with its name and """
    r"""JSON arguments inside <tool_call></tool_call> tags.\nAvailable functions, one JSON """
    r"""schema per line, inside <tools></tools>:\n<tools>' -}}"""
    r"""{%- for tool in tools -%}{{- '\n' + (tool | tojson) -}}{%- endfor -%}"""
    r"""{{- '\n</tools>' -}}{%- endif -%}{{- '<|im_end|>\n' -}}{%- endif -%}"""
    r"""{%- set rest = messages[ns.offset:] -%}"""
    r"""{%- for message in rest -%}"""
    r"""{%- if message.role == 'tool' -%}"""
    r"""{%- if loop.first or rest[loop.index0 - 1].role != 'tool' -%}"""
    r"""{{- '<|im_start|>user' -}}{%- endif -%}"""
    r"""{{- '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' -}}"""
    r"""{%- if loop.last or rest[loop.index0 + 1].role != 'tool' -%}"""
    r"""{{- '<|im_end|>\n' -}}{%- endif -%}"""
    r"""{%- elif message.role == 'assistant' -%}{{- '<|im_start|>assistant\n' -}}"""
    r"""{%- if message.reasoning_content -%}"""
    r"""{{- '<think>\n' + message.reasoning_content + '\n</think>\n\n' -}}{%- endif -%}"""
    r"""{{- text(message.content) -}}"""
    r"""{%- for call in message.tool_calls or [] -%}"""
    r"""{%- set fn = call.function if call.function is defined else call -%}"""
    r"""{%- if not loop.first or text(message.content) -%}{{- '\n' -}}{%- endif -%}"""
    r"""{{- '<tool_call>\n{"name": "' + fn.name + '", "arguments": ' + (fn.arguments """
    r"""if fn.arguments is string else (fn.arguments | tojson)) + '}\n</tool_call>' -}}"""
    r"""{%- endfor -%}{{- '<|im_end|>\n' -}}"""
    r"""{%- else -%}"""
    r"""{{- '<|im_start|>' + message.role + '\n' + text(message.content) + '<|im_end|>\n' -}}"""
    r"""{%- endif -%}{%- endfor -%}"""
    r"""{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"""
)


def _corpus() -> list[str]:
    """Local text to train the tokenizer on: stdlib sources plus chat-shaped strings."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    texts = []
    for rel in (
        "json/__init__.py",
        "json/decoder.py",
        "json/encoder.py",
        "textwrap.py",
        "email/message.py",
        "email/utils.py",
        "argparse.py",
        "string.py",
    ):
        path = stdlib / rel
        if path.is_file():
            texts.append(path.read_text(encoding="utf-8", errors="ignore"))
    chat = (
        "You are a helpful assistant. What is 12 + 30? The answer is 42. "
        'Call {"name": "run_python", "arguments": {"code": "print(6 * 7)"}} to check. '
        "def add(a, b):\n    return a + b\n\nassert add(2, 3) == 5\n"
    )
    texts.extend([chat] * 50)
    return texts


def build_tokenizer(vocab_size: int = 1024):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with Qwen-style special tokens."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(), trainer=trainer)
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        padding_side="left",
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


# Qwen2-0.5B's shape (random weights, built offline): GPU tests and benchmarks.
QWEN2_05B_SHAPE = dict(
    arch="qwen2",
    hidden_size=896,
    num_layers=24,
    num_heads=14,
    num_kv_heads=2,
    intermediate_size=4864,
    vocab_size=151936,
    max_position_embeddings=32768,
    tie_word_embeddings=True,
)


def build_tiny_model(
    path: str | os.PathLike[str],
    *,
    arch: str = "qwen3",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    vocab_size: int | None = None,
    seed: int = 0,
    dtype: str = "float32",
    tie_word_embeddings: bool = False,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
) -> Path:
    """Write a randomly initialized model plus tokenizer to ``path``; returns the path.

    ``arch``: ``qwen3``, ``qwen2`` or ``qwen3_moe`` (every layer a mixture of
    ``num_experts`` experts of ``intermediate_size``, ``num_experts_per_tok`` routed per
    token, normalized top-k weights).

    ``vocab_size`` defaults to the tokenizer's size; a larger value (e.g. 151936 for a
    Qwen2-0.5B-shaped model) is allowed, the extra ids are simply never produced by the
    tokenizer.
    """
    import torch
    from transformers import (
        AutoModelForCausalLM,
        GenerationConfig,
        Qwen2Config,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    pad = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    common = dict(
        vocab_size=vocab_size or len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        # Untied: a tiny tied model mostly copies its last input token under greedy decoding.
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=eos,
        pad_token_id=pad,
        bos_token_id=None,
    )
    if arch == "qwen3":
        config = Qwen3Config(head_dim=hidden_size // num_heads, **common)
    elif arch == "qwen2":
        config = Qwen2Config(**common)
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(
            head_dim=hidden_size // num_heads,
            num_experts=num_experts,
            num_experts_per_tok=num_experts_per_tok,
            moe_intermediate_size=intermediate_size,
            decoder_sparse_step=1,
            norm_topk_prob=True,
            mlp_only_layers=[],
            **common,
        )
    else:
        raise ValueError(f"arch must be 'qwen3', 'qwen2' or 'qwen3_moe', got {arch!r}")
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "tiny_model.json").write_text(json.dumps({"arch": arch, "seed": seed}) + "\n")
    return out
