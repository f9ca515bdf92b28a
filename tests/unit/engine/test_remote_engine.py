"""RemoteSGLangEngine against the real embedded server over loopback (issue acceptance:
greedy equality, log-prob fidelity, stops, interruptible generation, disk weight updates)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig
from areal.api.io_struct import ModelRequest, WeightUpdateMeta
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.inference.engine import GenerationEngine
from areal.inference.server import create_app
from areal.infra import workflow_context
from tests.fakes.live_server import serve


@pytest.fixture
def server(tiny_model_dir):
    engine = GenerationEngine(str(tiny_model_dir), device="cpu", max_running_requests=16).start()
    with serve(create_app(engine)) as url:
        yield url.removeprefix("http://")


@pytest.fixture
def engine(server):
    config = InferenceEngineConfig(
        backend="hf:d1", setup_timeout=30, request_timeout=60, consumer_batch_size=4
    )
    remote = RemoteSGLangEngine(config)
    remote.initialize(addr=server)
    yield remote
    remote.destroy()


@pytest.fixture(autouse=True)
async def close_http_clients():
    yield
    await workflow_context.close_clients()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def greedy(max_new_tokens: int, **kwargs) -> GenerationHyperparameters:
    return GenerationHyperparameters(
        greedy=True, max_new_tokens=max_new_tokens, max_tokens=2000, ignore_eos=True, **kwargs
    )


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Argmax decoding with full forward passes (EOS does not stop it)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


async def until(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    """Wait for ``condition`` (an event that must happen; failing after ``timeout``)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the condition"
        await asyncio.sleep(0.005)


def prompts() -> list[list[int]]:
    return [list(range(10, 40)), [5, 900, 17, 33], list(range(200, 320, 3)), [1000, 4, 4, 4, 4]]


async def test_greedy_equals_model_generate(engine, reference):
    gconfig = GenerationHyperparameters(greedy=True, max_new_tokens=24, max_tokens=2000)
    responses = await asyncio.gather(
        *(engine.agenerate(ModelRequest(input_ids=p, gconfig=gconfig)) for p in prompts())
    )
    for prompt, response in zip(prompts(), responses):
        with torch.no_grad():  # HF greedy decoding, stopping at EOS like the server
            expected = reference.generate(
                torch.tensor([prompt]), max_new_tokens=24, do_sample=False
            )
        assert response.output_tokens == expected[0, len(prompt) :].tolist()
        assert response.input_tokens == prompt
        assert response.output_versions == [0] * len(response.output_tokens)


async def test_greedy_without_eos_equals_argmax_decoding(engine, reference):
    responses = await asyncio.gather(
        *(engine.agenerate(ModelRequest(input_ids=p, gconfig=greedy(40))) for p in prompts())
    )
    for prompt, response in zip(prompts(), responses):
        assert response.output_tokens == greedy_reference(reference, prompt, 40)
        assert response.stop_reason == "length"


async def test_logprobs_match_a_teacher_forced_pass(engine, reference):
    gconfig = GenerationHyperparameters(
        temperature=1.0, max_new_tokens=32, max_tokens=2000, ignore_eos=True
    )
    responses = await asyncio.gather(
        *(engine.agenerate(ModelRequest(input_ids=p, gconfig=gconfig)) for p in prompts())
    )
    for prompt, response in zip(prompts(), responses):
        ids = torch.tensor([prompt + response.output_tokens])
        with torch.no_grad():
            logp = torch.log_softmax(reference(ids).logits[0].float(), dim=-1)
        forced = [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(response.output_tokens)]
        assert len(response.output_logprobs) == 32
        assert max(abs(a - b) for a, b in zip(response.output_logprobs, forced)) < 1e-4


