"""The toy task: after a random prompt, produce tokens from a target set.

Each sample generates ``max_new_tokens`` tokens; its reward is the fraction of them that
fall in ``[target_start, target_end)``. A randomly initialized model starts near the set's
share of the vocabulary, and GRPO raises it within a few steps, which makes the task a
quick end-to-end check of rollout, advantages, the update and weight sync.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from areal.api.cli_args import GenerationHyperparameters
from areal.api.io_struct import ModelRequest
from areal.api.workflow_api import RolloutWorkflow

__all__ = ["TokenRewardWorkflow", "make_dataset"]


def make_dataset(rows: int, prompt_len: int, vocab: tuple[int, int], seed: int = 0) -> list[dict]:
    """``rows`` prompts of random token ids drawn from ``[vocab[0], vocab[1])``."""
    rng = random.Random(seed)
    return [
        {"id": i, "input_ids": [rng.randrange(*vocab) for _ in range(prompt_len)]}
        for i in range(rows)
    ]


class TokenRewardWorkflow(RolloutWorkflow):
    def __init__(
        self,
        target_start: int,
        target_end: int,
        max_new_tokens: int = 4,
        temperature: float = 1.0,
        stop_token_ids: list[int] | None = None,
    ):
        if not 0 <= target_start < target_end:
            raise ValueError(f"bad target range [{target_start}, {target_end})")
        self.target = (target_start, target_end)
        self.max_new_tokens = max_new_tokens
        self.temperature = temperature
        self.stop_token_ids = list(stop_token_ids or [])

    def reward(self, tokens: list[int]) -> float:
        if not tokens:
            return 0.0
        lo, hi = self.target
        return sum(lo <= t < hi for t in tokens) / len(tokens)

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, torch.Tensor]:
        prompt = list(data["input_ids"])
        gconfig = GenerationHyperparameters(
            n_samples=1,
            max_new_tokens=self.max_new_tokens,
            max_tokens=len(prompt) + self.max_new_tokens,
            temperature=self.temperature,
            stop_token_ids=self.stop_token_ids,
        )
        response = await engine.agenerate(
            ModelRequest(input_ids=prompt, gconfig=gconfig, rid=f"toy-{data['id']}")
        )
        output = list(response.output_tokens)
        n, m = len(prompt), len(output)
        return {
            "input_ids": torch.tensor([prompt + output], dtype=torch.long),
            "attention_mask": torch.ones(1, n + m, dtype=torch.bool),
            "loss_mask": torch.tensor([[0] * n + [1] * m], dtype=torch.long),
            "logprobs": torch.tensor([[0.0] * n + list(response.output_logprobs)]),
            "versions": torch.tensor([[-1] * n + list(response.output_versions)]),
            "rewards": torch.tensor([self.reward(output)]),
        }
