"""A prompt that cannot fit the context is refused before it is rendered or tokenized.

The proxies here run the tiny test tokenizer, whose longest token is a newline and 27
spaces: 28 bytes of text (56 bytes of UTF-8 as the vocabulary spells it, ``Ċ`` and 27
``Ġ``), so a prompt of fewer than ``limit`` tokens has at most ``28 * (limit - 1)`` bytes.
A spy around the tokenizer notes the longest text it rendered and encoded.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import pytest

from tests.unit.proxy.conftest import ScriptedEngine, bearer, running_proxy, start_session

LIMIT = 200  # --engine-max-tokens of these proxies
SPAN = 28
SMALL = 4096  # longer than any warm-up or probe the proxy renders or encodes itself


class _WatchedBackend:
    def __init__(self, inner: Any, spy: WatchedTokenizer):
        self._inner, self._spy = inner, spy

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def encode_batch(self, texts: list[str], **kwargs: Any) -> Any:
        self._spy.saw_encode(texts)
        return self._inner.encode_batch(texts, **kwargs)

    def encode_batch_fast(self, texts: list[str], **kwargs: Any) -> Any:
        self._spy.saw_encode(texts)
        return self._inner.encode_batch_fast(texts, **kwargs)


class WatchedTokenizer:
    """A tokenizer that notes the longest text it rendered and the longest it encoded."""

    def __init__(self, inner: Any):
        self._inner = inner
        self.longest_render = self.longest_encode = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    @property
    def backend_tokenizer(self) -> _WatchedBackend:
        return _WatchedBackend(self._inner.backend_tokenizer, self)

    def saw_encode(self, texts: list[str]) -> None:
        self.longest_encode = max(self.longest_encode, *(len(t) for t in texts))

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        text = self._inner.apply_chat_template(*args, **kwargs)
        self.longest_render = max(self.longest_render, len(text))
        return text

    def __call__(self, text: str, **kwargs: Any) -> Any:
        self.saw_encode([text])
        return self._inner(text, **kwargs)

    def reset(self) -> None:
        self.longest_render = self.longest_encode = 0


@pytest.fixture
def watched(tokenizer):
    spy = WatchedTokenizer(tokenizer)
    engine = ScriptedEngine(tokenizer)
    with running_proxy(engine, spy, engine_max_tokens=LIMIT) as (url, server):
        session_id, key = start_session(url)
        yield url, server.store.get(session_id), key, engine, spy


def longest_token_text(tokenizer) -> str:
    vocab = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=False)
    return tokenizer.convert_tokens_to_string([max(vocab, key=len)])


def test_an_oversized_prompt_is_refused_unrendered_in_each_protocol(watched):
    url, session, key, engine, spy = watched
    text = "word " * 400_000  # 2 MB: at least 71,429 tokens, each of at most 28 bytes
    requests = {
        "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": text}]},
        "/v1/responses": {"model": "m", "input": text},
        "/v1/messages": {
            "model": "m",
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": "text", "text": text}]}],
        },
    }
    spy.reset()
    for path, body in requests.items():
        started = time.monotonic()
        response = httpx.post(f"{url}{path}", headers=bearer(key), json=body, timeout=60)
        assert response.status_code == 400, (path, response.text)
        assert time.monotonic() - started < 5, path
        answer = response.json()
        if path == "/v1/messages":
            assert answer["type"] == "error"
        error = answer["error"]
        assert error["type"] == "context_length_exceeded", (path, answer)
        message = error["message"]
        assert "fewer than 200 tokens" in message and "engine_max_tokens" in message, message
        assert "at least 71,429 tokens" in message and "at most 28 bytes" in message, message
    assert spy.longest_render < SMALL and spy.longest_encode < SMALL  # nothing prompt-sized
    assert not engine.requests
    assert session.context_overflow and not session.system_error
    # each refusal is counted in the session (interaction_count) and holds none of its prompt
    refused = session.cache.values()
    assert len(refused) == 3 and all(not i.messages and not i.prompt_tokens for i in refused)


def test_a_prompt_just_under_the_bound_is_served_and_one_over_is_refused(watched, tokenizer):
    url, _, key, engine, spy = watched
    run = longest_token_text(tokenizer)  # one token of 28 bytes, repeated

    def content(copies: int) -> str:
        return "x" + run * copies + "y"  # letters at the ends: nothing to trim

    def prompt_tokens(copies: int) -> int:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": content(copies)}],
            tokenize=False,
            add_generation_prompt=True,
        )
        return len(tokenizer(text, add_special_tokens=False)["input_ids"])

    copies = max(k for k in range(150, LIMIT) if prompt_tokens(k) < LIMIT)
    counted = SPAN * copies + 2
    # within 15 tokens' text of the bound: the template's own tokens and the ends take those
    assert 5572 - SPAN * 15 < counted <= 5572
    spy.reset()
    served = httpx.post(
        f"{url}/v1/chat/completions",
        headers=bearer(key),
        json={"model": "m", "messages": [{"role": "user", "content": content(copies)}]},
    )
    assert served.status_code == 200, served.text
    assert len(engine.requests[-1].input_ids) == prompt_tokens(copies) == LIMIT - 1
    assert spy.longest_encode > counted  # rendered and tokenized as usual
    spy.reset()
    over = httpx.post(
        f"{url}/v1/chat/completions",
        headers=bearer(key),
        json={"model": "m", "messages": [{"role": "user", "content": content(LIMIT - 1)}]},
    )
    # 28 * 199 + 2 = 5,574 bytes: over 5,572, so at least 200 tokens
    assert over.status_code == 400 and "5,574+ bytes" in over.text, over.text
    assert spy.longest_render < SMALL and spy.longest_encode < SMALL
    assert len(engine.requests) == 1


def test_text_not_counted_before_rendering_is_checked_before_tokenizing(watched):
    url, _, key, engine, spy = watched
    arguments = '{"patch": "' + "a" * 100_000 + '"}'  # tool-call arguments are not counted
    messages = [
        {"role": "user", "content": "fix it"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "edit", "arguments": arguments},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    spy.reset()
    response = httpx.post(
        f"{url}/v1/chat/completions", headers=bearer(key), json={"model": "m", "messages": messages}
    )
    assert response.status_code == 400 and "refused before tokenizing" in response.text
    assert spy.longest_render > 100_000 and spy.longest_encode < SMALL
    assert not engine.requests


def test_a_requests_max_total_tokens_lowers_the_bound(watched):
    url, _, key, engine, _ = watched
    body = {
        "model": "m",
        "max_total_tokens": 10,
        "messages": [{"role": "user", "content": "word " * 100}],  # 499 bytes > 9 * 28
    }
    response = httpx.post(f"{url}/v1/chat/completions", headers=bearer(key), json=body)
    assert response.status_code == 400 and "max_total_tokens" in response.text
    assert "fewer than 10 tokens" in response.text and not engine.requests
