"""JSONL dumps of rollout groups for inspection (``rollout.dump_to_file``).

The rollout worker that ran a group writes it once it is finished, accepted or rejected
by ``should_accept_fn`` (:class:`RolloutDumper`), so rejected groups are visible too. One
file per group, ``{fileroot}/logs/{user}/{exp}/{trial}/{rollout|eval-rollout}/{max version
in group}/{task_id}.jsonl`` (``{root}/{role}/...`` for :func:`dump_trajectories`), one
line per sample:

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

Under the root nothing is written through a symbolic link: each directory is entered with
``O_NOFOLLOW`` relative to its parent, and the file is opened the same way, so a link
planted at ``{role}``, ``{version}`` or the file name raises :class:`DumpPathError`
instead of redirecting the write. ``role`` and ``task_id`` must be single path parts.
Created directories are 0700 and files 0600 (dumps hold prompts and completions).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from areal.utils.paths import get_log_path, path_name_problem

__all__ = ["DumpPathError", "RolloutDumper", "dump_trajectories", "trajectory_records"]

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


class DumpPathError(OSError):
    """A dump path that is unsafe to write: a symlink, a non-directory or a bad name."""


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
    for what, name in (("role", role), ("task_id", str(task_id))):
        problem = path_name_problem(name)
        if problem is not None:
            raise DumpPathError(f"trajectory dump {what}: {problem}")
    max_version = max(int(g["versions"].max()) for g in groups)
    parts = [role, str(max_version)]
    filename = f"{task_id}.jsonl"
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    _write_under(Path(root), parts, filename, text.encode("utf-8"))
    return Path(root).joinpath(*parts, filename)


class RolloutDumper:
    """Writes a rollout worker's finished groups under the trial's log directory.

    ``config`` is the worker's ``rollout`` config: ``fileroot``, ``experiment_name`` and
    ``trial_name`` place the files (the trainer fills them in), ``tokenizer_path`` decodes
    the text fields (empty leaves them ``null``). The tokenizer loads on the first dump.
    """

    def __init__(self, config: Any):
        missing = [
            f"rollout.{name}"
            for name in ("fileroot", "experiment_name", "trial_name")
            if not getattr(config, name, None)
        ]
        if missing:
            raise ValueError(
                f"rollout.dump_to_file needs {', '.join(missing)} (the trainer sets them from "
                "cluster.fileroot, experiment_name and trial_name)"
            )
        self.root = get_log_path(config.fileroot, config.experiment_name, config.trial_name)
        self._tokenizer_path = getattr(config, "tokenizer_path", "") or ""
        self._tokenizer: Any = None
        self._lock = threading.Lock()

    def _get_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None and self._tokenizer_path:
                from transformers import AutoTokenizer

                self._tokenizer = AutoTokenizer.from_pretrained(self._tokenizer_path)
            return self._tokenizer

    def dump(
        self,
        trajectory: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
        task_id: int | str,
        is_eval: bool,
    ) -> Path | None:
        """Write one group (see :func:`dump_trajectories`); the file, or ``None``."""
        role = "eval-rollout" if is_eval else "rollout"
        return dump_trajectories(trajectory, self._get_tokenizer(), self.root, role, task_id)


def _enter(dir_fd: int, name: str, shown: Path) -> int:
    """A descriptor of directory ``name`` in ``dir_fd`` (created 0700), never a symlink."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    if stat.S_ISLNK(info.st_mode):
        raise DumpPathError(
            f"refusing to write a trajectory dump through the symbolic link {shown}; "
            "remove it (dumps are only written to real directories under the dump root)"
        )
    if not stat.S_ISDIR(info.st_mode):
        raise DumpPathError(f"trajectory dump path {shown} exists and is not a directory")
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as e:  # replaced by a link since the check
        raise DumpPathError(f"cannot enter trajectory dump directory {shown}: {e}") from None


def _is_link(dir_fd: int, name: str) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _write_under(root: Path, parts: list[str], filename: str, data: bytes) -> None:
    """Write ``data`` to ``root/parts.../filename`` without following any link under root."""
    root.mkdir(parents=True, exist_ok=True)  # the root itself is the caller's choice
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    shown = root
    try:
        for part in parts:
            shown = shown / part
            child = _enter(fd, part, shown)
            os.close(fd)
            fd = child
        shown = shown / filename
        try:
            out = os.open(filename, _FILE_FLAGS, 0o600, dir_fd=fd)
        except OSError:
            if _is_link(fd, filename):
                raise DumpPathError(
                    f"refusing to write a trajectory dump through the symbolic link {shown}; "
                    "remove it"
                ) from None
            raise
    finally:
        os.close(fd)
    try:
        info = os.fstat(out)
        # A FIFO or device, or a hard link to some other file, must not be written either.
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise DumpPathError(
                f"trajectory dump target {shown} is not a plain file of its own (a hard link, "
                "a FIFO or a device); remove it"
            )
        os.ftruncate(out, 0)
        view = memoryview(data)
        while view:
            view = view[os.write(out, view) :]
    finally:
        os.close(out)
