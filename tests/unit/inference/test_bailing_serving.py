"""The embedded server serving Ling 3 (KDA + MLA hybrid, grouped-router MoE), CPU float32.

The reference is what the trainer computes: a full forward pass (no cache) of prompt plus
output with the same checkpoint. Greedy outputs must be its argmax continuation and every
reported log-prob must be within 1e-5 of its ``log_softmax``, for concurrent requests of
different lengths, prefilled together with left padding (the 1-token prompt next to the
150-token one gets 149 padding positions, more than two 64-token KDA chunks), for requests
that join and leave a batch mid-decode, and after each kind of weight update (from disk,
and over a weight-update group), under official checkpoint names or the model's own.
"""

from __future__ import annotations

import concurrent.futures
import re
import time

import httpx
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from areal import models
from areal.inference.batch import cache_kwarg, prefill_inputs
from areal.inference.cache_rows import new_cache
from areal.inference.engine import GenerationEngine, GenerationRequest, GenerationResult
from areal.inference.sampling import SamplingParams
from areal.utils.nccl_group import broadcast, destroy_group, init_weight_update_group
from areal.utils.tiny_bailing import build_tiny_bailing_model
from tests.fakes.live_server import free_port
from tests.helpers.inference_server import server_process

TOL = 1e-5
# 1, 4, 70 and 150 tokens (the tiny Ling 3 vocabulary has 1036 ids)
PROMPTS = [[7], [5, 900, 17, 33], list(range(100, 170)), [(i * 37) % 1000 + 3 for i in range(150)]]


@pytest.fixture(scope="module")
def bailing_model_dir_b(tmp_path_factory):
    """The same tiny Ling 3 with other random weights (a trainer's new checkpoint)."""
    return build_tiny_bailing_model(tmp_path_factory.mktemp("tiny-bailing-b"), seed=1)


def load(path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def reference(bailing_model_dir):
    return load(bailing_model_dir)


@pytest.fixture(scope="module")
def reference_b(bailing_model_dir_b):
    return load(bailing_model_dir_b)


@pytest.fixture
def engine(bailing_model_dir):
    engine = GenerationEngine(str(bailing_model_dir), device="cpu", dtype="float32").start()
    yield engine
    engine.stop()


# --- helpers ---


def submit(
    engine: GenerationEngine, prompt: list[int], max_new_tokens: int, **params
) -> concurrent.futures.Future:
    params = {"temperature": 0.0, "ignore_eos": True, **params}
    request = GenerationRequest(
        prompt, SamplingParams(max_new_tokens=max_new_tokens, **params), rid=f"r{time.time_ns()}"
    )
    return engine.submit(request)


def generate_together(
    engine: GenerationEngine, prompts: list[list[int]], max_new_tokens: int, **params
) -> list[GenerationResult]:
    """Submit every prompt while the loop is frozen, so all are prefilled in one group."""
    engine.command("pause", mode="in_place").result(timeout=30)
    futures = [submit(engine, p, max_new_tokens, **params) for p in prompts]
    engine.command("continue").result(timeout=30)
    return [f.result(timeout=120) for f in futures]


@torch.no_grad()
def argmax_continuation(model, prompt: list[int], n: int) -> list[int]:
    """Greedy decoding by full forward passes, no cache."""
    ids = list(prompt)
    for _ in range(n):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@torch.no_grad()
def trainer_pass(model, prompt: list[int], output: list[int]) -> tuple[list[int], list[float]]:
    """What the trainer computes from one full forward of prompt + output: the argmax and
    the log-prob of ``output`` at each of its positions.

    By causality the argmax at position ``i`` is the next token of a no-cache forward of
    prompt + ``output[:i]``, so output equal to these argmaxes is the argmax continuation.
    """
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1 : -1].float()
    logp = torch.log_softmax(logits, dim=-1)
    return logp.argmax(-1).tolist(), logp.gather(-1, torch.tensor(output)[:, None])[:, 0].tolist()


def assert_served_by(model, prompt: list[int], output: list[int], logprobs: list[float]):
    argmax, expected = trainer_pass(model, prompt, output)
    assert output == argmax
    assert max(abs(a - b) for a, b in zip(logprobs, expected, strict=True)) <= TOL


