"""Chat completions on the inference engine, recorded token for token.

For each request: refuse a prompt whose text alone shows it cannot fit the call's token
limit (:mod:`areal.proxy.prompt_guard`, before anything prompt-sized is built), render the
prompt tokens (``hf``: the chat template over all messages; ``concat``: the parent's exact
tokens, then the new turns), cap the budget, generate with ``agenerate``, decode, parse
tool calls, and record the call as an :class:`Interaction` with the prompt tokens the
engine received and the tokens and log-probs it returned. A call refused for its length
is recorded without messages or tokens (its session counts it, holding none of it).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from areal.api.cli_args import GenerationHyperparameters
from areal.api.io_struct import ModelRequest, ModelResponse
from areal.proxy.errors import ChatRequestError, ContextLengthExceededError, InvalidRequestError
from areal.proxy.interaction import Interaction, InteractionCache
from areal.proxy.messages import MessagePreprocessor, prepare_messages
from areal.proxy.parsers import ReasoningParser, ToolCallParser, process_tool_calls
from areal.proxy.prompt_guard import PromptGuard, TokenLimit, total_token_limit
from areal.proxy.validation import check_chat_request
from areal.utils import logging, stats_tracker

# TokenLimit and total_token_limit live in prompt_guard; still importable from here
__all__ = [
    "ChatGenerator",
    "ChatRequestError",
    "ContextLengthExceededError",
    "GeneratedChat",
    "TokenLimit",
    "total_token_limit",
]

logger = logging.getLogger("proxy.chat")

PROXY_TRACKER = "proxy"
"""The stats tracker of the proxy's events: their keys are exported as ``proxy/<event>``."""
CONCAT_PREFIX_MISMATCH = "concat_prefix_mismatch"
"""Children in concat mode whose re-rendered prompt did not extend the parent's tokens."""
TEMPERATURE_MISMATCH = "sampling_temperature_mismatch"
"""Requests sampled at another temperature than ``actor.temperature``."""


def count_event(event: str, happened: bool) -> None:
    """Count one occurrence of an event (or a non-occurrence, so that the key still shows 0)
    as ``proxy/<event>``; the step's total is summed over proxies."""
    stats_tracker.get(PROXY_TRACKER).denominator(**{event: torch.tensor([happened])})


ALLOWED_ARGS = frozenset(
    {
        "messages",
        "stream",
        "frequency_penalty",
        "max_completion_tokens",
        "max_tokens",
        "max_total_tokens",
        "metadata",
        "n",
        "seed",
        "stop",
        "store",
        "temperature",
        "tool_choice",
        "tools",
        "top_p",
        "extra_body",
        "model",
        "stream_options",
        "user",
    }
)
DEFAULT_MAX_NEW_TOKENS = 512


@dataclass
class GeneratedChat:
    """The outcome of one chat call."""

    completion: dict[str, Any]
    message: dict[str, Any]  # the assistant message, as recorded
    response: ModelResponse
    interaction: Interaction | None
    prompt_tokens: list[int] = field(default_factory=list)


def _completion_id() -> str:
    return f"chatcmpl-{os.urandom(15).hex()[:29]}"


def _normalize_tools(tools: list[dict] | None) -> list[dict] | None:
    """Chat-style function tools; flat Responses-style entries are nested under function."""
    if not tools:
        return None
    normalized = []
    for tool in tools:
        if tool.get("type", "function") != "function":
            continue
        if "function" in tool:
            normalized.append(tool)
        else:
            fn = {k: v for k, v in tool.items() if k not in ("type", "strict")}
            normalized.append({"type": "function", "function": fn})
    return normalized or None


def _template_messages(messages: list[dict]) -> list[dict]:
    """History tool-call arguments as objects (some templates iterate over them)."""
    rendered = []
    for message in messages:
        calls = message.get("tool_calls")
        if not calls:
            rendered.append(message)
            continue
        fixed = []
        for call in calls:
            fn = dict(call.get("function", {}))
            if isinstance(fn.get("arguments"), str):
                with contextlib.suppress(json.JSONDecodeError):
                    fn["arguments"] = json.loads(fn["arguments"])
            fixed.append({**call, "function": fn})
        rendered.append({**message, "tool_calls": fixed})
    return rendered


