"""Stop strings for servers that do not tokenize (SGLang with ``--skip-tokenizer-init``).

Such a server cannot match stop strings (SGLang 0.5.23 answers 400; 0.5.10.post1 accepts
the field and then needs a tokenizer it does not have), so the client applies them: a stop
string that is one token becomes a stop token id, which the server matches exactly; any
other is matched on the client by decoding the output, which is then cut where SGLang
would have stopped: after the first token that completes the string.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["ClientStops", "split_stop_strings"]


@dataclass
class ClientStops:
    """The server's share (``token_ids``) and the client's (``strings``) of some stops."""

    token_ids: list[int]
    strings: list[str]

    def cut(self, tokens: list[int], tokenizer: Any) -> int | None:
        """Tokens to keep when the output contains a stop string (None: it does not).

        ``tokens`` is the whole output so far; the answer is the length of its shortest
        prefix whose text contains one of :attr:`strings`.
        """
        if not self.strings or not tokens:
            return None
        text = tokenizer.decode(tokens, skip_special_tokens=False)
        if not any(s in text for s in self.strings):
            return None
        low, high = 1, len(tokens)  # shortest prefix containing a stop: binary search
        while low < high:
            mid = (low + high) // 2
            prefix = tokenizer.decode(tokens[:mid], skip_special_tokens=False)
            if any(s in prefix for s in self.strings):
                high = mid
            else:
                low = mid + 1
        return low


def split_stop_strings(stop: list[str], tokenizer: Any) -> ClientStops:
    """One-token stop strings as ids, the rest as strings the client matches."""
    if tokenizer is None:
        raise ValueError(
            "stop strings with a server that does not tokenize (sglang.skip_tokenizer_init) "
            "need the request's tokenizer; pass ModelRequest.tokenizer or set "
            "sglang.skip_tokenizer_init: false"
        )
    ids: list[int] = []
    strings: list[str] = []
    for text in stop:
        if not text:
            continue
        encoded = tokenizer.encode(text, add_special_tokens=False)
        if len(encoded) == 1 and tokenizer.decode(encoded, skip_special_tokens=False) == text:
            ids.append(int(encoded[0]))
        else:
            strings.append(text)
    return ClientStops(ids, strings)
