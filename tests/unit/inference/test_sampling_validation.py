"""Sampling parameters are checked by SGLang's rules, and one bad request fails alone.

The acceptance case of the issue: a NaN penalty gets a 400 naming the field while a
request batched with it completes; a request that slips past validation and breaks
sampling fails alone, as does one whose prefill breaks.
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import pytest
import torch

from areal.inference.engine import GenerationEngine, GenerationRequest
from areal.inference.sampling import SamplingParams, sample_tokens
from areal.inference.server import create_app
from tests.fakes.live_server import serve

NAN, INF = float("nan"), float("inf")


@pytest.fixture(scope="module")
def generation(tiny_model_dir):
    engine = GenerationEngine(str(tiny_model_dir), device="cpu", max_running_requests=8).start()
    yield engine
    engine.stop()


@pytest.fixture(scope="module")
def server(generation):
    with serve(create_app(generation)) as url:
        yield url


def long_body(max_new_tokens: int = 48, **params) -> dict:
    return {
        "input_ids": [5, 6, 7, 8],
        "return_logprob": True,
        "sampling_params": {"max_new_tokens": max_new_tokens, "ignore_eos": True, **params},
    }


def raw_json(body: dict) -> bytes:
    """JSON as Python writes it: NaN and Infinity become the bare words SGLang's parser
    (and FastAPI's) accept."""
    return json.dumps(body).encode()


# --- the rules themselves (SGLang's SamplingParams.verify, plus finite floats) ---

BAD_VALUES = [
    ({"frequency_penalty": NAN}, "frequency_penalty"),
    ({"frequency_penalty": 1e300}, "frequency_penalty"),
    ({"frequency_penalty": -INF}, "frequency_penalty"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"presence_penalty": NAN}, "presence_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"repetition_penalty": 2.5}, "repetition_penalty"),
    ({"temperature": INF}, "temperature"),  # SGLang itself lets inf and NaN through
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"max_new_tokens": 4, "min_new_tokens": 5}, "min_new_tokens"),
    ({"sampling_seed": 2**64}, "sampling_seed"),
]
# refused by this server before, through pydantic ranges; now by the same rules as above
ALSO_BAD = [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": NAN}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
]


@pytest.mark.parametrize(("params", "field"), BAD_VALUES + ALSO_BAD)
def test_verify_names_the_field_sglang_would_refuse(params, field):
    from areal.inference.sampling import SamplingParamsError

    with pytest.raises(SamplingParamsError) as error:
        SamplingParams(**params).verify()
    assert error.value.field == field and str(error.value).startswith(field)


@pytest.mark.parametrize(("params", "field"), BAD_VALUES)
def test_out_of_range_values_get_400_naming_the_field(server, params, field):
    body = long_body(4)
    body["sampling_params"].update(params)
    response = httpx.post(
        f"{server}/generate", content=raw_json(body), headers={"content-type": "application/json"}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == f"sampling_params.{field}"
    assert f"sampling_params.{field}" in error["message"]


def test_values_at_the_edges_of_the_ranges_are_accepted_and_act(server):
    edges = {
        "frequency_penalty": -2.0,
        "presence_penalty": 2.0,
        "repetition_penalty": 2.0,
        "top_p": 1.0,
        "top_k": -1,
        "temperature": 0.0,
        "min_new_tokens": 3,
        "max_new_tokens": 3,
    }
    response = httpx.post(
        f"{server}/generate", json={"input_ids": [5, 6], "sampling_params": edges}
    )
    assert response.status_code == 200, response.text
    assert len(response.json()["output_ids"]) == 3
    # min_p 1 keeps only the likeliest token: sampling at temperature 1 becomes greedy
    greedy, min_p_one = (
        httpx.post(f"{server}/generate", json=long_body(12, **params)).json()["output_ids"]
        for params in ({"temperature": 0.0}, {"temperature": 1.0, "min_p": 1.0})
    )
    assert min_p_one == greedy


def test_unknown_and_unsupported_keys_get_400(server):
    unknown = httpx.post(
        f"{server}/generate", json={"input_ids": [5], "sampling_params": {"frequency": 0.5}}
    )
    assert unknown.status_code == 400 and unknown.json()["error"]["param"] == (
        "sampling_params.frequency"
    )
    regex = httpx.post(
        f"{server}/generate", json={"input_ids": [5], "sampling_params": {"regex": "a+"}}
    )
    assert regex.status_code == 400 and "not supported" in regex.json()["error"]["message"]


async def test_a_nan_penalty_gets_400_while_a_batched_request_completes(server, generation):
    async with httpx.AsyncClient(timeout=120) as http:
        running = asyncio.create_task(http.post(f"{server}/generate", json=long_body(48)))
        while generation.load()["running"] == 0:  # the good request is mid-decode
            await asyncio.sleep(0.005)
        bad = await http.post(
            f"{server}/generate",
            content=raw_json(long_body(48, frequency_penalty=NAN)),
            headers={"content-type": "application/json"},
        )
        good = await running
    assert bad.status_code == 400
    assert bad.json()["error"]["param"] == "sampling_params.frequency_penalty"
    assert good.status_code == 200, good.text
    logprobs = [p[0] for p in good.json()["meta_info"]["output_token_logprobs"]]
    assert len(logprobs) == 48 and all(math.isfinite(lp) for lp in logprobs)


# --- defence in depth: what slips past validation fails alone ---


def paused(engine: GenerationEngine):
    """Hold the loop so that several requests are admitted in the same step."""
    engine.command("pause", mode="in_place").result(timeout=30)


def test_a_request_that_breaks_sampling_fails_alone(generation):
    paused(generation)
    try:
        good = [
            generation.submit(
                GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=16, ignore_eos=True), r)
            )
            for r in ("good-1", "good-2")
        ]
        bad_params = SamplingParams(max_new_tokens=16, ignore_eos=True, frequency_penalty=0.5)
        bad = generation.submit(GenerationRequest([5, 6, 7], bad_params, "bad"))
        bad_params.frequency_penalty = NAN  # after validation: the sampler sees NaN logits
    finally:
        generation.command("continue").result(timeout=30)
    for future in good:
        result = future.result(timeout=120)
        assert len(result.output_ids) == 16 and result.finish_reason["type"] == "length"
    with pytest.raises(Exception, match="sampling"):
        bad.result(timeout=120)
    assert generation.load() == {"running": 0, "waiting": 0}


