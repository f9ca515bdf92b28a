"""Recorded LLM calls of one session: parent links, rewards, export to training tensors.

An :class:`Interaction` is one chat call: the input messages, the prompt tokens the
engine received, and the tokens, log-probs and weight versions it returned. Inserting an
interaction into an :class:`InteractionCache` links it to its parent: the longest earlier
completed call whose messages plus answer are a prefix of the new messages. In
``concat`` mode a child's prompt starts with its parent's exact tokens, so a multi-turn
conversation exports as one token sequence (earlier turns keep their own log-probs).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from areal.api.io_struct import ModelResponse
from areal.utils import logging

__all__ = [
    "ExportedInteraction",
    "Interaction",
    "InteractionCache",
    "PrefixMatcher",
    "default_prefix_matcher",
]

logger = logging.getLogger("proxy.interaction")

PrefixMatcher = Callable[[list[dict], list[dict]], bool]
# the per-token training columns and their dtypes (besides attention_mask and rewards)
COLUMN_DTYPES = (
    ("input_ids", torch.int64),
    ("loss_mask", torch.int64),
    ("logprobs", torch.float32),
    ("versions", torch.int64),
    ("turn_ids", torch.int32),
)


def default_prefix_matcher(prefix: list[dict], messages: list[dict]) -> bool:
    """Whether ``prefix`` equals the first ``len(prefix)`` messages exactly."""
    return len(prefix) <= len(messages) and messages[: len(prefix)] == prefix


@dataclass
class Interaction:
    """One recorded chat call."""

    id: str
    messages: list[dict]
    chat_template_type: str = "hf"
    created: float = field(default_factory=time.time)
    prompt_tokens: list[int] = field(default_factory=list)
    response: ModelResponse | None = None
    output_message_list: list[dict] | None = None
    completion: dict | None = None
    reward: float | None = None
    original_reward: float | None = None
    parent: Interaction | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    metadata: dict[str, Any] = field(default_factory=dict)
    concat_prefix_mismatch: bool = False
    _columns: dict[str, list] | None = field(default=None, repr=False)

    @property
    def is_complete(self) -> bool:
        return self.response is not None and self.output_message_list is not None

    @property
    def sequence(self) -> list[int]:
        """Prompt tokens followed by generated tokens."""
        assert self.response is not None
        return self.prompt_tokens + self.response.output_tokens

    def columns(self) -> dict[str, list]:
        """Per-token training columns as lists, each ``len(sequence)`` long (cached).

        ``loss_mask`` is 1 on generated tokens; in concat mode the parent's positions are
        copied from the parent, so earlier model turns stay trainable with their own
        log-probs, versions and turn ids.
        """
        if self._columns is not None:
            return self._columns
        assert self.response is not None, "interaction has no response yet"
        out_len = len(self.response.output_tokens)
        seq = self.sequence
        n = len(seq)
        loss_mask = [0] * (n - out_len) + [1] * out_len
        logprobs = [0.0] * (n - out_len) + list(self.response.output_logprobs)
        versions = [-1] * (n - out_len) + list(self.response.output_versions)
        turn = 0
        turn_ids = [-1] * n
        parent = self.parent if self.chat_template_type == "concat" else None
        if parent is not None:
            head = parent.columns()
            p = len(head["input_ids"])
            if n > p:
                loss_mask[:p] = head["loss_mask"]
                logprobs[:p] = head["logprobs"]
                versions[:p] = head["versions"]
                turn_ids[:p] = head["turn_ids"]
                turn = max(head["turn_ids"]) + 1
            else:
                logger.warning(
                    "interaction %s is not longer than its parent; parent ignored", self.id
                )
        turn_ids[n - out_len :] = [turn] * out_len
        self._columns = {
            "input_ids": seq,
            "loss_mask": loss_mask,
            "logprobs": logprobs,
            "versions": versions,
            "turn_ids": turn_ids,
        }
        return self._columns

    def rewards(self) -> tuple[float, float]:
        """``(reward, original_reward)``; an unset reward counts as 0."""
        reward = 0.0 if self.reward is None else float(self.reward)
        return reward, reward if self.original_reward is None else float(self.original_reward)

    def to_tensor_dict(self) -> dict[str, torch.Tensor]:
        """Training tensors, each ``[1, len(sequence)]`` (rewards ``[1]``)."""
        cols = self.columns()
        reward, original = self.rewards()
        tensors = {key: torch.tensor([cols[key]], dtype=dtype) for key, dtype in COLUMN_DTYPES}
        tensors["attention_mask"] = torch.ones((1, len(cols["input_ids"])), dtype=torch.bool)
        tensors["rewards"] = torch.tensor([reward], dtype=torch.float32)
        tensors["original_rewards"] = torch.tensor([original], dtype=torch.float32)
        return tensors

    def set_reward_value(self, reward: float, original: float | None = None) -> None:
        self.reward = float(reward)
        if original is not None:
            self.original_reward = float(original)


class InteractionCache:
    """The interactions of one session, in insertion order."""

    def __init__(self, prefix_matcher: PrefixMatcher | None = None):
        self._items: collections.OrderedDict[str, Interaction] = collections.OrderedDict()
        self.prefix_matcher = prefix_matcher or default_prefix_matcher
        self._discounted = False

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, interaction_id: str) -> bool:
        return interaction_id in self._items

    def __getitem__(self, interaction_id: str) -> Interaction:
        return self._items[interaction_id]

    def values(self) -> list[Interaction]:
        return list(self._items.values())

    def find_parent(self, messages: list[dict]) -> tuple[Interaction | None, list[dict]]:
        """The longest completed interaction whose conversation prefixes ``messages``.

        Returns ``(parent, remaining_messages)``.
        """
        candidates = sorted(
            (i for i in self._items.values() if i.is_complete),
            key=lambda i: len(i.messages),
            reverse=True,
        )
        for candidate in candidates:
            conversation = candidate.messages + (candidate.output_message_list or [])
            if self.prefix_matcher(conversation, messages):
                return candidate, messages[len(conversation) :]
            if self.prefix_matcher(candidate.messages, messages):
                logger.info("new call extends the input of %s but not its answer", candidate.id)
        return None, messages

    def add(self, interaction: Interaction) -> None:
        self._items[interaction.id] = interaction

    def last(self) -> Interaction | None:
        return next(reversed(self._items.values()), None)

    def set_reward(self, interaction_id: str | None, reward: float) -> Interaction:
        if not self._items:
            raise KeyError("the session has no interactions to reward")
        if interaction_id is None:
            target = self.last()
        elif interaction_id in self._items:
            target = self._items[interaction_id]
        else:
            raise KeyError(f"unknown interaction {interaction_id!r}")
        assert target is not None
        target.set_reward_value(reward)
        return target

    def drop_retry_orphans(self) -> int:
        """Drop calls superseded by a retry of the same input; returns how many."""
        children: set[str] = {i.parent.id for i in self._items.values() if i.parent is not None}
        groups: dict[str, list[Interaction]] = collections.defaultdict(list)
        for interaction in self._items.values():
            groups[repr(interaction.messages)].append(interaction)
        dropped: list[str] = []
        for members in groups.values():
            if len(members) < 2:
                continue
            with_children = [m for m in members if m.id in children]
            if with_children:
                dropped += [m.id for m in members if m.id not in children]
            else:
                keep = max(enumerate(members), key=lambda pair: (pair[1].created, pair[0]))[1]
                dropped += [m.id for m in members if m is not keep]
        for interaction_id in dropped:
            self._items.pop(interaction_id, None)
        return len(dropped)

    def apply_reward_discount(self, turn_discount: float = 1.0) -> None:
        """Propagate rewards backwards: ``running = running * gamma + r_i; r_i = running``."""
        if self._discounted:
            return
        self._discounted = True
        items = list(self._items.values())
        if items and items[-1].reward is None:
            logger.warning("the last interaction has no reward; using 0")
        running = 0.0
        for interaction in reversed(items):
            running = running * turn_discount + (interaction.reward or 0.0)
            interaction.set_reward_value(running)

    def export(self, style: str = "individual") -> dict[str, Interaction]:
        """Completed interactions (``individual``), or only conversation leaves (``concat``)."""
        complete = [i for i in self._items.values() if i.is_complete]
        if style == "individual":
            return {i.id: i for i in complete}
        if style != "concat":
            raise ValueError(f"export style must be 'individual' or 'concat', got {style!r}")
        if any(i.chat_template_type != "concat" for i in complete):
            raise ValueError("concat export needs every interaction created in concat mode")
        parents = {i.parent.id for i in complete if i.parent is not None}
        return {i.id: i for i in complete if i.id not in parents}


@dataclass
class ExportedInteraction:
    """An interaction as a rollout worker receives it from the proxy."""

    id: str
    reward: float | None
    tensors: dict[str, torch.Tensor]
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_tensor_dict(self) -> dict[str, torch.Tensor]:
        return self.tensors

    def set_reward_value(self, reward: float, original: float | None = None) -> None:
        self.reward = float(reward)
        self.tensors["rewards"] = torch.tensor([self.reward], dtype=torch.float32)
        if original is not None:
            self.tensors["original_rewards"] = torch.tensor([float(original)], dtype=torch.float32)
