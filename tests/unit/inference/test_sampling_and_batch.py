"""Sampling rules and the running batch's cache surgery (embedded inference server)."""

from __future__ import annotations

import math

import torch
from transformers import AutoModelForCausalLM

from areal.inference.batch import RunningBatch, cache_kwarg, prefill_inputs
from areal.inference.sampling import SamplingParams, sample_tokens


def sample(logits, params, outputs=None, stops=None, generators=None):
    n = len(params)
    return sample_tokens(
        torch.tensor(logits, dtype=torch.float32),
        params,
        outputs or [[]] * n,
        stops or [set()] * n,
        generators or [None] * n,
    )


def test_greedy_and_reported_logprob():
    tokens, logprobs = sample([[1.0, 3.0, 2.0]], [SamplingParams(temperature=0.0)])
    # log softmax of 3 among (1, 3, 2): 3 - log(e^1 + e^3 + e^2)
    expected = 3.0 - math.log(math.exp(1) + math.exp(3) + math.exp(2))
    assert tokens.tolist() == [1] and abs(logprobs.item() - expected) < 1e-6


def test_temperature_scales_the_reported_logprob():
    torch.manual_seed(0)
    tokens, logprobs = sample([[0.0, 2.0]], [SamplingParams(temperature=2.0)])
    scaled = torch.log_softmax(torch.tensor([0.0, 1.0]), -1)  # logits / 2
    assert abs(logprobs.item() - scaled[tokens.item()].item()) < 1e-6


def test_top_k_and_top_p_truncate():
    torch.manual_seed(0)
    logits = [[5.0, 4.0, 0.0, -1.0]] * 200
    k1 = sample(logits, [SamplingParams(top_k=1)] * 200)[0]
    assert set(k1.tolist()) == {0}
    k2 = sample(logits, [SamplingParams(top_k=2)] * 200)[0]
    assert set(k2.tolist()) <= {0, 1} and len(set(k2.tolist())) == 2
    # probabilities ~ (0.73, 0.27, 0.005, 0.002): top_p 0.5 keeps only the first token
    p = sample(logits, [SamplingParams(top_p=0.5)] * 200)[0]
    assert set(p.tolist()) == {0}


def test_min_new_tokens_masks_stop_tokens_and_penalty_applies():
    tokens, _ = sample(
        [[0.0, 9.0, 1.0]],
        [SamplingParams(temperature=0.0, min_new_tokens=2)],
        outputs=[[]],
        stops=[{1}],
    )
    assert tokens.tolist() == [2]  # the stop token 1 is banned before 2 tokens exist
    tokens, _ = sample(
        [[0.0, 1.0, 0.9]], [SamplingParams(temperature=0.0, frequency_penalty=0.5)], outputs=[[1]]
    )
    assert tokens.tolist() == [2]  # 1.0 - 0.5 * count(1) < 0.9


def test_seeded_sampling_is_reproducible():
    logits = [[0.0] * 50]
    first = sample(
        logits, [SamplingParams(sampling_seed=7)], generators=[torch.Generator().manual_seed(7)]
    )[0]
    second = sample(
        logits, [SamplingParams(sampling_seed=7)], generators=[torch.Generator().manual_seed(7)]
    )[0]
    assert first.tolist() == second.tolist()


def test_batch_merge_keep_and_trim_match_single_runs(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    kw = cache_kwarg(model)
    from transformers import DynamicCache

    def single_logits(prompt, steps):
        ids, out = list(prompt), []
        with torch.no_grad():
            for _ in range(steps):
                logits = model(torch.tensor([ids])).logits[0, -1]
                out.append(logits)
                ids.append(int(logits.argmax()))
        return out

    prompts = [[5, 6, 7], list(range(100, 120)), [900, 901]]
    batch = RunningBatch()
    with torch.no_grad():
        for group in ([prompts[0]], [prompts[1], prompts[2]]):  # two admissions, then merge
            inputs = prefill_inputs(group, torch.device("cpu"))
            cache = DynamicCache()
            logits = model(**inputs, **{kw: cache}, use_cache=True).logits[:, -1]
            batch.merge(cache, inputs["attention_mask"], logits.argmax(-1))
        steps = []
        for step in range(4):
            logits = model(**batch.decode_inputs(), **{kw: batch.cache}, use_cache=True).logits[
                :, -1
            ]
            steps.append(logits)
            batch.advance(logits.argmax(-1))
            if step == 1:  # the long prompt leaves; all-padding columns get trimmed
                steps_before = batch.length
                batch.keep([0, 2])
                assert batch.length < steps_before
    references = [single_logits(p, 5) for p in prompts]
    for step, logits in enumerate(steps):
        rows = [0, 1, 2] if step <= 1 else [0, 2]
        for row_index, prompt_index in enumerate(rows):
            assert torch.allclose(logits[row_index], references[prompt_index][step + 1], atol=1e-4)
