"""Tiny Qwen-style models and BPE tokenizers built offline (tests, benchmarks, smoke runs).

Nothing here touches a model hub: the tokenizer is trained in a fraction of a second on
text that ships with Python itself, and the model is randomly initialized from a config.
``build_tiny_model(dir)`` writes a directory that ``AutoModelForCausalLM`` and
``AutoTokenizer`` load like any checkpoint, with a chat template that renders system,
user, assistant, tool calls and tool results the way Qwen models do.

``build_ling3_tokenizer()`` is the same kind of tokenizer in the Ling 3 (``BailingMoeV3``)
chat format, for the ``ling3`` tool-call and reasoning parsers; ``build_tiny_model(dir,
tokenizer="ling3")`` writes a model with it. See :data:`LING3_CHAT_TEMPLATE`.
"""

from __future__ import annotations

import json
import os
import sysconfig
from pathlib import Path
from typing import Any, Literal

__all__ = [
    "CHAT_TEMPLATE",
    "LING3_CHAT_TEMPLATE",
    "LING3_ROLE_TOKENS",
    "LING3_SPECIAL_TOKENS",
    "LING3_TAG_TOKENS",
    "QWEN2_05B_SHAPE",
    "SPECIAL_TOKENS",
    "TAG_TOKENS",
    "build_ling3_tokenizer",
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


def _byte_level_bpe(vocab_size: int, special_tokens: list[str], texts: list[str]):
    """A byte-level BPE ``tokenizers.Tokenizer`` trained on ``texts``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer=trainer)
    return bpe


def build_tokenizer(vocab_size: int = 1024):
    """A byte-level BPE ``PreTrainedTokenizerFast`` with Qwen-style special tokens."""
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    bpe = _byte_level_bpe(vocab_size, SPECIAL_TOKENS, _corpus())
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


# --- Ling 3 ---

# Trained as special tokens: padding and the end of every turn (the model's EOS).
LING3_SPECIAL_TOKENS = ["<|endoftext|>", "<|role_end|>"]
# Added after training, one id each: the role markers are special (structure only, dropped
# by skip_special_tokens); the content tags are not, so a decoded reply keeps them.
LING3_ROLE_TOKENS = ["<role>", "</role>"]
LING3_TAG_TOKENS = [
    "<think>",
    "</think>",
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
    "<tool_response>",
    "</tool_response>",
]

# Ling 3's turn layout, with no text between turns:
#   <role>SYSTEM</role>{system}[tools block]<|role_end|>
#   <role>HUMAN</role>{user}<|role_end|>
#   <role>ASSISTANT</role>{content}[\n]<tool_call>NAME\n
#       <arg_key>K</arg_key>\n<arg_value>V</arg_value>\n</tool_call><|role_end|>
#   <role>OBSERVATION</role>\n<tool_response>\n{result}\n</tool_response><|role_end|>
# An assistant turn is rendered exactly as the model writes it (reasoning stays inline in
# the content as <think>...</think>; string values bare, others as JSON), so a conversation
# re-rendered after a reply holds the generated tokens unchanged. Consecutive tool results
# share one OBSERVATION turn. The generation prompt is <role>ASSISTANT</role>.
LING3_CHAT_TEMPLATE = (
    r"""{%- macro text(content) -%}{%- if content is string -%}{{ content }}"""
    r"""{%- elif content is not none -%}{%- for part in content -%}"""
    r"""{%- if part.type == 'text' -%}{{ part.text }}{%- endif -%}{%- endfor -%}"""
    r"""{%- endif -%}{%- endmacro -%}"""
    r"""{%- macro value(v) -%}{%- if v is string -%}{{ v }}{%- else -%}{{ v | tojson }}"""
    r"""{%- endif -%}{%- endmacro -%}"""
    r"""{%- set ns = namespace(offset=0, system='') -%}"""
    r"""{%- if messages and messages[0].role == 'system' -%}"""
    r"""{%- set ns.system = text(messages[0].content) -%}{%- set ns.offset = 1 -%}{%- endif -%}"""
    r"""{%- if ns.system or tools -%}{{- '<role>SYSTEM</role>' + ns.system -}}"""
    r"""{%- if tools -%}{{- ('\n\n' if ns.system else '') + '# Tools\nCall a tool by """
    r"""answering <tool_call>NAME\n<arg_key>ARGUMENT</arg_key>\n<arg_value>VALUE</arg_value>"""
    r"""\n</tool_call>, one key and value pair per argument. The tools, one JSON schema a """
    r"""line:\n<tools>' -}}"""
    r"""{%- for tool in tools -%}"""
    r"""{{- '\n' + ((tool.function if tool.function is defined else tool) | tojson) -}}"""
    r"""{%- endfor -%}{{- '\n</tools>' -}}{%- endif -%}{{- '<|role_end|>' -}}{%- endif -%}"""
    r"""{%- set rest = messages[ns.offset:] -%}"""
    r"""{%- for message in rest -%}"""
    r"""{%- if message.role == 'tool' -%}"""
    r"""{%- if loop.first or rest[loop.index0 - 1].role != 'tool' -%}"""
    r"""{{- '<role>OBSERVATION</role>' -}}{%- endif -%}"""
    r"""{{- '\n<tool_response>\n' + text(message.content) + '\n</tool_response>' -}}"""
    r"""{%- if loop.last or rest[loop.index0 + 1].role != 'tool' -%}"""
    r"""{{- '<|role_end|>' -}}{%- endif -%}"""
    r"""{%- elif message.role == 'assistant' -%}{{- '<role>ASSISTANT</role>' -}}"""
    r"""{%- if message.reasoning_content -%}"""
    r"""{{- '<think>' + message.reasoning_content + '</think>' -}}{%- endif -%}"""
    r"""{{- text(message.content) -}}"""
    r"""{%- for call in message.tool_calls or [] -%}"""
    r"""{%- set fn = call.function if call.function is defined else call -%}"""
    r"""{%- if not loop.first or text(message.content) or message.reasoning_content -%}"""
    r"""{{- '\n' -}}{%- endif -%}{{- '<tool_call>' + fn.name + '\n' -}}"""
    r"""{%- if fn.arguments is mapping -%}{%- for key, v in fn.arguments.items() -%}"""
    r"""{{- '<arg_key>' + key + '</arg_key>\n<arg_value>' + value(v) + '</arg_value>\n' -}}"""
    r"""{%- endfor -%}{%- elif fn.arguments -%}{{- fn.arguments + '\n' -}}{%- endif -%}"""
    r"""{{- '</tool_call>' -}}{%- endfor -%}{{- '<|role_end|>' -}}"""
    r"""{%- else -%}"""
    r"""{{- '<role>' + ('HUMAN' if message.role == 'user' else message.role | upper) + """
    r"""'</role>' + text(message.content) + '<|role_end|>' -}}"""
    r"""{%- endif -%}{%- endfor -%}"""
    r"""{%- if add_generation_prompt -%}{{- '<role>ASSISTANT</role>' -}}{%- endif -%}"""
)


def _ling3_corpus() -> list[str]:
    """The tokenizer corpus plus Ling-3-shaped turns (role names, tool calls, arguments)."""
    turns = (
        "SYSTEM You are a helpful assistant. HUMAN What is 37 * 48? ASSISTANT "
        "I should compute it with the shell. Bash command echo $((37 * 48)) timeout 5000 "
        "description multiply OBSERVATION 1776 submit answer 1776 The answer is 1776. "
    )
    return _corpus() + [turns] * 50


def build_ling3_tokenizer(vocab_size: int = 1024):
    """A byte-level BPE ``PreTrainedTokenizerFast`` in the Ling 3 chat format.

    EOS is ``<|role_end|>`` (every turn ends with it), padding ``<|endoftext|>``; each of
    :data:`LING3_ROLE_TOKENS` and :data:`LING3_TAG_TOKENS` is one id, which encoding the
    string inside any text yields and decoding gives back.
    """
    from tokenizers import AddedToken
    from transformers import PreTrainedTokenizerFast

    bpe = _byte_level_bpe(vocab_size, LING3_SPECIAL_TOKENS, _ling3_corpus())
    bpe.add_special_tokens([AddedToken(t, normalized=False) for t in LING3_ROLE_TOKENS])
    bpe.add_tokens([AddedToken(t, special=False, normalized=False) for t in LING3_TAG_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|role_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        padding_side="left",
    )
    tokenizer.chat_template = LING3_CHAT_TEMPLATE
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


def tiny_model_config(
    *,
    arch: str = "qwen3",
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate_size: int = 128,
    max_position_embeddings: int = 2048,
    vocab_size: int | None = None,
    tie_word_embeddings: bool = False,
    num_experts: int = 4,
    num_experts_per_tok: int = 2,
    tokenizer: Literal["qwen", "ling3"] = "qwen",
):
    """The HF config :func:`build_tiny_model` writes (arguments as there), and its
    tokenizer. ``head_dim`` defaults to ``hidden_size // num_heads`` (qwen3 and qwen3_moe;
    qwen2 derives it itself)."""
    from transformers import Qwen2Config, Qwen3Config, Qwen3MoeConfig

    if tokenizer not in ("qwen", "ling3"):
        raise ValueError(f"tokenizer must be 'qwen' or 'ling3', got {tokenizer!r}")
    tok = build_tokenizer() if tokenizer == "qwen" else build_ling3_tokenizer()
    eos = tok.eos_token_id
    pad = tok.convert_tokens_to_ids("<|endoftext|>")
    common = dict(
        vocab_size=vocab_size or len(tok),
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
    head_dim = head_dim or hidden_size // num_heads
    if arch == "qwen3":
        config = Qwen3Config(head_dim=head_dim, **common)
    elif arch == "qwen2":
        config = Qwen2Config(**common)
    elif arch == "qwen3_moe":
        config = Qwen3MoeConfig(
            head_dim=head_dim,
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
    return config, tok


def build_tiny_model(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    dtype: str = "float32",
    device: str = "cpu",
    **shape: Any,
) -> Path:
    """Write a randomly initialized model plus tokenizer to ``path``; returns the path.

    ``shape``: :func:`tiny_model_config`'s arguments. ``arch``: ``qwen3``, ``qwen2`` or
    ``qwen3_moe`` (every layer a mixture of ``num_experts`` experts of
    ``intermediate_size``, ``num_experts_per_tok`` routed per token, normalized top-k
    weights).

    ``vocab_size`` defaults to the tokenizer's size; a larger value (e.g. 151936 for a
    Qwen2-0.5B-shaped model) is allowed, the extra ids are simply never produced by the
    tokenizer.

    ``tokenizer``: ``qwen`` (:func:`build_tokenizer`) or ``ling3``
    (:func:`build_ling3_tokenizer`); the model's EOS is the tokenizer's end of turn.

    ``device``: where the weights are initialized (``cuda`` for multi-billion shapes,
    whose CPU init takes minutes).
    """
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config, tok = tiny_model_config(**shape)
    eos, pad = config.eos_token_id, config.pad_token_id
    arch = shape.get("arch", "qwen3")
    tokenizer = shape.get("tokenizer", "qwen")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config = GenerationConfig(eos_token_id=[eos, pad], pad_token_id=pad)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    info = {"arch": arch, "seed": seed}
    if tokenizer != "qwen":  # the qwen default leaves the file as it always was
        info["tokenizer"] = tokenizer
    (out / "tiny_model.json").write_text(json.dumps(info) + "\n")
    return out
