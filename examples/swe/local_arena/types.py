"""Shared types of the local Arena: catalog entries, harness runs and grades.

The catalog (:mod:`.catalog`) yields :class:`Catalog`; a launched task runs a harness
(:mod:`.harnesses`) with a :class:`HarnessRun` and gets a :class:`HarnessOutput`, which a
grader (:mod:`.graders`) turns into a :class:`Grade`. The server (:mod:`.server`) maps
the exceptions below to Arena task statuses:

* :class:`HarnessError` -> ``HARNESS_FAILED`` (``raw.error`` carries the message)
* an output without an answer -> ``NO_OUTPUT``
* the task deadline -> ``TIMEOUT``
* :class:`GraderError` -> ``EVAL_FAILED``
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "LLM_PROTOCOLS",
    "Catalog",
    "CatalogError",
    "DatasetRow",
    "Grade",
    "GraderError",
    "HarnessError",
    "HarnessOutput",
    "HarnessRun",
    "HarnessSpec",
    "Ref",
    "RewardSpec",
    "StreamSpec",
]

LLM_PROTOCOLS = ("chat_completions", "responses", "anthropic")


class CatalogError(ValueError):
    """A catalog file that cannot be loaded; the message names the field and the fix."""


class HarnessError(RuntimeError):
    """The harness failed (crashed, the LLM call failed, the CLI exited non-zero)."""


class GraderError(RuntimeError):
    """The grader itself failed (not a wrong answer: that is a score of 0)."""


@dataclass(frozen=True)
class Ref:
    """A ``key@version`` reference (harnesses, reward functions)."""

    key: str
    version: str

    def __str__(self) -> str:
        return f"{self.key}@{self.version}"

    @classmethod
    def parse(cls, text: str) -> Ref:
        key, sep, version = text.partition("@")
        if not sep or not key or not version:
            raise ValueError(f"expected key@version, got {text!r}")
        return cls(key, version)

    def to_json(self) -> dict[str, str]:
        return {"key": self.key, "version": self.version}


@dataclass(frozen=True)
class DatasetRow:
    """One task of a dataset: what the harness is asked and what the grader checks."""

    data_id: str
    prompt: str
    grading: dict[str, Any] = field(default_factory=dict)  # grader-specific data
    tags: tuple[str, ...] = ()


@dataclass(frozen=True)
class StreamSpec:
    stream_id: str
    status: str  # ACTIVE, PAUSED, ARCHIVED, ...
    default_harness: Ref
    default_reward: Ref
    dataset: str  # a key of Catalog.datasets
    tags: tuple[str, ...] = ()  # e.g. ("domain:math",)
    description: str = ""


@dataclass(frozen=True)
class HarnessSpec:
    """A harness version. ``kind`` picks the implementation in :mod:`.harnesses`:
    ``answer`` (single turn), ``multi_turn`` (``options.turns`` turns, no tools),
    ``tool_agent`` (multi-turn with run_python/bash/submit tools), ``claude-code`` or
    ``codex`` (the real CLIs)."""

    key: str
    version: str
    status: str  # PUBLISHED or DRAFT
    protocol: str  # one of LLM_PROTOCOLS
    kind: str
    options: dict[str, Any] = field(default_factory=dict)  # e.g. max_turns, system prompt

    @property
    def ref(self) -> Ref:
        return Ref(self.key, self.version)


@dataclass(frozen=True)
class RewardSpec:
    """A reward function version; ``grader`` is ``exact_match`` or ``python_tests``."""

    key: str
    version: str
    grader: str
    options: dict[str, Any] = field(default_factory=dict)  # e.g. timeout seconds

    @property
    def ref(self) -> Ref:
        return Ref(self.key, self.version)


@dataclass
class Catalog:
    streams: dict[str, StreamSpec]
    harnesses: dict[Ref, HarnessSpec]
    rewards: dict[Ref, RewardSpec]
    datasets: dict[str, list[DatasetRow]]
    faults: dict[str, Any] = field(default_factory=dict)  # the catalog's `faults:` section

    def rows(self, stream_id: str) -> list[DatasetRow]:
        return self.datasets[self.streams[stream_id].dataset]

    def row(self, stream_id: str, data_id: str) -> DatasetRow | None:
        for row in self.rows(stream_id):
            if row.data_id == data_id:
                return row
        return None

    def harness(self, ref: Ref) -> HarnessSpec | None:
        """The harness for ``ref``; an entry with version ``*`` matches any version."""
        return self.harnesses.get(ref) or self.harnesses.get(Ref(ref.key, "*"))


@dataclass
class HarnessRun:
    """Everything a harness needs for one task.

    ``base_url``/``api_key``/``model`` come from the launch body: in gateway modes they
    point at this Arena's LLM gateway (``{base}/api``), in direct mode at the rollout
    proxy. ``envs`` is the launch body's ``envs`` (it may carry
    ``ANTHROPIC_CUSTOM_HEADERS`` with ``X-Session-Id``/``X-Session-Token`` lines, which
    every LLM call must send as headers). ``row.grading`` is always empty: the answer key
    never reaches a harness.
    """

    task_id: str
    prompt: str
    row: DatasetRow
    model: str
    base_url: str
    api_key: str
    envs: dict[str, str]
    workdir: Path
    timeout: float
    session_id: str = ""
    env_seconds: float = 0.0  # spent "in the environment" after each LLM call (faults)


@dataclass
class HarnessOutput:
    """What a harness produced; ``answer`` empty or None means NO_OUTPUT."""

    answer: str | None
    turns: int = 0
    transcript: list[dict[str, Any]] = field(default_factory=list)  # short, JSON-able
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Grade:
    score: float  # in [0, 1]
    detail: dict[str, Any] = field(default_factory=dict)  # JSON-able, goes into raw
