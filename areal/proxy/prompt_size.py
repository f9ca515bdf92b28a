"""A lower bound on a prompt's token count from its text, checked before rendering it.

Tokenizing costs the proxy 100-150 bytes of memory per byte of text (the Rust tokenizer
keeps per-byte alignments and per-token records), so a 15 MB prompt took it past 2.6 GB
only for its token count to refuse it. But a token stands for at most ``span`` bytes of
text, the longest entry of the vocabulary: a prompt of more than ``(limit - 1) * span``
bytes has at least ``limit`` tokens, which its length alone shows
(:mod:`areal.proxy.prompt_guard` refuses such prompts with it).

The bound never refuses a prompt that fits, given:

* the span: a byte-level BPE entry counts one byte per symbol (``Ġ`` is one space), any
  other entry its UTF-8 length, an added token the longer of its text and its normalized
  text. Bytes a byte-level model has no symbol for (SmolLM2 lacks a few control
  characters and lead bytes of unassigned characters) are not counted. A tokenizer whose
  one token can stand for any amount of text, or that can drop whole characters, has no
  bound: WordPiece and WordLevel unknowns, fused runs of unknown characters, character-level
  BPE without an unknown token or byte fallback, pre-tokenizers that drop text, added
  tokens that swallow the whitespace beside them.
* the text measured is what the tokenizer's model sees: ASCII text as is where the
  normalizer never shortens it (Unicode forms, lowercasing, prepending, replacements no
  shorter than what they replace); other text through the tokenizer's own normalizer,
  ``CHUNK`` characters at a time, less ``SLACK`` bytes at each chunk's ends (a
  normalizer changes a string only locally, never by that much across one boundary).
* for message contents counted before rendering: the chat template renders a content
  whole (leading and trailing whitespace aside) wherever it rendered a probe of it
  (:func:`rendered_kinds`), except an assistant's thinking up to ``</think>``, which
  reasoning templates drop from earlier turns. Text the probes did not see rendered is
  not counted, and the rendered prompt is checked again before tokenizing it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["THINK_END", "PromptSizeBound", "message_kind", "rendered_kinds"]

CHUNK = 1 << 18  # characters normalized at a time (a few MB of tokenizer memory)
SLACK = 64  # bytes a normalizer may save across one chunk boundary
THINK_END = "</think>"
# pre-tokenizers that keep every byte of their input in some pre-token
KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits", "Punctuation"})
# normalizers under which ASCII text never gets shorter
ASCII_KEEPING_NORMALIZERS = frozenset({"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend"})
_LEADING_SPACE = re.compile(r"\s*")


def _byte_symbols() -> list[str]:
    """The byte-level alphabet indexed by byte: printable Latin-1 bytes stand for
    themselves, the others for code points from 256 on, in byte order."""
    printable = {*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    symbols, extra = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    return symbols


_BYTE_SYMBOLS = _byte_symbols()
_BYTE_SYMBOL_SET = frozenset(_BYTE_SYMBOLS)


def _components(node: dict[str, Any] | None, key: str) -> list[dict[str, Any]]:
    """The leaves of a (possibly nested) ``Sequence`` of normalizers or pre-tokenizers."""
    if not node:
        return []
    if node.get("type") == "Sequence":
        return [leaf for child in node.get(key) or [] for leaf in _components(child, key)]
    return [node]


def _state(component: Any) -> dict[str, Any] | None:
    return None if component is None else json.loads(component.__getstate__())


def _utf8_length(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))


def _keeps_ascii_length(normalizer: dict[str, Any]) -> bool:
    kind = normalizer.get("type")
    if kind == "Replace":
        pattern = normalizer.get("pattern") or {}
        return "String" in pattern and len(str(normalizer.get("content", "")).encode()) >= len(
            str(pattern["String"]).encode()
        )
    return kind in ASCII_KEEPING_NORMALIZERS or kind == "ByteLevel"


def _utf8_lead_length(byte: int) -> int | None:
    """The length of the UTF-8 characters that ``byte`` starts (None: it starts none)."""
    for low, high, length in ((0xC2, 0xDF, 2), (0xE0, 0xEF, 3), (0xF0, 0xF4, 4)):
        if low <= byte <= high:
            return length
    return None


def _dropped_bytes(backend: Any, byte_level: bool, vocab: dict[str, int]) -> _Dropped | None:
    """What the model drops without a token, or None where one token may stand for
    unbounded text or too much text may vanish."""
    model = backend.model
    kind = type(model).__name__
    if kind == "BPE":
        if model.byte_fallback:
            return _Dropped()
        if model.unk_token is not None:
            return None if model.fuse_unk else _Dropped()
        if not byte_level:
            return None  # any character without a symbol is dropped
        # byte-level BPE drops the bytes it has no symbol for: in real vocabularies,
        # some control characters and lead bytes of rare or unassigned characters
        missing = [b for b, c in enumerate(_BYTE_SYMBOLS) if c not in vocab]
        if any(0x80 <= b < 0xC0 for b in missing):
            return None  # continuation bytes: a character could lose most of itself
        leads = [n for b in missing if (n := _utf8_lead_length(b)) is not None]
        shortest = min(leads, default=0)
        keep = (shortest - 1, shortest) if shortest else (1, 1)
        return _Dropped("".join(chr(b) for b in missing if b < 0x80), keep)
    if kind == "Unigram":
        state = json.loads(model.__getstate__())
        fused = state.get("unk_id") is not None and not state.get("byte_fallback")
        return None if fused else _Dropped()
    return None  # WordPiece, WordLevel: one unknown word of any length is one token


@dataclass(frozen=True)
class _Dropped:
    ascii: str = ""
    """ASCII characters the model drops."""
    keep: tuple[int, int] = (1, 1)
    """The least share of a non-ASCII text's bytes the model keeps (numerator, denominator)."""


