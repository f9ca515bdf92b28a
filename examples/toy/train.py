"""``python -m examples.toy.train --config examples/toy/toy_grpo.yaml [key=value ...]``.

Builds the tiny model if ``actor.path`` does not exist yet, then trains with GRPO on the
token-reward task on the local scheduler (embedded ``hf`` inference server, FSDP actor).
"""

from __future__ import annotations

import sys
from pathlib import Path

from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.api.config.support import refuse_unsupported
from areal.trainer.rl_trainer import PPOTrainer
from examples.toy.token_reward import make_dataset

WORKFLOW = "examples.toy.token_reward.TokenRewardWorkflow"


def build_inputs(config: GRPOConfig) -> tuple[list[dict], str, dict]:
    """The dataset, workflow path and workflow kwargs of a run (builds the model if absent)."""
    model = Path(config.actor.path)
    if not (model / "config.json").exists():
        from areal.utils.tiny_model import build_tiny_model

        build_tiny_model(model, seed=config.seed)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    vocab = len(tokenizer)
    first = 10  # keep prompts and targets clear of the special tokens
    quarter = (vocab - first) // 4
    dataset = make_dataset(64, prompt_len=8, vocab=(first, vocab), seed=config.seed)
    workflow_kwargs = {
        "target_start": first,
        "target_end": first + quarter,
        "max_new_tokens": config.gconfig.max_new_tokens,
        "temperature": config.gconfig.temperature,
    }
    return dataset, WORKFLOW, workflow_kwargs


def main(argv: list[str] | None = None) -> None:
    config, _ = load_expr_config(sys.argv[1:] if argv is None else argv, GRPOConfig)
    refuse_unsupported(config)  # before the model is built or any worker starts
    dataset, workflow, workflow_kwargs = build_inputs(config)
    with PPOTrainer(config, dataset) as trainer:
        trainer.train(workflow, workflow_kwargs)


if __name__ == "__main__":
    main()