def test_a_prefill_that_breaks_fails_only_its_request(generation, monkeypatch):
    forward = generation.model.forward
    poison = 977

    def fragile_forward(*args, **kwargs):
        if bool((kwargs["input_ids"] == poison).any()):
            raise RuntimeError("this prompt breaks the forward pass")
        return forward(*args, **kwargs)

    monkeypatch.setattr(generation.model, "forward", fragile_forward)
    paused(generation)
    try:
        params = SamplingParams(max_new_tokens=8, ignore_eos=True)
        good = generation.submit(GenerationRequest([5, 6, 7], params, "good"))
        bad = generation.submit(GenerationRequest([5, poison, 7], params, "poison"))
    finally:
        generation.command("continue").result(timeout=30)
    assert len(good.result(timeout=120).output_ids) == 8
    with pytest.raises(Exception, match="prefill"):
        bad.result(timeout=120)  # resolved, not left hanging


def test_a_cancelled_request_leaves_the_batch(generation):
    params = SamplingParams(max_new_tokens=1500, ignore_eos=True)
    future = generation.submit(GenerationRequest([5, 6, 7], params, "abandoned"))
    while generation.load()["running"] == 0:
        time.sleep(0.005)
    assert future.cancel()  # what an HTTP deadline does
    deadline = time.monotonic() + 30
    while generation.load()["running"]:
        assert time.monotonic() < deadline, "the cancelled request is still decoding"
        time.sleep(0.01)
    assert generation.stats["cancelled_requests"] >= 1


# --- the sampler ---


def test_the_sampler_names_rows_without_a_distribution_before_drawing():
    from areal.inference.sampling import SamplingError

    logits = torch.tensor([[1.0, 2.0, 3.0], [NAN, 0.0, 0.0], [1.0, INF, 0.0]])
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=0.0)]
    generator = torch.Generator().manual_seed(0)
    state = generator.get_state()
    with pytest.raises(SamplingError) as error:
        sample_tokens(logits, params, [[]] * 3, [set()] * 3, [generator, None, None])
    assert error.value.rows == [1, 2]
    assert torch.equal(generator.get_state(), state)  # nothing was drawn


def test_presence_and_repetition_penalties_follow_sglang():
    # presence: every seen token loses the penalty once, however often it was seen.
    # logits (2.0, 2.0, 1.5), token 0 seen twice, presence 0.3 -> (1.7, 2.0, 1.5): argmax 1
    tokens, logprobs = sample_tokens(
        torch.tensor([[2.0, 2.0, 1.5]]),
        [SamplingParams(temperature=0.0, presence_penalty=0.3)],
        [[0, 0]],
        [set()],
        [None],
    )
    expected = 2.0 - math.log(math.exp(1.7) + math.exp(2.0) + math.exp(1.5))
    assert tokens.tolist() == [1] and abs(logprobs.item() - expected) < 1e-6
    # repetition 2: a seen positive logit is halved, a seen negative one doubled.
    # (3.0, 2.0, -1.0) with tokens 0 and 2 seen -> (1.5, 2.0, -2.0): argmax 1
    tokens, logprobs = sample_tokens(
        torch.tensor([[3.0, 2.0, -1.0]]),
        [SamplingParams(temperature=0.0, repetition_penalty=2.0)],
        [[0, 2]],
        [set()],
        [None],
    )
    expected = 2.0 - math.log(math.exp(1.5) + math.exp(2.0) + math.exp(-2.0))
    assert tokens.tolist() == [1] and abs(logprobs.item() - expected) < 1e-6


def test_min_p_keeps_tokens_near_the_likeliest():
    torch.manual_seed(0)
    # probabilities ~ (0.66, 0.24, 0.09, 0.01); min_p 0.3 keeps tokens >= 0.2: tokens 0, 1
    logits = torch.tensor([[3.0, 2.0, 1.0, -1.0]] * 300)
    tokens, _ = sample_tokens(
        logits, [SamplingParams(min_p=0.3)] * 300, [[]] * 300, [set()] * 300, [None] * 300
    )
    assert set(tokens.tolist()) == {0, 1}


def test_tiny_temperatures_are_greedy_and_negative_stop_ids_ban_nothing():
    tokens, logprobs = sample_tokens(
        torch.tensor([[1.0, 3.0, 2.0]]),
        [SamplingParams(temperature=1e-300, min_new_tokens=2)],
        [[]],
        [{-2, 10**30}],  # never tokens of this vocabulary: nothing to ban
        [None],
    )
    expected = 3.0 - math.log(math.exp(1) + math.exp(3) + math.exp(2))
    assert tokens.tolist() == [1] and abs(logprobs.item() - expected) < 1e-6
