"""JSONL dumps of rollout groups for inspection (``rollout.dump_to_file``).

One file per group, ``{root}/{role}/{max version in group}/{task_id}.jsonl``, one line per
sample:

* ``task_id``, ``sample_idx`` (row in the group), ``seqlen`` (non-padding tokens);
* ``prompt_len``: index of the first trainable token;
* ``head_version`` / ``tail_version``: min / max weight version over trainable tokens;
* ``version_rle``: ``[[version, count], ...]`` over the whole sequence, so prompt and
  context tokens (version -1) show where each turn starts;
* ``reward``, ``prompt`` (decoded with special tokens) and ``completion`` (the rest);
* ``segments`` for multi-turn samples only (more than one trainable span):
  ``[{"role": "prompt" | "context" | "gen", "len", "text"}, ...]``;
* ``original_reward`` when the group carries ``original_rewards``.

Samples whose last token is not trainable (nothing was generated after the last context)
are skipped. Rows are right-padded: the first ``attention_mask.sum()`` tokens are real.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["dump_trajectories", "trajectory_records"]


def _run_lengths(values: list[int]) -> list[list[int]]:
    runs: list[list[int]] = []
    for v in values:
        if runs and runs[-1][0] == v:
            runs[-1][1] += 1
        else:
            runs.append([v, 1])
    return runs


def _decode(tokenizer: Any, ids: list[int]) -> str | None:
    if tokenizer is None:
        return None
    return tokenizer.decode(ids, skip_special_tokens=False)


def _segments(ids: list[int], trainable: list[bool], tokenizer: Any) -> list[dict[str, Any]]:
    """Maximal spans of equal trainability: the first untrainable one is the prompt."""
    segments: list[dict[str, Any]] = []
    start = 0
    for i in range(1, len(ids) + 1):
        if i == len(ids) or trainable[i] != trainable[start]:
            if trainable[start]:
                role = "gen"
            else:
                role = "prompt" if not segments else "context"
            span = ids[start:i]
            segments.append({"role": role, "len": len(span), "text": _decode(tokenizer, span)})
            start = i
    return segments


def _rows(group: Mapping[str, torch.Tensor]) -> int:
    return int(group["input_ids"].shape[0])


def trajectory_records(
    groups: Sequence[Mapping[str, torch.Tensor]], tokenizer: Any, task_id: int | str
) -> list[dict[str, Any]]:
    """The JSON records of every dumpable sample of ``groups`` (see the module docstring).

    Each group holds ``input_ids``, ``attention_mask``, ``loss_mask``, ``versions`` of
    shape ``[n, L]``, ``rewards`` of shape ``[n]`` and optionally ``original_rewards``.
    Samples are numbered across the groups in order.
    """
    records = []
    sample_idx = -1
    for group in groups:
        rewards = group["rewards"].reshape(_rows(group), -1)[:, -1]
        original = group.get("original_rewards")
        if original is not None:
            original = original.reshape(_rows(group), -1)[:, -1]
        for row in range(_rows(group)):
            sample_idx += 1
            seqlen = int(group["attention_mask"][row].sum())
            ids = group["input_ids"][row, :seqlen].tolist()
            trainable = [bool(m) for m in group["loss_mask"][row, :seqlen].tolist()]
            versions = [int(v) for v in group["versions"][row, :seqlen].tolist()]
            if seqlen == 0 or not trainable[-1]:
                continue
            prompt_len = trainable.index(True)
            gen_versions = [v for v, t in zip(versions, trainable) if t]
            record: dict[str, Any] = {
                "task_id": task_id,
                "sample_idx": sample_idx,
                "seqlen": seqlen,
                "prompt_len": prompt_len,
                "head_version": min(gen_versions),
                "tail_version": max(gen_versions),
                "version_rle": _run_lengths(versions),
                "reward": float(rewards[row]),
                "prompt": _decode(tokenizer, ids[:prompt_len]),
                "completion": _decode(tokenizer, ids[prompt_len:]),
            }
            if not all(trainable[prompt_len:]):
                record["segments"] = _segments(ids, trainable, tokenizer)
            if original is not None:
                record["original_reward"] = float(original[row])
            records.append(record)
    return records


def dump_trajectories(
    batch_or_samples: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
    tokenizer: Any,
    root: str | Path,
    role: str,
    task_id: int | str,
) -> Path | None:
    """Write one group (a dict of ``[n, L]`` tensors, or a list of such dicts) as JSONL.

    Returns the file written, or ``None`` when no sample had a trainable last token.
    ``tokenizer`` may be ``None``, which leaves the text fields ``null``.
    """
    if isinstance(batch_or_samples, Mapping):
        groups = [batch_or_samples]
    else:
        groups = list(batch_or_samples)
    records = trajectory_records(groups, tokenizer, task_id)
    if not records:
        return None
    max_version = max(int(g["versions"].max()) for g in groups)
    path = Path(root) / role / str(max_version) / f"{task_id}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path
