"""The token limit of a chat call, and the refusal of a prompt whose text cannot fit it.

The token limit of a call (prompt + completion) is ``engine_max_tokens`` when set, else
one less than the inference server's context length when known (servers refuse a prompt
plus ``max_new_tokens`` that reaches it), else ``DEFAULT_ENGINE_TOTAL_TOKENS``; a
request's ``max_total_tokens`` may lower it.

A prompt is checked against that limit twice, with the bound of
:mod:`areal.proxy.prompt_size`: its message contents before rendering (nothing
prompt-sized is built yet), and the rendered text before tokenizing (what the contents
did not show: tool calls, tools, kinds the template was not seen to render). Either
refusal is the 400 ``context_length_exceeded`` naming the limit and what sets it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

from areal.proxy.errors import ContextLengthExceededError
from areal.proxy.interaction import Interaction
from areal.proxy.prompt_size import PromptSizeBound, rendered_kinds

__all__ = ["DEFAULT_ENGINE_TOTAL_TOKENS", "PromptGuard", "TokenLimit", "total_token_limit"]

DEFAULT_ENGINE_TOTAL_TOKENS = 32768


class TokenLimit(NamedTuple):
    """Fewer than ``tokens`` tokens per call, and what sets that limit (for messages)."""

    tokens: int
    source: str


def total_token_limit(engine_max_tokens: int | None, context_length: int | None) -> TokenLimit:
    """The limit of prompt + completion tokens of every call (see the module docstring)."""
    server = None if context_length is None else context_length - 1
    if engine_max_tokens is not None and (server is None or engine_max_tokens <= server):
        return TokenLimit(engine_max_tokens, "--engine-max-tokens, rollout.agent.engine_max_tokens")
    if server is not None:
        return TokenLimit(server, f"the inference server's context length of {context_length}")
    return TokenLimit(
        DEFAULT_ENGINE_TOTAL_TOKENS, "the default, the inference server's context being unknown"
    )


class PromptGuard:
    """Refuses (400) prompts whose text alone shows they cannot fit a call's token limit.

    ``render`` is the chat template over a conversation (no tools, with the generation
    prompt); it is probed once here for the message kinds whose contents it shows. A
    tokenizer without a bound (:meth:`PromptSizeBound.of` is None) refuses nothing here:
    its prompts are tokenized and their token count decides.
    """

    def __init__(
        self,
        tokenizer: Any,
        render: Callable[[list[dict]], str],
        *,
        engine_max_tokens: int | None = None,
        context_length: int | None = None,
    ):
        self.total_limit = total_token_limit(engine_max_tokens, context_length)
        # computed once: what one token can stand for, and which contents the template shows
        self.bound = PromptSizeBound.of(tokenizer)
        self.rendered_kinds = rendered_kinds(render) if self.bound is not None else frozenset()

    def limit(self, body: dict[str, Any]) -> TokenLimit:
        """The request's limit: fewer prompt tokens than this, or it cannot be served."""
        cap = body.get("max_total_tokens")
        if cap is not None and cap < self.total_limit.tokens:
            return TokenLimit(cap, "the request's max_total_tokens")
        return self.total_limit

    def check_messages(
        self,
        messages: list[dict],
        limit: TokenLimit,
        concat_parent: Interaction | None = None,
        remaining: Iterable[dict] = (),
    ) -> None:
        """Refuse a conversation whose message text alone cannot fit ``limit``.

        Reads the contents in place: nothing prompt-sized is built. A concat prompt
        (``concat_parent`` given) may reuse its parent's tokens and tokenize only the
        ``remaining`` turns, so it is refused only if that cannot fit either.
        """
        bound = self.bound
        if bound is None:
            return
        most = bound.max_text_bytes(limit.tokens)
        counted = bound.messages_bytes(messages, self.rendered_kinds, most)
        if counted <= most:
            return
        if concat_parent is not None:
            new = bound.messages_bytes(remaining, self.rendered_kinds, most)
            if len(concat_parent.prompt_tokens) + bound.min_tokens(new) < limit.tokens:
                return
        raise self._too_long(counted, limit)

    def check_rendered(self, text: str, start: int, limit: TokenLimit) -> None:
        """Refuse a rendered prompt whose text from ``start`` cannot fit ``limit``."""
        bound = self.bound
        if bound is None:
            return
        size = bound.text_bytes(text, start)
        if size > bound.max_text_bytes(limit.tokens):
            raise self._too_long(size, limit)

    def _too_long(self, text_bytes: int, limit: TokenLimit) -> ContextLengthExceededError:
        bound = self.bound
        assert bound is not None
        return ContextLengthExceededError(
            f"the prompt cannot fit: its {text_bytes:,}+ bytes of text take at least "
            f"{bound.min_tokens(text_bytes):,} tokens (a token of this model stands for at "
            f"most {bound.span} bytes), and a prompt must have fewer than {limit.tokens:,} "
            f"tokens ({limit.source}); refused before tokenizing",
            "messages",
        )