async def test_stop_token_and_length(engine, reference):
    prompt = prompts()[2]
    free = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=greedy(12)))
    assert len(set(free.output_tokens)) > 6  # the tiny model's greedy output is not degenerate
    first = next(i for i in range(5, 12) if free.output_tokens[i] not in free.output_tokens[:i])
    stop_at = free.output_tokens[first]
    stopped = await engine.agenerate(
        ModelRequest(input_ids=prompt, gconfig=greedy(12, stop_token_ids=[stop_at]))
    )
    assert stopped.stop_reason == "stop"
    assert stopped.output_tokens == free.output_tokens[: first + 1]
    assert stopped.output_tokens_without_stop == free.output_tokens[:first]
    short = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=greedy(3)))
    assert short.stop_reason == "length" and short.output_tokens == free.output_tokens[:3]
    assert short.output_tokens_without_stop == short.output_tokens


async def test_budget_is_capped_by_max_tokens(engine):
    g = GenerationHyperparameters(greedy=True, max_new_tokens=100, max_tokens=34, ignore_eos=True)
    response = await engine.agenerate(ModelRequest(input_ids=list(range(10, 40)), gconfig=g))
    assert len(response.output_tokens) == 4  # 34 - 30 prompt tokens
    with pytest.raises(RuntimeError, match="no token budget"):
        await engine.agenerate(ModelRequest(input_ids=list(range(10, 44)), gconfig=g))


async def test_pause_mid_generation_resumes_with_two_versions(engine, reference):
    prompt = prompts()[0]
    gconfig = greedy(400)
    task = asyncio.create_task(engine.agenerate(ModelRequest(input_ids=prompt, gconfig=gconfig)))
    async with httpx.AsyncClient() as http:  # pause once the server is mid-generation
        while (await http.get(f"http://{engine.addresses[0]}/get_server_info")).json().get(
            "generated_tokens", 0
        ) < 40:
            await asyncio.sleep(0.005)
    # The weight-update barrier: begin holds rollouts and aborts in-flight requests; end
    # bumps the version (here, the servers' and the proxies') and lets everything go on.
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(None, engine.begin_weight_update, 1)
    # the aborted request comes back to the barrier (instead of returning what it has) and
    # stays there: only end_weight_update opens it
    await until(lambda: engine.barrier.held == 1 or task.done())
    assert not task.done()
    await loop.run_in_executor(None, engine.end_weight_update, 1)
    response = await task
    assert len(response.output_tokens) == 400 and response.stop_reason == "length"
    assert set(response.output_versions) == {0, 1}
    assert response.output_versions == sorted(response.output_versions)
    # same weights throughout, so the same tokens as an uninterrupted run
    assert response.output_tokens == greedy_reference(reference, prompt, 400)


async def test_a_proxys_engine_follows_the_workers_barrier(engine, server):
    """A rollout proxy's engine reads pause and version from its worker's barrier file."""
    loop = asyncio.get_running_loop()
    follower = RemoteSGLangEngine(InferenceEngineConfig(backend="hf:d1", setup_timeout=30))
    follower.attach_barrier(engine.barrier.path)
    await loop.run_in_executor(None, lambda: follower.initialize(addr=server))
    try:
        version = engine.get_version() + 1
        await loop.run_in_executor(None, engine.begin_weight_update, version)
        assert follower.barrier.closed and follower.workflow_executor.is_paused
        task = asyncio.create_task(
            follower.agenerate(ModelRequest(input_ids=[5, 6, 7], gconfig=greedy(3)))
        )
        # held at the worker's barrier, like the worker's own rollouts
        await until(lambda: follower.barrier.held == 1 or task.done())
        assert not task.done()
        await loop.run_in_executor(None, engine.end_weight_update, version)
        response = await task
        assert follower.get_version() == version
        assert response.output_versions == [version] * 3
    finally:
        follower.destroy()
    assert engine.get_version() == version  # the follower never writes the worker's state