@dataclass(frozen=True)
class PromptSizeBound:
    """What one token of a tokenizer can stand for, and how its text is measured."""

    span: int
    """Most bytes of (normalized) text one token stands for."""
    ascii_exact: bool
    """Whether ASCII text is measured by its length (the normalizer never shortens it)."""
    normalizer: Any = None
    dropped: str = ""
    """ASCII characters the model drops without a token (they are not counted)."""
    non_ascii_keep: tuple[int, int] = (1, 1)
    """The least share of non-ASCII text's bytes the model keeps (some lead bytes may have
    no symbol: a character keeps all but one of its bytes)."""

    @classmethod
    def of(cls, tokenizer: Any) -> PromptSizeBound | None:
        """The bound of a fast tokenizer, or None where its tokens have no span limit."""
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            return None
        pre = _components(_state(backend.pre_tokenizer), "pretokenizers")
        norm = _components(_state(backend.normalizer), "normalizers")
        if any(
            p.get("type") not in KEEPING_PRE_TOKENIZERS or p.get("behavior") == "Removed"
            for p in pre
        ):
            return None  # whitespace or delimiters dropped: no bytes-per-token bound
        added = list(backend.get_added_tokens_decoder().values())
        if any(token.lstrip or token.rstrip for token in added):
            return None  # such a token also covers any whitespace run beside it
        # byte-level models see one symbol per byte (unless bytes were mapped before)
        byte_level = any(p.get("type") == "ByteLevel" for p in pre) and not any(
            n.get("type") == "ByteLevel" for n in norm
        )
        vocab = backend.get_vocab(with_added_tokens=False)
        dropped = _dropped_bytes(backend, byte_level, vocab)
        if dropped is None:
            return None
        span = 4  # an unknown token stands for one character
        for entry in vocab:
            if byte_level and _BYTE_SYMBOL_SET.issuperset(entry):
                span = max(span, len(entry))
            else:
                span = max(span, len(entry.encode()))
        normalizer = backend.normalizer
        for token in added:
            span = max(span, len(token.content.encode()))
            if normalizer is not None:
                span = max(span, len(normalizer.normalize_str(token.content).encode()))
        ascii_exact = all(_keeps_ascii_length(n) for n in norm)
        return cls(span, ascii_exact, normalizer, dropped.ascii, dropped.keep)

    def max_text_bytes(self, limit: int) -> int:
        """The most bytes of text a prompt of fewer than ``limit`` tokens can have."""
        return max(0, limit - 1) * self.span

    def min_tokens(self, text_bytes: int) -> int:
        """The fewest tokens ``text_bytes`` bytes of text can take."""
        return -(-text_bytes // self.span)

    def text_bytes(self, text: str, start: int = 0, end: int | None = None) -> int:
        """A lower bound on the bytes the tokenizer's model sees of ``text[start:end]``.

        Reads the text in ``CHUNK`` slices, so memory stays small for any length.
        """
        end = len(text) if end is None else end
        if end <= start:
            return 0
        if text.isascii() and (self.normalizer is None or self.ascii_exact):
            if not self.dropped:  # the common case, once per message of every request
                return end - start
            return end - start - sum(text.count(c, start, end) for c in self.dropped)
        total = pieces = 0
        for i in range(start, end, CHUNK):
            chunk = text[i : min(i + CHUNK, end)]
            if self.normalizer is not None:
                chunk = self.normalizer.normalize_str(chunk)
            total += _utf8_length(chunk) - sum(chunk.count(c) for c in self.dropped)
            pieces += 1
        if self.normalizer is not None:
            total -= SLACK * (pieces + 1)
        kept, of = self.non_ascii_keep
        return max(0, total * kept // of)

    def content_bytes(self, content: str, start: int = 0) -> int:
        """:meth:`text_bytes` of ``content[start:]`` without its surrounding whitespace."""
        end = len(content)
        if start < end and content[start].isspace():
            start = _LEADING_SPACE.match(content, start).end()
        step = 64
        while end > start and content[end - 1].isspace():  # read back in growing slices
            piece = content[max(start, end - step) : end]
            end -= len(piece) - len(piece.rstrip())
            step *= 2
        return self.text_bytes(content, start, end)

    def messages_bytes(
        self, messages: Iterable[dict[str, Any]], kinds: frozenset[str], stop_above: int
    ) -> int:
        """Bytes of the message contents a template renders; stops once over ``stop_above``.

        Only string contents of the ``kinds`` the template was seen to render count
        (block lists that stayed lists hold images: the template decides what they show).
        """
        total = 0
        for message in messages:
            content = message.get("content")
            if not isinstance(content, str) or message_kind(message) not in kinds:
                continue
            start = 0
            if message.get("role") == "assistant":
                think_end = content.rfind(THINK_END)
                start = 0 if think_end < 0 else think_end + len(THINK_END)
            total += self.content_bytes(content, start)
            if total > stop_above:
                break
        return total


def message_kind(message: dict[str, Any]) -> str:
    """The role, with assistant turns that call tools told apart (some templates show
    only the calls of those)."""
    role = str(message.get("role"))
    return "assistant_tool_calls" if role == "assistant" and message.get("tool_calls") else role


_PROBE = "prompt-size-probe-5c1e"
_CALL = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
_PROBES: dict[str, list[dict[str, Any]]] = {
    "system": [{"role": "system", "content": _PROBE}, {"role": "user", "content": "hi"}],
    "developer": [{"role": "developer", "content": _PROBE}, {"role": "user", "content": "hi"}],
    "user": [{"role": "user", "content": _PROBE}],
    "assistant": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": _PROBE},
        {"role": "user", "content": "ok"},
    ],
    "assistant_tool_calls": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": _PROBE, "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "ok"},
    ],
    "tool": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [_CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": _PROBE},
    ],
    "function": [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "", "tool_calls": [_CALL]},
        {"role": "function", "name": "f", "content": _PROBE},
    ],
}


def rendered_kinds(render: Callable[[list[dict[str, Any]]], str]) -> frozenset[str]:
    """The message kinds (:func:`message_kind`) whose content ``render`` shows verbatim.

    Each kind is probed with a short conversation; a kind the template drops, or whose
    probe it cannot render, is never counted before rendering.
    """
    kinds = set()
    for kind, probe in _PROBES.items():
        try:
            if _PROBE in render(probe):
                kinds.add(kind)
        except Exception:  # the template refuses this shape: nothing is counted for it
            continue
    return frozenset(kinds)
