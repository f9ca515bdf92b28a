"""``python -m examples.toy.train --config examples/toy/toy_grpo.yaml [key=value ...]``.

Builds the tiny model if ``actor.path`` does not exist yet, then trains with GRPO on the
token-reward task on the local scheduler (embedded ``hf`` inference server, FSDP actor).
With ``valid_dataset`` set, held-out prompts are decoded greedily (``eval_gconfig``) on the
``evaluator`` schedule, and their reward is logged as ``eval-rollout/reward_mean``.
"""

from __future__ import annotations

import sys
from pathlib import Path

from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.api.config.support import refuse_unsupported
from areal.infra.workflow_paths import workflow_kind
from areal.trainer.rl_trainer import PPOTrainer
from examples.toy.token_reward import make_dataset

WORKFLOW = "examples.toy.token_reward.TokenRewardWorkflow"
FIRST_ID = 10  # prompts and targets keep clear of the special tokens
PROMPT_LEN = 8
VALID_ROWS = 8


def _vocab_size(model: Path) -> int:
    from transformers import AutoTokenizer

    return len(AutoTokenizer.from_pretrained(model))


def build_inputs(config: GRPOConfig) -> tuple[list[dict], str, dict]:
    """The dataset, workflow path and workflow kwargs of a run (builds the model if absent)."""
    model = Path(config.actor.path)
    if not (model / "config.json").exists():
        from areal.utils.tiny_model import build_tiny_model

        build_tiny_model(model, seed=config.seed)
    vocab, first = _vocab_size(model), FIRST_ID
    quarter = (vocab - first) // 4
    dataset = make_dataset(64, prompt_len=PROMPT_LEN, vocab=(first, vocab), seed=config.seed)
    workflow_kwargs = {
        "target_start": first,
        "target_end": first + quarter,
        "max_new_tokens": config.gconfig.max_new_tokens,
        "temperature": config.gconfig.temperature,
    }
    return dataset, WORKFLOW, workflow_kwargs


def build_eval_inputs(
    config: GRPOConfig, workflow_kwargs: dict
) -> tuple[list[dict] | None, dict | None]:
    """Held-out prompts (another seed than training's) and the eval workflow kwargs
    (``eval_gconfig``'s temperature); ``(None, None)`` without ``valid_dataset``."""
    if config.valid_dataset is None:
        return None, None
    vocab = _vocab_size(Path(config.actor.path))
    rows = make_dataset(VALID_ROWS, PROMPT_LEN, vocab=(FIRST_ID, vocab), seed=config.seed + 1)
    return rows, {**workflow_kwargs, "temperature": config.eval_gconfig.temperature}


def main(argv: list[str] | None = None) -> None:
    config, _ = load_expr_config(sys.argv[1:] if argv is None else argv, GRPOConfig)
    refuse_unsupported(config)  # before the model is built or any worker starts
    dataset, workflow, workflow_kwargs = build_inputs(config)
    valid, eval_workflow_kwargs = build_eval_inputs(config, workflow_kwargs)
    workflow_kind(workflow)  # a workflow path that does not import: refused before workers
    with PPOTrainer(config, dataset, valid) as trainer:
        trainer.train(
            workflow,
            eval_workflow=workflow if valid is not None else None,
            workflow_kwargs=workflow_kwargs,
            eval_workflow_kwargs=eval_workflow_kwargs,
        )


if __name__ == "__main__":
    main()