class ChatGenerator:
    """``chat.completions.create`` over an inference engine, recording interactions."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        *,
        tool_call_parser: ToolCallParser | None = None,
        reasoning_parser: ReasoningParser | None = None,
        engine_max_tokens: int | None = None,
        context_length: int | None = None,
        chat_template_type: str = "hf",
        preprocessors: list[MessagePreprocessor] | None = None,
        expected_temperature: float | None = None,
        deterministic: bool = False,
    ):
        if chat_template_type not in ("hf", "concat"):
            raise ValueError(
                f"chat_template_type must be 'hf' or 'concat', got {chat_template_type!r}"
            )
        self.engine = engine
        self.tokenizer = tokenizer
        self.tool_call_parser = tool_call_parser
        self.reasoning_parser = reasoning_parser
        self.engine_max_tokens = engine_max_tokens
        self.chat_template_type = chat_template_type
        self.preprocessors = list(preprocessors or [])
        self.expected_temperature = expected_temperature
        self.deterministic = deterministic
        self.eos_id = tokenizer.eos_token_id
        self.stop_ids = sorted(
            {t for t in (tokenizer.eos_token_id, tokenizer.pad_token_id) if t is not None}
        )
        self._warned: set[str] = set()
        self._warn_once = os.environ.get("AREAL_PROXY_WARN_ONCE", "") == "1"
        self._encode = self._fast_encoder()
        self.prompt_guard = PromptGuard(
            tokenizer,
            lambda messages: self.render_text(messages, None, None),
            engine_max_tokens=engine_max_tokens,
            context_length=context_length,
        )

    # --- helpers ---

    def _warn(self, key: str, message: str, once: bool = False) -> None:
        if (once or self._warn_once) and key in self._warned:
            return
        self._warned.add(key)
        logger.warning(message)

    def warm_up(self) -> None:
        """Compile the chat template before the first request needs it."""
        self.render([{"role": "user", "content": "warm-up"}], None, None)

    def _fast_encoder(self) -> Callable[[str], list[int]] | None:
        """The Rust tokenizer's own batch encoder, when it is what ``tokenizer(text)`` runs.

        A fast tokenizer with no truncation, padding or special-token splitting encodes
        exactly like its backend; the wrapper only adds Python overhead per call. The batch
        entry point is used because it releases the GIL while it encodes, so a long prompt
        tokenized on a worker thread does not stall the event loop; its ``_fast`` form
        (tokenizers >= 0.20) skips character offsets, a third of the encoder's memory.
        Checked once on a probe text; anything else keeps the wrapper.
        """
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None or getattr(self.tokenizer, "split_special_tokens", False):
            return None
        if backend.truncation is not None or backend.padding is not None:
            return None
        if getattr(backend, "encode_special_tokens", False):
            return None

        encode_batch = getattr(backend, "encode_batch_fast", backend.encode_batch)

        def encode(text: str) -> list[int]:
            return encode_batch([text], add_special_tokens=False)[0].ids

        special = "".join(str(t) for t in self.tokenizer.all_special_tokens)
        probe = f' Hi there!{special}\n  déjà vu\t{{"a": [1, 2]}}\n'
        slow = self.tokenizer(probe, add_special_tokens=False)["input_ids"]
        return encode if encode(probe) == list(slow) else None

    def render_text(
        self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None
    ) -> str:
        """The chat template over the conversation, with the generation prompt."""
        return self.tokenizer.apply_chat_template(
            _template_messages(messages),
            tools=tools,
            add_generation_prompt=True,
            tokenize=False,
            **(template_kwargs or {}),
        )

    def encode(self, text: str) -> list[int]:
        if self._encode is not None:
            return self._encode(text)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def render(
        self, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None
    ) -> list[int]:
        """Chat-template tokens of the conversation, with the generation prompt."""
        return self.encode(self.render_text(messages, tools, template_kwargs))

    def _concat_prompt(
        self,
        parent: Interaction,
        messages: list[dict],
        tools: list[dict] | None,
        template_kwargs: dict | None,
        limit: TokenLimit,
    ) -> list[int] | None:
        """The parent's exact tokens + EOS + the re-rendered tokens after the matching EOS.

        Only the text from the matching EOS on is tokenized: special tokens split the
        input before the tokenizer's model runs, so that tail tokenizes exactly as it does
        inside the whole conversation, and a long session costs one new turn per call.
        Returns ``None`` when the re-rendered conversation cannot be aligned with the
        parent's tokens (the child is then trained on its own).
        """
        assert parent.response is not None
        output = list(parent.response.output_tokens)
        while output and output[-1] in self.stop_ids:
            output.pop()
        head = parent.prompt_tokens + output + [self.eos_id]
        text = self.render_text(messages, tools, template_kwargs)
        eos_text = self.tokenizer.eos_token
        at = -1
        for _ in range(head.count(self.eos_id)):
            at = text.find(eos_text, at + 1)
            if at < 0:
                return None
        # the prompt has at least the tail's tokens: checking the tail alone is sound
        self.prompt_guard.check_rendered(text, at, limit)
        tail = self.encode(text[at:])
        if len(tail) < 2 or tail[0] != self.eos_id:
            return None
        prompt = head + tail[1:]
        parent_sequence = parent.sequence
        if prompt[: len(parent_sequence)] != parent_sequence:
            return None  # the parent ended on another stop token: not an exact prefix
        return prompt

    def _sampling(
        self, kwargs: dict[str, Any], seed_key: str | None, request_index: int | None
    ) -> dict[str, Any]:
        temperature = kwargs.get("temperature")
        if temperature is None:
            self._warn("temperature", "request has no temperature; using 1.0")
            temperature = 1.0
        top_p = kwargs.get("top_p") or 1.0
        seed = kwargs.get("seed")
        if seed is None and self.deterministic and seed_key is not None:
            digest = hashlib.sha256(f"{seed_key}:{request_index}".encode()).digest()
            seed = int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
        return {
            "temperature": float(temperature),
            "top_p": float(top_p),
            "frequency_penalty": float(kwargs.get("frequency_penalty") or 0.0),
            "seed": seed,
        }

    def _budget(self, kwargs: dict[str, Any], prompt_len: int) -> tuple[int, int]:
        max_completion = kwargs.get("max_completion_tokens", kwargs.get("max_tokens"))
        caps = [
            c for c in (kwargs.get("max_total_tokens"), self.engine_max_tokens) if c is not None
        ]
        if caps:
            total_cap = min(caps)
            room = total_cap - prompt_len
            if room <= 0:
                raise ContextLengthExceededError(
                    f"len of prompt tokens ({prompt_len}) exceeds max_total_tokens ({total_cap})",
                    "messages",
                )
            max_new = room if max_completion is None else min(room, int(max_completion))
        elif max_completion is not None:
            max_new = int(max_completion)
        else:
            self._warn(
                "budget", f"no token limit in the request or config; using {DEFAULT_MAX_NEW_TOKENS}"
            )
            max_new = DEFAULT_MAX_NEW_TOKENS
        if max_new <= 0:
            raise ChatRequestError(
                "max_completion_tokens must be positive", "max_completion_tokens"
            )
        total_limit = self.prompt_guard.total_limit
        total = min(prompt_len + max_new, total_limit.tokens)
        if total <= prompt_len:
            raise ContextLengthExceededError(
                f"len of prompt tokens ({prompt_len}) exceeds the engine's total token limit "
                f"({total}: {total_limit.source})",
                "messages",
            )
        return max_new, total

    def _check_sampling(self, sampling: dict[str, Any]) -> None:
        """Count (and warn once per run about) requests off ``actor.temperature``."""
        expected = self.expected_temperature
        if expected is None:
            return
        used = sampling["temperature"]
        mismatch = abs(used - expected) > 1e-6
        count_event(TEMPERATURE_MISMATCH, mismatch)
        if mismatch:
            self._warn(
                "temperature-mismatch",
                f"a request samples at temperature {used} but actor.temperature is {expected}: "
                "recomputed log-probs will not match the behaviour policy (counted in "
                f"{PROXY_TRACKER}/{TEMPERATURE_MISMATCH}; warned once)",
                once=True,
            )

    # --- the call ---

    @staticmethod
    def _from_request(fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` for a step that depends only on the request (400 if it fails).

        Preparing and rendering messages fails only on what the client sent (a shape the
        chat template or a preprocessor cannot take), so such a failure is reported as a
        bad request naming ``messages``, never as a failure of the proxy.
        """
        try:
            return fn(*args)
        except InvalidRequestError:
            raise
        except Exception as e:
            logger.warning("cannot render a request: %s: %s", type(e).__name__, e)
            raise ChatRequestError(
                "the messages cannot be rendered with this model's chat template: "
                f"{type(e).__name__}: {e}",
                "messages",
            ) from None

    async def _request_step(self, offload: bool, fn: Callable[..., Any], *args: Any) -> Any:
        if offload:
            return await asyncio.to_thread(self._from_request, fn, *args)
        return self._from_request(fn, *args)

    def _render_prompt(
        self,
        parent: Interaction | None,
        messages: list[dict],
        remaining: list[dict],
        tools: list[dict] | None,
        template_kwargs: dict | None,
        limit: TokenLimit,
    ) -> tuple[list[int] | None, list[int]]:
        """The concat prompt (None when there is none or it does not align), and the prompt.

        The text is checked against ``limit`` before rendering and again before tokenizing.
        """
        concat_parent = parent if self.chat_template_type == "concat" else None
        self.prompt_guard.check_messages(messages, limit, concat_parent, remaining)
        concat = None
        if concat_parent is not None:
            concat = self._concat_prompt(concat_parent, messages, tools, template_kwargs, limit)
        if concat is not None:
            return concat, concat
        text = self.render_text(messages, tools, template_kwargs)
        self.prompt_guard.check_rendered(text, 0, limit)
        return None, self.encode(text)

    async def create(
        self,
        body: dict[str, Any],
        cache: InteractionCache | None = None,
        seed_key: str | None = None,
        request_index: int | None = None,
        *,
        offload: bool = False,
        validated: bool = False,
    ) -> GeneratedChat:
        """Serve one chat request; record it in ``cache`` unless ``store`` is false.

        A failure while checking, preparing or rendering the request is the request's (an
        :class:`InvalidRequestError`, HTTP 400); the engine call and what follows it are
        where the proxy itself can fail.
        ``offload`` renders and tokenizes the prompt on a worker thread (for large
        requests, so other sessions keep being served); ``validated`` skips the checks
        of :func:`check_chat_request` when the caller has run them.
        """
        if not validated:
            check_chat_request(body)
        dropped = sorted(
            k for k in body if k not in ALLOWED_ARGS and body[k] not in (None, False, [], {})
        )
        if dropped:
            self._warn(
                f"dropped:{','.join(dropped)}", f"ignoring unsupported request fields {dropped}"
            )
        if (body.get("n") or 1) != 1:
            raise ChatRequestError("only n=1 is supported (one completion per request)", "n")
        if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
            raise ChatRequestError(
                "give max_tokens or max_completion_tokens, not both", "max_tokens"
            )
        tools = _normalize_tools(body.get("tools"))
        extra = body.get("extra_body") or {}
        template_kwargs = extra.get("chat_template_kwargs") if isinstance(extra, dict) else None
        store = body.get("store", True) is not False and cache is not None

        messages = await self._request_step(
            offload, prepare_messages, body["messages"], self.preprocessors
        )
        parent, remaining = None, messages
        if store:
            parent, remaining = cache.find_parent(messages)  # type: ignore[union-attr]
        try:
            concat, prompt = await self._request_step(
                offload,
                self._render_prompt,
                parent,
                messages,
                remaining,
                tools,
                template_kwargs,
                self.prompt_guard.limit(body),
            )
            mismatch = False
            if self.chat_template_type == "concat" and parent is not None:
                count_event(CONCAT_PREFIX_MISMATCH, concat is None)
                if concat is None:
                    logger.warning(
                        "concat prompt of a child of %s could not be aligned; training it alone",
                        parent.id,
                    )
                    mismatch, parent = True, None
            sampling = self._sampling(body, seed_key, request_index)
            self._check_sampling(sampling)
            max_new, total = self._budget(body, len(prompt))
        except ContextLengthExceededError:
            if store:  # the session counts the call (interaction_count) but keeps no prompt
                cache.add(  # type: ignore[union-attr]
                    Interaction(_completion_id(), [], chat_template_type=self.chat_template_type)
                )
            raise
        interaction = None
        if store:
            interaction = Interaction(
                id=_completion_id(),
                messages=[dict(m) for m in messages],
                chat_template_type=self.chat_template_type,
            )
            interaction.concat_prefix_mismatch = mismatch
            interaction.parent = parent
            interaction.prompt_tokens = list(prompt)
            cache.add(interaction)  # type: ignore[union-attr]
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        gconfig = GenerationHyperparameters(
            n_samples=1,
            max_new_tokens=max_new,
            max_tokens=total,
            greedy=sampling["temperature"] == 0,
            temperature=sampling["temperature"] or 1.0,
            top_p=sampling["top_p"],
            frequency_penalty=sampling["frequency_penalty"],
            seed=sampling["seed"],
            stop=None if self.chat_template_type == "concat" or not stop else stop,
            stop_token_ids=list(self.stop_ids),
        )
        # --- the engine call: failures from here on are the proxy's, not the request's ---
        response = await self.engine.agenerate(
            ModelRequest(
                input_ids=list(prompt),
                gconfig=gconfig,
                rid=os.urandom(16).hex(),
                tokenizer=self.tokenizer,
            )
        )
        output = list(response.output_tokens)
        while output and output[-1] in self.stop_ids:
            output.pop()
        text = self.tokenizer.decode(output, skip_special_tokens=False)
        finish_reason = response.stop_reason
        tool_calls = None
        if tools and body.get("tool_choice") != "none":
            tool_calls, text, finish_reason = process_tool_calls(
                text, tools, self.tool_call_parser, self.reasoning_parser, finish_reason
            )
        if finish_reason == "abort":
            finish_reason = "length"
        message: dict[str, Any] = {"role": "assistant"}
        if text or not tool_calls:
            message["content"] = text
        if tool_calls:
            message["tool_calls"] = tool_calls
        completion = {
            "id": interaction.id if interaction is not None else _completion_id(),
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model") or "default",
            "choices": [
                {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": None}
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(response.output_tokens),
                "total_tokens": len(prompt) + len(response.output_tokens),
            },
        }
        if interaction is not None:
            interaction.response = response
            interaction.completion = completion
            interaction.output_message_list = [dict(message)]
            interaction.sampling = {**sampling, "top_k": None}
        return GeneratedChat(completion, message, response, interaction, list(prompt))
