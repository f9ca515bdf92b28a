"""The local Arena's catalog: Streams, harnesses, reward functions and datasets, from YAML.

Schema (every section optional; unknown keys are rejected)::

    streams:                          # list
      - stream_id: arith-easy         # required, unique
        status: ACTIVE                # ACTIVE (default), PAUSED or ARCHIVED
        default_harness: answer-chat@1.0.0   # required, key@version of a harness below
        default_reward: exact-match@1.0.0    # required, key@version of a reward below
        dataset: arithmetic           # required, a name under `datasets`
        tags: [domain:math]           # optional list of strings
        description: ...              # optional
    harnesses:                        # list; key@version unique
      - key: answer-chat              # required
        version: 1.0.0                # required; "*" matches any version of the key
        status: PUBLISHED             # PUBLISHED (default) or DRAFT
        protocol: chat_completions    # required, one of LLM_PROTOCOLS
        kind: answer                  # required: a kind of HARNESS_KINDS
        options: {max_tokens: 128}    # optional mapping, read by the harness (tool_agent:
                                      # toolset default or claude-code)
    rewards:                          # list; key@version unique
      - key: exact-match              # required
        version: 1.0.0                # required
        grader: exact_match           # required, a name in graders.GRADERS
        options: {}                   # optional, checked by the grader
    datasets:                         # mapping name -> exactly one of `file` or `rows`
      arithmetic:
        file: datasets/arithmetic.jsonl   # JSON lines, relative to this catalog file
      inline-example:
        rows:
          - data_id: q1               # required, unique within the dataset
            prompt: What is 2 + 2?    # required, non-empty
            grading: {answer: "4"}    # required mapping, checked by the stream's grader
            tags: [op:add]            # optional list of strings
    faults: {}                        # optional fault settings; values bounded (faults.py)

Everything is checked at load time, including cross-references (a Stream's dataset,
default harness and default reward) and each row's ``grading`` against the grader of every
Stream that uses its dataset, so that a bad catalog fails when the server starts rather
than when a task is graded. Every :class:`CatalogError` names the file, the dotted field
path and what to write instead.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, NoReturn

import yaml

from examples.swe.local_arena.faults import FaultConfig, FaultError
from examples.swe.local_arena.graders import GRADERS, validate_grading, validate_options
from examples.swe.local_arena.harnesses.builtin import TOOLSETS
from examples.swe.local_arena.types import (
    LLM_PROTOCOLS,
    Catalog,
    CatalogError,
    DatasetRow,
    GraderError,
    HarnessSpec,
    Ref,
    RewardSpec,
    StreamSpec,
)

__all__ = ["DEFAULT_CATALOG", "HARNESS_KINDS", "STREAM_STATUSES", "load_catalog"]

DEFAULT_CATALOG = Path(__file__).parent / "catalogs" / "default.yaml"

HARNESS_KINDS = ("answer", "multi_turn", "tool_agent", "claude-code", "codex")
HARNESS_STATUSES = ("PUBLISHED", "DRAFT")
STREAM_STATUSES = ("ACTIVE", "PAUSED", "ARCHIVED")

# field -> required?
_TOP_LEVEL = {
    "streams": False,
    "harnesses": False,
    "rewards": False,
    "datasets": False,
    "faults": False,
}
_STREAM = {
    "stream_id": True,
    "status": False,
    "default_harness": True,
    "default_reward": True,
    "dataset": True,
    "tags": False,
    "description": False,
}
_HARNESS = {
    "key": True,
    "version": True,
    "status": False,
    "protocol": True,
    "kind": True,
    "options": False,
}
_REWARD = {"key": True, "version": True, "grader": True, "options": False}
_DATASET = {"file": False, "rows": False}
_ROW = {"data_id": True, "prompt": True, "grading": True, "tags": False}


class _Source:
    """Where values come from, for error messages: a file (and line) plus a field path."""

    def __init__(self, location: str) -> None:
        self.location = location

    def fail(self, path: str, problem: str) -> NoReturn:
        raise CatalogError(f"{self.location}: {path or '(top level)'}: {problem}")

    def mapping(self, path: str, value: Any, fields: dict[str, bool]) -> Mapping[str, Any]:
        """Check that ``value`` is a mapping with known keys and the required ones."""
        if not isinstance(value, Mapping):
            self.fail(path, f"expected a mapping with fields {', '.join(fields)}")
        for key in value:
            if key not in fields:
                close = difflib.get_close_matches(str(key), list(fields), n=1)
                hint = f"did you mean {close[0]!r}?" if close else f"allowed: {', '.join(fields)}"
                self.fail(_join(path, str(key)), f"unknown field; {hint}")
        for key, required in fields.items():
            if required and key not in value:
                self.fail(_join(path, key), "missing required field")
        return value

    def text(self, path: str, value: Any, *, choices: tuple[str, ...] = ()) -> str:
        if not isinstance(value, str) or not value.strip():
            self.fail(path, f"expected a non-empty string, got {value!r}")
        if choices and value not in choices:
            close = difflib.get_close_matches(value, choices, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            self.fail(path, f"{value!r} is not one of {', '.join(choices)}{hint}")
        return value

    def version(self, path: str, value: Any) -> str:
        # YAML reads `version: 1.0` as the float 1.0, and 1.10 would become 1.1.
        if isinstance(value, int | float) and not isinstance(value, bool):
            self.fail(path, f'quote the version so YAML keeps it as text: version: "{value}"')
        return self.text(path, value)

    def ref(self, path: str, value: Any) -> Ref:
        text = self.text(path, value)
        try:
            return Ref.parse(text)
        except ValueError:
            self.fail(
                path, f"{text!r} is not a reference; expected key@version like answer-chat@1.0.0"
            )

    def tags(self, path: str, value: Any) -> tuple[str, ...]:
        if value is None:
            return ()
        if not isinstance(value, list):
            self.fail(path, "expected a list of strings like [domain:math]")
        return tuple(self.text(f"{path}[{i}]", tag) for i, tag in enumerate(value))

    def options(self, path: str, value: Any) -> dict[str, Any]:
        if value is None:
            return {}
        if not isinstance(value, Mapping):
            self.fail(path, "expected a mapping like {max_tokens: 128}")
        return dict(value)

    def entries(self, path: str, value: Any) -> list[Any]:
        if value is None:
            return []
        if not isinstance(value, list):
            self.fail(path, "expected a list of entries (each starting with '- ')")
        return value


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


# The C loader is several times faster; both are safe loaders (no arbitrary objects).
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class _UniqueKeyLoader(_SafeLoader):
    """A safe YAML loader that rejects a key repeated in one mapping (PyYAML keeps the last
    one silently, which would hide a duplicated dataset or a typo'd override)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                line = key_node.start_mark.line + 1
                raise yaml.constructor.ConstructorError(
                    None,
                    None,
                    f"duplicate key {key!r} (line {line}); keep one",
                    key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# --- sections ---


def _stream(source: _Source, path: str, entry: Any) -> StreamSpec:
    entry = source.mapping(path, entry, _STREAM)
    description = entry.get("description") or ""
    if not isinstance(description, str):
        source.fail(f"{path}.description", "expected text (quote it if YAML reads a number)")
    return StreamSpec(
        stream_id=source.text(f"{path}.stream_id", entry["stream_id"]),
        status=source.text(
            f"{path}.status", entry.get("status", "ACTIVE"), choices=STREAM_STATUSES
        ),
        default_harness=source.ref(f"{path}.default_harness", entry["default_harness"]),
        default_reward=source.ref(f"{path}.default_reward", entry["default_reward"]),
        dataset=source.text(f"{path}.dataset", entry["dataset"]),
        tags=source.tags(f"{path}.tags", entry.get("tags")),
        description=description,
    )


def _harness(source: _Source, path: str, entry: Any) -> HarnessSpec:
    entry = source.mapping(path, entry, _HARNESS)
    return HarnessSpec(
        key=source.text(f"{path}.key", entry["key"]),
        version=source.version(f"{path}.version", entry["version"]),
        status=source.text(
            f"{path}.status", entry.get("status", "PUBLISHED"), choices=HARNESS_STATUSES
        ),
        protocol=source.text(f"{path}.protocol", entry["protocol"], choices=LLM_PROTOCOLS),
        kind=source.text(f"{path}.kind", entry["kind"], choices=HARNESS_KINDS),
        options=_harness_options(source, path, entry),
    )


def _harness_options(source: _Source, path: str, entry: dict[str, Any]) -> dict[str, Any]:
    options = source.options(f"{path}.options", entry.get("options"))
    turns = options.get("turns")
    bad = isinstance(turns, bool) or not isinstance(turns, int) or not 1 <= turns <= 100
    if entry["kind"] == "multi_turn" and turns is not None and bad:
        source.fail(f"{path}.options.turns", f"must be an integer in [1, 100], got {turns!r}")
    toolset = options.get("toolset")
    if entry["kind"] == "tool_agent" and toolset is not None and toolset not in TOOLSETS:
        source.fail(
            f"{path}.options.toolset", f"must be one of {', '.join(TOOLSETS)}, got {toolset!r}"
        )
    return options


def _reward(source: _Source, path: str, entry: Any) -> RewardSpec:
    entry = source.mapping(path, entry, _REWARD)
    grader = source.text(f"{path}.grader", entry["grader"], choices=tuple(GRADERS))
    options = source.options(f"{path}.options", entry.get("options"))
    try:
        validate_options(grader, options)
    except GraderError as exc:
        source.fail(f"{path}.options", str(exc))
    return RewardSpec(
        key=source.text(f"{path}.key", entry["key"]),
        version=source.version(f"{path}.version", entry["version"]),
        grader=grader,
        options=options,
    )


def _row(source: _Source, path: str, entry: Any) -> DatasetRow:
    entry = source.mapping(path, entry, _ROW)
    data_id = entry["data_id"]
    if isinstance(data_id, int) and not isinstance(data_id, bool):
        data_id = str(data_id)  # ids are compared as text in URLs and results
    grading = entry["grading"]
    if not isinstance(grading, Mapping):
        source.fail(f"{path}.grading", "expected a mapping like {answer: '4'}")
    return DatasetRow(
        data_id=source.text(f"{path}.data_id", data_id),
        prompt=source.text(f"{path}.prompt", entry["prompt"]),
        grading=dict(grading),
        tags=source.tags(f"{path}.tags", entry.get("tags")),
    )


def _dataset(
    source: _Source, catalog_dir: Path, name: str, entry: Any
) -> list[tuple[DatasetRow, _Source, str]]:
    """The rows of one dataset, each with where it was written (for later checks)."""
    path = f"datasets.{name}"
    entry = source.mapping(path, entry, _DATASET)
    if ("file" in entry) == ("rows" in entry):
        source.fail(path, "give exactly one of `file: <path.jsonl>` or `rows: [...]`")
    if "rows" in entry:
        placed = [
            (source, f"{path}.rows[{i}]", raw)
            for i, raw in enumerate(source.entries(f"{path}.rows", entry["rows"]))
        ]
    else:
        file = catalog_dir / source.text(f"{path}.file", entry["file"])
        try:
            lines = file.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            source.fail(
                f"{path}.file",
                f"cannot read {file} ({exc.strerror}); fix the path "
                "(it is relative to the catalog file)",
            )
        placed = []
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            line_source = _Source(f"{file}:{number}")
            row_path = f"{path}.rows[{len(placed)}]"
            try:
                raw = json.loads(line)
            except json.JSONDecodeError as exc:
                line_source.fail(row_path, f"not a JSON object ({exc.msg}); write one row a line")
            placed.append((line_source, row_path, raw))

    rows: list[tuple[DatasetRow, _Source, str]] = []
    seen: set[str] = set()
    for row_source, row_path, raw in placed:
        row = _row(row_source, row_path, raw)
        if row.data_id in seen:
            row_source.fail(
                f"{row_path}.data_id",
                f"duplicate data_id {row.data_id!r}; ids must be unique within a dataset",
            )
        seen.add(row.data_id)
        rows.append((row, row_source, row_path))
    return rows


def _unique(source: _Source, path: str, seen: set[Any], key: Any, what: str) -> None:
    if key in seen:
        source.fail(path, f"duplicate {what} {str(key)!r}; each must appear once")
    seen.add(key)


# --- the catalog ---


def load_catalog(path: str | Path) -> Catalog:
    """Load and check a catalog file; raises :class:`CatalogError` on any problem."""
    path = Path(path)
    source = _Source(str(path))
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise CatalogError(
            f"{path}: cannot read the catalog ({exc.strerror}); check the path"
        ) from exc
    try:
        document = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        raise CatalogError(f"{path}: not valid YAML: {exc}") from exc
    document = source.mapping("", {} if document is None else document, _TOP_LEVEL)

    streams: dict[str, StreamSpec] = {}
    for i, entry in enumerate(source.entries("streams", document.get("streams"))):
        stream = _stream(source, f"streams[{i}]", entry)
        _unique(source, f"streams[{i}].stream_id", set(streams), stream.stream_id, "stream_id")
        streams[stream.stream_id] = stream

    harnesses: dict[Ref, HarnessSpec] = {}
    for i, entry in enumerate(source.entries("harnesses", document.get("harnesses"))):
        harness = _harness(source, f"harnesses[{i}]", entry)
        _unique(source, f"harnesses[{i}]", set(harnesses), harness.ref, "harness")
        harnesses[harness.ref] = harness

    rewards: dict[Ref, RewardSpec] = {}
    for i, entry in enumerate(source.entries("rewards", document.get("rewards"))):
        reward = _reward(source, f"rewards[{i}]", entry)
        _unique(source, f"rewards[{i}]", set(rewards), reward.ref, "reward")
        rewards[reward.ref] = reward

    raw_datasets = document.get("datasets") or {}
    if not isinstance(raw_datasets, Mapping):
        source.fail("datasets", "expected a mapping of dataset name -> {file: ...} or {rows: ...}")
    placed_rows = {
        str(name): _dataset(source, path.parent, str(name), entry)
        for name, entry in raw_datasets.items()
    }

    faults = document.get("faults") or {}
    if not isinstance(faults, Mapping):
        source.fail("faults", "expected a mapping (or leave the section out)")
    # The values of known settings are bounded here, so a catalog cannot wedge the server
    # it configures; the section as a whole (unknown keys too) is checked when a server
    # builds its FaultConfig from it.
    known = {f.name for f in dataclasses.fields(FaultConfig)}
    try:
        FaultConfig.from_mapping({k: v for k, v in faults.items() if k in known}, "faults")
    except FaultError as exc:
        raise CatalogError(f"{source.location}: {exc}") from None

    catalog = Catalog(
        streams=streams,
        harnesses=harnesses,
        rewards=rewards,
        datasets={name: [row for row, _, _ in rows] for name, rows in placed_rows.items()},
        faults=dict(faults),
    )
    for i, stream in enumerate(streams.values()):
        _check_stream(source, f"streams[{i}]", catalog, stream, placed_rows)
    return catalog


def _check_stream(
    source: _Source,
    path: str,
    catalog: Catalog,
    stream: StreamSpec,
    placed_rows: dict[str, list[tuple[DatasetRow, _Source, str]]],
) -> None:
    """Cross-references of one Stream, and its rows against its default reward's grader."""

    def missing(field: str, value: str, known: list[str], section: str) -> NoReturn:
        # For a ref, another version of the same key is the likeliest intent.
        same_key = [k for k in known if "@" in value and k.startswith(value.split("@")[0] + "@")]
        close = same_key[:1] or difflib.get_close_matches(value, known, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"known: {', '.join(known) or 'none'}"
        source.fail(f"{path}.{field}", f"{value!r} is not in `{section}`; {hint}")

    if stream.dataset not in catalog.datasets:
        missing("dataset", stream.dataset, list(catalog.datasets), "datasets")
    if catalog.harness(stream.default_harness) is None:
        known = [str(ref) for ref in catalog.harnesses]
        missing("default_harness", str(stream.default_harness), known, "harnesses")
    reward = catalog.rewards.get(stream.default_reward)
    if reward is None:
        known = [str(ref) for ref in catalog.rewards]
        missing("default_reward", str(stream.default_reward), known, "rewards")
    for row, row_source, row_path in placed_rows[stream.dataset]:
        try:
            validate_grading(reward.grader, row.grading)
        except GraderError as exc:
            row_source.fail(
                f"{row_path}.grading",
                f"{exc} (stream {stream.stream_id!r} grades it with {reward.grader})",
            )
