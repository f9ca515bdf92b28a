"""Trajectory dump format on a hand-built group."""

from __future__ import annotations

import json

import torch

from areal.utils.trajectory_dump import dump_trajectories


class FakeTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        assert skip_special_tokens is False  # dumps keep special tokens
        return " ".join(f"<{i}>" for i in ids)


def _group() -> dict[str, torch.Tensor]:
    # row 0: single turn (3 prompt + 2 generated tokens, 2 padding)
    # row 1: last real token not trainable -> skipped
    # row 2: multi-turn: prompt(2) gen(2) context(1) gen(2)
    return {
        "input_ids": torch.tensor(
            [
                [11, 12, 13, 21, 22, 0, 0],
                [11, 12, 13, 31, 32, 0, 0],
                [11, 12, 41, 42, 51, 61, 62],
            ]
        ),
        "attention_mask": torch.tensor(
            [[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]]
        ),
        "loss_mask": torch.tensor(
            [[0, 0, 0, 1, 1, 0, 0], [0, 0, 0, 1, 0, 0, 0], [0, 0, 1, 1, 0, 1, 1]]
        ),
        "versions": torch.tensor(
            [
                [-1, -1, -1, 4, 5, -1, -1],
                [-1, -1, -1, 4, -1, -1, -1],
                [-1, -1, 5, 5, -1, 6, 6],
            ]
        ),
        "rewards": torch.tensor([1.0, 0.0, 0.0]),
        "original_rewards": torch.tensor([2.0, 1.0, 0.5]),
    }


def test_dump_format(tmp_path):
    path = dump_trajectories(_group(), FakeTokenizer(), tmp_path, "rollout", task_id=17)
    assert path == tmp_path / "rollout" / "6" / "17.jsonl"  # 6 = max version in the group
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert records == [
        {
            "task_id": 17,
            "sample_idx": 0,
            "seqlen": 5,
            "prompt_len": 3,
            "head_version": 4,
            "tail_version": 5,
            "version_rle": [[-1, 3], [4, 1], [5, 1]],
            "reward": 1.0,
            "prompt": "<11> <12> <13>",
            "completion": "<21> <22>",
            "original_reward": 2.0,
        },
        {
            "task_id": 17,
            "sample_idx": 2,
            "seqlen": 7,
            "prompt_len": 2,
            "head_version": 5,
            "tail_version": 6,
            "version_rle": [[-1, 2], [5, 2], [-1, 1], [6, 2]],
            "reward": 0.0,
            "prompt": "<11> <12>",
            "completion": "<41> <42> <51> <61> <62>",
            "segments": [
                {"role": "prompt", "len": 2, "text": "<11> <12>"},
                {"role": "gen", "len": 2, "text": "<41> <42>"},
                {"role": "context", "len": 1, "text": "<51>"},
                {"role": "gen", "len": 2, "text": "<61> <62>"},
            ],
            "original_reward": 0.5,
        },
    ]


def test_list_of_groups_numbers_samples_across_them(tmp_path):
    group = _group()
    del group["original_rewards"]
    first = {k: v[:1] for k, v in group.items()}
    rest = {k: v[1:] for k, v in group.items()}
    path = dump_trajectories([first, rest], None, tmp_path, "eval-rollout", task_id=3)
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["sample_idx"] for r in records] == [0, 2]
    assert all("original_reward" not in r for r in records)
    assert records[0]["prompt"] is None and records[0]["completion"] is None
    assert path.parent == tmp_path / "eval-rollout" / "6"


def test_group_without_dumpable_samples_writes_nothing(tmp_path):
    group = {k: v[1:2] for k, v in _group().items()}
    assert dump_trajectories(group, FakeTokenizer(), tmp_path, "rollout", task_id=1) is None
    assert not (tmp_path / "rollout").exists()
