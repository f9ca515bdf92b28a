"""The prompt-size bound's parts: a tokenizer's span, text measures, probes, the context.

Hand-built tokenizers make each number checkable by hand; the tiny test tokenizer's
longest token is a newline and 27 spaces (``Ċ`` and 27 ``Ġ``: 56 bytes of UTF-8 as the
vocabulary spells it, 28 bytes of text).
"""

from __future__ import annotations

from typing import Any

import pytest
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers

from areal.proxy.cli import server_context_length
from areal.proxy.prompt_size import PromptSizeBound, rendered_kinds
from tests.fakes.live_server import ScriptedASGI, serve
from tests.fakes.scripted_http import ScriptedHTTP, reply


def test_the_tiny_tokenizers_span_is_its_longest_token_in_bytes(tokenizer):
    bound = PromptSizeBound.of(tokenizer)
    assert bound is not None and bound.span == 28
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False)
    assert max(vocab, key=len) == "Ċ" + "Ġ" * 27
    # fewer than 200 tokens: at most 199 * 28 = 5,572 bytes
    assert bound.max_text_bytes(200) == 5572 and bound.min_tokens(5573) == 200


def hand_built(normalizer: Any = None, pre_tokenizer: Any = None, model: Any = None) -> Any:
    """A fast tokenizer from parts (``transformers`` wraps it as it wraps hub tokenizers)."""
    from transformers import PreTrainedTokenizerFast

    vocab = {"a": 0, "b": 1, "ab": 2, "<unk>": 3}
    backend = Tokenizer(model or models.BPE(vocab, [("a", "b")], unk_token="<unk>"))
    backend.normalizer = normalizer
    backend.pre_tokenizer = pre_tokenizer
    return PreTrainedTokenizerFast(tokenizer_object=backend)


def test_text_is_measured_as_the_tokenizers_model_sees_it():
    nfc = PromptSizeBound.of(hand_built(normalizers.NFC()))
    assert nfc is not None and nfc.span == 5  # the longest entry: "<unk>"
    assert nfc.text_bytes("abba" * 10) == 40  # ASCII: NFC leaves it as is
    # "e" + U+0301 (3 bytes) composes to "é" (2 bytes): 6,000 bytes, 4,000 after NFC, less
    # 64 bytes of slack at each end of the one chunk
    assert nfc.text_bytes("e\u0301" * 2000) == 4000 - 2 * 64
    plain = PromptSizeBound.of(hand_built())
    assert plain is not None and plain.text_bytes("e\u0301" * 2000) == 6000
    assert plain.content_bytes("  \n ab \t\n") == 2  # surrounding whitespace not counted
    assert plain.content_bytes("thinking</think>\n answer ", start=16) == 6


@pytest.mark.parametrize(
    "parts",
    [
        {"pre_tokenizer": pre_tokenizers.Whitespace()},  # drops whitespace
        {"model": models.WordPiece({"a": 0, "[UNK]": 1}, unk_token="[UNK]")},
        {"model": models.BPE({"a": 0, "<unk>": 1}, [], unk_token="<unk>", fuse_unk=True)},
        {"model": models.BPE({"a": 0}, [])},  # no unknown token: drops what it lacks
    ],
    ids=["whitespace-dropping", "wordpiece", "fused-unknowns", "bpe-dropping"],
)
def test_a_tokenizer_whose_token_may_stand_for_any_text_gets_no_bound(parts):
    assert PromptSizeBound.of(hand_built(**parts)) is None


def test_an_added_token_that_swallows_whitespace_leaves_no_bound():
    from tokenizers import AddedToken

    tokenizer = hand_built()
    assert PromptSizeBound.of(tokenizer) is not None
    tokenizer.add_special_tokens({"additional_special_tokens": [AddedToken("<x>", lstrip=True)]})
    assert PromptSizeBound.of(tokenizer) is None


def test_bytes_a_byte_level_model_has_no_symbol_for_are_not_counted():
    # byte 0x04 (a control character) is the symbol "Ą"; byte 0xF1 (which starts 4-byte
    # characters) is "ñ": a vocabulary without them drops those bytes
    vocab = sorted(set(pre_tokenizers.ByteLevel.alphabet()) - {"Ą", "ñ"})
    tokenizer = hand_built(
        pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False),
        model=models.BPE({s: i for i, s in enumerate(vocab)}, []),
    )
    assert len(tokenizer("ab\x04\x04", add_special_tokens=False)["input_ids"]) == 2
    bound = PromptSizeBound.of(tokenizer)
    assert bound is not None and bound.span == 4  # one byte a token; an unknown: 4
    assert bound.dropped == "\x04" and bound.non_ascii_keep == (3, 4)
    assert bound.text_bytes("ab\x04\x04") == 2
    assert bound.text_bytes("é" * 1000) == 1500  # 2,000 bytes, at least 3/4 of them seen


def test_only_contents_the_template_shows_are_counted():
    def render(messages: list[dict]) -> str:  # a template that drops system messages
        return "".join(str(m.get("content")) for m in messages if m["role"] != "system")

    kinds = rendered_kinds(render)
    assert "system" not in kinds and {"user", "assistant", "tool"} <= kinds
    bound = PromptSizeBound(span=4, ascii_exact=True)
    messages = [
        {"role": "system", "content": "s" * 1000},
        {"role": "user", "content": "u" * 10},
        {"role": "assistant", "content": "thought</think>said"},  # thinking not counted
    ]
    assert bound.messages_bytes(messages, kinds, stop_above=10**9) == 10 + 4


def test_the_server_context_length_is_read_from_the_inference_server():
    embedded = ScriptedHTTP().on("GET", "/get_server_info", reply(200, {"context_length": 4096}))
    sglang = (
        ScriptedHTTP()
        .on("GET", "/get_server_info", reply(200, {"context_length": None}))
        .on("GET", "/v1/models", reply(200, {"data": [{"id": "m", "max_model_len": 8192}]}))
    )
    silent = ScriptedHTTP()
    found = []
    for stand_in in (embedded, sglang, silent):
        with serve(ScriptedASGI(stand_in)) as address:
            found.append(server_context_length(address.removeprefix("http://"), {}))
    assert found == [4096, 8192, None]