async def test_a_closed_barrier_holds_generation(engine):
    loop = asyncio.get_running_loop()
    version = engine.get_version()
    await loop.run_in_executor(None, engine.begin_weight_update, version + 1)
    task = asyncio.create_task(
        engine.agenerate(ModelRequest(input_ids=[5, 6, 7], gconfig=greedy(4)))
    )
    await until(lambda: engine.barrier.held == 1 or task.done())  # held before sending
    assert not task.done()
    await loop.run_in_executor(None, engine.end_weight_update, version + 1)
    response = await task
    assert len(response.output_tokens) == 4
    assert response.output_versions == [version + 1] * 4  # tagged with the new version


async def test_update_weights_from_disk_changes_greedy_output(engine, tiny_model_dir_b):
    prompt = prompts()[0]
    before = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=greedy(16)))
    await asyncio.get_running_loop().run_in_executor(
        None,
        lambda: engine.update_weights_from_disk(
            WeightUpdateMeta(type="disk", path=str(tiny_model_dir_b))
        ).result(),
    )
    after = await engine.agenerate(ModelRequest(input_ids=prompt, gconfig=greedy(16)))
    other = AutoModelForCausalLM.from_pretrained(tiny_model_dir_b).eval()
    assert after.output_tokens == greedy_reference(other, prompt, 16)
    assert after.output_tokens != before.output_tokens


def test_bad_generate_bodies_get_400_and_the_server_keeps_serving(server):
    base = f"http://{server}"
    cases = [
        ({"sampling_params": {}}, "input_ids"),
        ({"input_ids": "hello"}, "input_ids"),
        ({"input_ids": [1, 2.5]}, "input_ids.1"),
        ({"input_ids": [1, 2], "sampling_params": {"top_p": 0}}, "sampling_params.top_p"),
        (
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 0}},
            "sampling_params.max_new_tokens",
        ),
        ({"input_ids": [1, 99999]}, "outside the vocabulary"),
        ({"input_ids": list(range(100)) * 21}, "longer than the model's context length"),
        (
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 2047}},
            "exceeds the model's maximum context length",
        ),
        ({"input_ids": [1, 2], "stream": True}, "stream"),
    ]
    for body, expected in cases:
        response = httpx.post(f"{base}/generate", json=body)
        assert response.status_code == 400, body
        assert expected in response.json()["error"]["message"], response.text
    response = httpx.post(
        f"{base}/generate", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert response.status_code == 400 and "not valid JSON" in response.json()["error"]["message"]
    ok = httpx.post(
        f"{base}/generate", json={"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    )
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2


def test_server_info_endpoints(server, tiny_model_dir):
    base = f"http://{server}"
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/get_model_info").json()["model_path"] == str(tiny_model_dir)
    assert httpx.post(f"{base}/flush_cache").status_code == 200
    info = httpx.get(f"{base}/get_server_info").json()
    assert info["backend"] == "hf" and info["context_length"] == 2048
    assert httpx.post(f"{base}/abort_request", json={}).status_code == 400


def test_nccl_weight_endpoints_explain_what_a_cpu_server_cannot_do(server):
    base = f"http://{server}"
    init = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    response = httpx.post(f"{base}/init_weights_update_group", json=init)
    assert response.status_code == 400
    assert "needs a CUDA server" in response.json()["error"]["message"]
    bucket = {"names": ["lm_head.weight"], "dtypes": ["bfloat16"], "shapes": [[2, 2]]}
    response = httpx.post(f"{base}/update_weights_from_distributed", json=bucket)
    assert response.status_code == 400
    assert "no weight-update group" in response.json()["error"]["message"]
    assert httpx.post(f"{base}/init_weights_update_group", json={}).status_code in (400, 422)


def test_destroy_callbacks_run_once_first_registration_wins():
    remote = RemoteSGLangEngine(InferenceEngineConfig(backend="hf:d1"))
    calls = []
    assert remote.register_destroy_callback("routes", lambda: calls.append("first"))
    assert not remote.register_destroy_callback("routes", lambda: calls.append("second"))
    assert remote.register_destroy_callback("boom", lambda: 1 / 0)  # logged, not raised
    remote.destroy()
    remote.destroy()
    assert calls == ["first"]
