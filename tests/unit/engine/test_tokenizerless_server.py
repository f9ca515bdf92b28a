"""A server run with ``skip_tokenizer_init`` gets no stop strings: the client applies them.

The peer behaves as SGLang 0.5.23 does without a tokenizer: ``stop`` or ``min_new_tokens``
in ``sampling_params`` is a 400, and ``/get_server_info`` reports the flag.
"""

from __future__ import annotations

import json

import httpx
import pytest

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.api.io_struct import ModelRequest
from areal.engine.sglang_remote import RemoteSGLangEngine
from tests.fakes.live_server import ScriptedASGI, serve
from tests.fakes.scripted_http import ScriptedHTTP, reply


def sglang_without_tokenizer(output: list[int]):
    """``/generate`` answers ``output`` (all of it: the server cannot see stop strings)."""

    def generate(request: httpx.Request) -> httpx.Response:
        params = json.loads(request.read())["sampling_params"]
        if params.get("stop") or params.get("min_new_tokens"):
            return httpx.Response(
                400, json={"error": {"message": "unavailable when skip_tokenizer_init=True"}}
            )
        stops = set(params.get("stop_token_ids") or [])
        cut = next((i + 1 for i, t in enumerate(output) if t in stops), len(output))
        reason = (
            {"type": "stop", "matched": output[cut - 1]}
            if cut < len(output) or (output[cut - 1] in stops)
            else {"type": "length", "length": cut}
        )
        pairs = [[-0.5, t, None] for t in output[:cut]]
        return httpx.Response(
            200,
            json={"output_ids": output[:cut], "meta_info": {
                "finish_reason": reason, "output_token_logprobs": pairs}},
        )  # fmt: skip

    peer = ScriptedHTTP()
    peer.on("GET", "/health", reply(200, {}))
    peer.on("GET", "/get_model_info", reply(200, {"model_path": "m"}))
    peer.on("GET", "/get_server_info", reply(200, {"skip_tokenizer_init": True}))
    peer.on("POST", "/generate", generate)
    return peer


@pytest.fixture
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


async def generate(peer: ScriptedHTTP, tokenizer, **sampling) -> tuple:
    with serve(ScriptedASGI(peer)) as url:
        engine = RemoteSGLangEngine(InferenceEngineConfig(backend="sglang:d1", setup_timeout=10))
        engine.initialize(addr=url.removeprefix("http://"))
        try:
            gconfig = GenerationHyperparameters(max_new_tokens=64, max_tokens=512, **sampling)
            request = ModelRequest(input_ids=[5, 6, 7], gconfig=gconfig, tokenizer=tokenizer)
            return await engine.agenerate(request)
        finally:
            engine.destroy()


async def test_a_multi_token_stop_string_is_cut_where_sglang_would_stop(tokenizer):
    text = " alpha beta STOP HERE gamma delta"
    output = tokenizer.encode(text, add_special_tokens=False)
    peer = sglang_without_tokenizer(output)
    response = await generate(peer, tokenizer, stop=["STOP HERE"])
    kept = tokenizer.decode(response.output_tokens)
    assert "STOP HERE" in kept and "gamma" not in kept
    # the shortest prefix that holds the stop string: one token less does not
    assert "STOP HERE" not in tokenizer.decode(response.output_tokens[:-1])
    assert response.stop_reason == "stop"
    assert len(response.output_logprobs) == len(response.output_tokens)
    sent = json.loads(peer.calls("POST", "/generate")[0].body)["sampling_params"]
    assert "stop" not in sent


async def test_a_one_token_stop_string_becomes_a_stop_token_id(tokenizer):
    special = tokenizer.convert_tokens_to_ids("<tool_call>")
    output = [*tokenizer.encode(" alpha beta", add_special_tokens=False), special, 11, 12]
    peer = sglang_without_tokenizer(output)
    response = await generate(peer, tokenizer, stop=["<tool_call>"])
    sent = json.loads(peer.calls("POST", "/generate")[0].body)["sampling_params"]
    assert special in sent["stop_token_ids"] and "stop" not in sent
    assert response.output_tokens[-1] == special and response.stop_reason == "stop"


async def test_min_new_tokens_is_refused_with_the_reason(tokenizer):
    peer = sglang_without_tokenizer([1, 2, 3])
    with pytest.raises(ValueError, match="min_new_tokens=2 needs a server that tokenizes"):
        await generate(peer, tokenizer, min_new_tokens=2)
    assert peer.calls("POST", "/generate") == []  # nothing was sent for SGLang to refuse