def wait_for(condition, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting for the condition"
        time.sleep(0.001)


# --- the hybrid cache ---


@torch.no_grad()
def test_left_padding_leaves_no_trace_in_the_recurrent_state(reference):
    kw = cache_kwarg(reference)

    def prefill(prompts):
        cache = new_cache(reference)
        inputs = prefill_inputs(prompts, torch.device("cpu"))
        logits = reference(**inputs, **{kw: cache}, use_cache=True).logits[:, -1]
        return cache, logits

    short, long = PROMPTS[1], PROMPTS[3]
    together, logits = prefill([short, long])
    linear_layers = 0
    for row, prompt in enumerate((short, long)):
        alone, alone_logits = prefill([prompt])
        torch.testing.assert_close(logits[row], alone_logits[0], rtol=0, atol=TOL)
        for padded, unpadded in zip(together.layers, alone.layers, strict=True):
            if isinstance(padded, LinearAttentionCacheLayerMixin):  # KDA: state per row
                linear_layers += 1
                for states, reference_states in (
                    (padded.conv_states, unpadded.conv_states),
                    (padded.recurrent_states, unpadded.recurrent_states),
                ):
                    torch.testing.assert_close(
                        states[0][row], reference_states[0][0], rtol=0, atol=TOL
                    )
            else:  # MLA: the latent and rotary key of the real (rightmost) columns
                width = len(prompt)
                torch.testing.assert_close(
                    padded.keys[row, :, -width:], unpadded.keys[0], rtol=0, atol=TOL
                )
                torch.testing.assert_close(
                    padded.values[row, :, -width:], unpadded.values[0], rtol=0, atol=TOL
                )
    assert linear_layers == 2 * 2  # two KDA layers, checked for both rows


# --- generation ---


def test_concurrent_greedy_requests_equal_argmax_decoding(engine, reference):
    results = generate_together(engine, PROMPTS, max_new_tokens=16)
    # one batch: prefill gives the 1st token (the counter moves after results are settled)
    wait_for(lambda: engine.stats["decode_steps"] >= 15)
    assert engine.stats["decode_steps"] == 15
    for prompt, result in zip(PROMPTS, results):
        assert result.finish_reason["type"] == "length"
        assert result.output_ids == argmax_continuation(reference, prompt, 16)
        assert_served_by(reference, prompt, result.output_ids, result.output_logprobs)


def test_sampled_logprobs_equal_the_trainers(engine, reference):
    seeds = range(len(PROMPTS))
    futures = [
        submit(engine, p, 24, temperature=1.0, sampling_seed=seed)
        for p, seed in zip(PROMPTS, seeds)
    ]
    for prompt, future in zip(PROMPTS, futures):
        result = future.result(timeout=120)
        _, expected = trainer_pass(reference, prompt, result.output_ids)
        assert len(expected) == 24
        assert max(abs(a - b) for a, b in zip(result.output_logprobs, expected)) <= TOL


def test_requests_joining_and_leaving_mid_decode_change_no_other_output(engine, reference):
    first = PROMPTS[1]
    alone = submit(engine, first, 64).result(timeout=120)

    decoded = engine.stats["decode_steps"]
    running = submit(engine, first, 64)
    wait_for(lambda: engine.stats["decode_steps"] >= decoded + 5)
    engine.command("pause", mode="in_place").result(timeout=30)  # freeze it mid-decode
    assert not running.done()
    # the 150-token prompt widens the batch on the left, then leaves after 3 tokens (its
    # columns are trimmed); the 70-token one stays to the end
    leaving = submit(engine, PROMPTS[3], 3)
    staying = submit(engine, PROMPTS[2], 30)
    engine.command("continue").result(timeout=30)

    joined = running.result(timeout=120)
    assert joined.output_ids == alone.output_ids
    diff = max(abs(a - b) for a, b in zip(joined.output_logprobs, alone.output_logprobs))
    assert diff <= TOL
    for prompt, future in ((PROMPTS[3], leaving), (PROMPTS[2], staying)):
        result = future.result(timeout=120)
        assert_served_by(reference, prompt, result.output_ids, result.output_logprobs)
    assert_served_by(reference, first, joined.output_ids, joined.output_logprobs)


# --- weight updates ---


def hf_named_checkpoint(model, path) -> str:
    """``model``'s tensors under its own (``state_dict``) names, as a checkpoint dir."""
    path.mkdir()
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    save_file(state, str(path / "model.safetensors"))
    return str(path)


@pytest.mark.parametrize("names", ["official", "hf"])
def test_an_update_from_disk_serves_the_new_weights(
    engine, reference, reference_b, bailing_model_dir_b, tmp_path, names
):
    before = generate_together(engine, PROMPTS, max_new_tokens=12)
    path = (
        str(bailing_model_dir_b)
        if names == "official"
        else hf_named_checkpoint(reference_b, tmp_path / "hf-names")
    )
    answer = engine.command("update_weights", model_path=path).result(timeout=60)
    assert answer["success"]
    after = generate_together(engine, PROMPTS, max_new_tokens=12)
    for prompt, result in zip(PROMPTS, after):
        assert_served_by(reference_b, prompt, result.output_ids, result.output_logprobs)
    assert [r.output_ids for r in after] != [r.output_ids for r in before]


def buckets(model, names: str) -> list[list[tuple[str, torch.Tensor]]]:
    """The model's tensors in three buckets; under official names the cut falls inside a
    fused expert tensor (its experts arrive in two buckets)."""
    weights = list(model.state_dict().items())
    if names == "official":
        weights = list(models.checkpoint_weights(model.config, weights))
        cut = next(i for i, (n, _) in enumerate(weights) if re.search(r"experts\.1\.gate_", n))
    else:
        cut = len(weights) // 3
    middle = (cut + len(weights)) // 2
    return [weights[:cut], weights[cut:middle], weights[middle:]]


def generate_over_http(url: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
    }
    out = httpx.post(f"{url}/generate", json=body, timeout=120).json()
    pairs = out["meta_info"]["output_token_logprobs"]
    return [p[1] for p in pairs], [p[0] for p in pairs]


def join_as_trainer(url: str, group_name: str, pool) -> object:
    """Form a 2-rank gloo weight-update group: this process is the trainer (rank 0), the
    server at ``url`` joins as rank 1."""
    port = free_port()
    spec = {"master_address": "127.0.0.1", "master_port": port, "world_size": 2}
    joined = pool.submit(
        httpx.post,
        f"{url}/init_weights_update_group",
        json={**spec, "rank_offset": 1, "group_name": group_name, "backend": "gloo"},
        timeout=120,
    )
    group = init_weight_update_group(
        backend="gloo", rank=0, group_name=group_name, timeout_s=60, **spec
    )
    assert joined.result(timeout=120).status_code == 200
    return group


def send_bucket(url: str, group, group_name: str, bucket, pool) -> None:
    """What the trainer does per bucket: announce it over HTTP while broadcasting it."""
    spec = {
        "names": [n for n, _ in bucket],
        "dtypes": [str(t.dtype).removeprefix("torch.") for _, t in bucket],
        "shapes": [list(t.shape) for _, t in bucket],
        "group_name": group_name,
    }
    loaded = pool.submit(
        httpx.post, f"{url}/update_weights_from_distributed", json=spec, timeout=120
    )
    for _, tensor in bucket:
        broadcast(group, tensor.detach().contiguous(), src=0)
    response = loaded.result(timeout=120)
    assert response.status_code == 200, response.text


def test_an_update_over_a_weight_update_group_serves_the_new_weights(
    bailing_model_dir, reference, reference_b
):
    """A trainer in this process broadcasts over gloo to a server process."""
    group_name = "bailing-weights"
    with (
        server_process(bailing_model_dir, "--dtype", "float32") as (_, url),
        concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool,
    ):
        group = join_as_trainer(url, group_name, pool)
        try:
            # new weights under official names, then the first ones back under HF names
            for model, names in ((reference_b, "official"), (reference, "hf")):
                for bucket in buckets(model, names):
                    send_bucket(url, group, group_name, bucket, pool)
                for prompt in (PROMPTS[1], PROMPTS[3]):
                    assert_served_by(model, prompt, *generate_over_http(url, prompt))
        finally:
            destroy_group(group)
