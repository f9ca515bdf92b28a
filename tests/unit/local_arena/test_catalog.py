"""Catalog loading and validation, and the default catalog's datasets."""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from examples.swe.local_arena.catalog import DEFAULT_CATALOG, HARNESS_KINDS, load_catalog
from examples.swe.local_arena.graders import grade
from examples.swe.local_arena.types import LLM_PROTOCOLS, CatalogError, Ref

# --- the default catalog ---


@pytest.fixture(scope="module")
def default():
    return load_catalog(DEFAULT_CATALOG)


def test_default_catalog_loads_quickly():
    best = min(_timed(lambda: load_catalog(DEFAULT_CATALOG)) for _ in range(3))
    assert best < 0.1


def _timed(fn: Callable[[], Any]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def test_default_catalog_cross_references_resolve(default):
    for stream in default.streams.values():
        assert default.harness(stream.default_harness) is not None, stream.stream_id
        assert stream.default_reward in default.rewards, stream.stream_id
        assert default.rows(stream.stream_id), stream.stream_id
    for harness in default.harnesses.values():
        assert harness.protocol in LLM_PROTOCOLS
        assert harness.kind in HARNESS_KINDS


def test_default_catalog_has_the_promised_entries(default):
    active = {s.stream_id for s in default.streams.values() if s.status == "ACTIVE"}
    assert {"arith-easy", "py-funcs", "arith-tools"} <= active
    assert any(s.status == "PAUSED" for s in default.streams.values())
    assert "domain:math" in default.streams["arith-easy"].tags
    assert "domain:code" in default.streams["py-funcs"].tags
    assert len(default.rows("arith-easy")) >= 40
    assert len(default.rows("py-funcs")) >= 15
    expected = {
        "answer-chat@1.0.0": ("chat_completions", "answer"),
        "answer-responses@1.0.0": ("responses", "answer"),
        "answer-anthropic@1.0.0": ("anthropic", "answer"),
        "tool-agent@1.0.0": ("chat_completions", "tool_agent"),
        "claude-code@*": ("anthropic", "claude-code"),
        "codex@*": ("responses", "codex"),
    }
    for ref, (protocol, kind) in expected.items():
        harness = default.harnesses[Ref.parse(ref)]
        assert (harness.protocol, harness.kind, harness.status) == (protocol, kind, "PUBLISHED")
    assert default.harnesses[Ref.parse("tool-agent@1.0.0")].options["max_turns"] == 6
    assert any(h.status == "DRAFT" for h in default.harnesses.values())
    assert default.rewards[Ref.parse("python-tests@1.0.0")].options == {"timeout": 10}


def test_wildcard_harness_matches_any_version(default):
    assert default.harness(Ref("claude-code", "2.1.7")).kind == "claude-code"
    assert default.harness(Ref("codex", "0.30.0")).kind == "codex"
    assert default.harness(Ref("answer-chat", "7.0.0")) is None


def _rows_graded_by(catalog, grader: str):
    for stream in catalog.streams.values():
        reward = catalog.rewards[stream.default_reward]
        if reward.grader == grader:
            for row in catalog.rows(stream.stream_id):
                yield reward, row


def test_every_arithmetic_row_grades_its_answer_right_and_others_wrong(default):
    checked = 0
    for reward, row in _rows_graded_by(default, "exact_match"):
        answer = int(row.grading["answer"])
        assert grade(reward, row, f"The answer is {answer}.").score == 1.0, row.data_id
        assert grade(reward, row, f"The answer is {answer + 1}.").score == 0.0, row.data_id
        checked += 1
    assert checked >= 50  # arith-easy (40), arith-tools (10) and the paused copy


def _python_rows() -> list[Any]:
    rows = _rows_graded_by(load_catalog(DEFAULT_CATALOG), "python_tests")
    return [pytest.param(reward, row, id=row.data_id) for reward, row in rows]


@pytest.mark.parametrize(("reward", "row"), _python_rows())
def test_every_python_row_passes_its_reference_and_fails_a_stub(reward, row):
    reference = f"Here you go:\n```python\n{row.grading['reference']}```\n"
    result = grade(reward, row, reference)
    assert result.score == 1.0, result.detail
    stub = f"def {row.grading['entry_point']}(*args, **kwargs):\n    return None\n"
    assert grade(reward, row, stub).score < 1.0


# --- validation of hand-written catalogs ---


def _valid() -> dict[str, Any]:
    return {
        "streams": [
            {
                "stream_id": "s1",
                "status": "ACTIVE",
                "default_harness": "chat@1.0.0",
                "default_reward": "em@1.0.0",
                "dataset": "d",
                "tags": ["domain:math"],
            },
            {
                "stream_id": "s2",
                "default_harness": "cli@3.1.4",  # satisfied by the cli@* entry
                "default_reward": "em@1.0.0",
                "dataset": "d",
            },
        ],
        "harnesses": [
            {"key": "chat", "version": "1.0.0", "protocol": "chat_completions", "kind": "answer"},
            {"key": "cli", "version": "*", "protocol": "anthropic", "kind": "claude-code"},
        ],
        "rewards": [{"key": "em", "version": "1.0.0", "grader": "exact_match"}],
        "datasets": {
            "d": {
                "rows": [
                    {"data_id": "q1", "prompt": "What is 1 + 1?", "grading": {"answer": "2"}},
                    {"data_id": "q2", "prompt": "What is 2 + 2?", "grading": {"answer": 4}},
                ]
            }
        },
        "faults": {"harness_crash_rate": 0.5},
    }


def _write(tmp_path: Path, document: dict[str, Any]) -> Path:
    path = tmp_path / "catalog.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def test_a_valid_catalog_loads(tmp_path):
    catalog = load_catalog(_write(tmp_path, _valid()))
    assert [row.data_id for row in catalog.rows("s1")] == ["q1", "q2"]
    assert catalog.streams["s2"].status == "ACTIVE"  # the default
    assert catalog.harnesses[Ref("chat", "1.0.0")].status == "PUBLISHED"  # the default
    assert catalog.faults == {"harness_crash_rate": 0.5}


def test_rows_load_from_a_jsonl_file_relative_to_the_catalog(tmp_path):
    (tmp_path / "data").mkdir()
    rows = [{"data_id": "a", "prompt": "p", "grading": {"answer": "1"}, "tags": ["t"]}]
    (tmp_path / "data" / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    document = _valid()
    document["datasets"]["d"] = {"file": "data/d.jsonl"}
    catalog = load_catalog(_write(tmp_path, document))
    assert catalog.rows("s1")[0].tags == ("t",)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """A mutation that sets a dotted path like ``streams.0.dataset`` (or deletes it when
    ``value`` is ``...``)."""

    def mutate(document: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        target: Any = document
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        key: Any = int(last) if isinstance(target, list) else last
        if value is ...:
            del target[key]
        else:
            target[key] = value

    return mutate


def _append(path: str, item: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(document: dict[str, Any]) -> None:
        target: Any = document
        for part in path.split("."):
            target = target[int(part)] if isinstance(target, list) else target[part]
        target.append(copy.deepcopy(item))

    return mutate


BAD_CATALOGS = {
    # name: (mutation, field path in the message, a hint the message must carry)
    "unknown top-level key": (_set("stream", []), "stream:", "did you mean 'streams'"),
    "unknown stream field": (
        _set("streams.0.defualt_harness", "x@1"),
        "streams[0].defualt_harness",
        "did you mean 'default_harness'",
    ),
    "missing required field": (_set("streams.1.dataset", ...), "streams[1].dataset", "missing"),
    "stream status": (_set("streams.0.status", "ACTVE"), "streams[0].status", "'ACTIVE'"),
    "ref without version": (
        _set("streams.1.default_harness", "chat"),
        "streams[1].default_harness",
        "key@version like answer-chat@1.0.0",
    ),
    "unknown harness": (
        _set("streams.0.default_harness", "chat@2.0.0"),
        "streams[0].default_harness",
        "not in `harnesses`",
    ),
    "unknown reward": (
        _set("streams.0.default_reward", "em@9"),
        "streams[0].default_reward",
        "did you mean 'em@1.0.0'",
    ),
    "unknown dataset": (_set("streams.0.dataset", "dd"), "streams[0].dataset", "did you mean 'd'"),
    "protocol": (_set("harnesses.0.protocol", "openai"), "harnesses[0].protocol", "responses"),
    "kind": (_set("harnesses.0.kind", "tool-agent"), "harnesses[0].kind", "'tool_agent'"),
    "unquoted float version": (_set("harnesses.0.version", 1.5), "harnesses[0].version", "quote"),
    "harness status": (_set("harnesses.1.status", "LIVE"), "harnesses[1].status", "PUBLISHED"),
    "grader": (_set("rewards.0.grader", "exact"), "rewards[0].grader", "'exact_match'"),
    "grader option": (
        _set("rewards.0.options", {"numeric_tolerence": 0.1}),
        "rewards[0].options",
        "did you mean 'numeric_tolerance'",
    ),
    "duplicate stream": (
        _append("streams", {**_valid()["streams"][0]}),
        "streams[2].stream_id",
        "duplicate",
    ),
    "duplicate harness": (_append("harnesses", _valid()["harnesses"][1]), "harnesses[2]", "cli@*"),
    "duplicate reward": (_append("rewards", _valid()["rewards"][0]), "rewards[1]", "duplicate"),
    "duplicate data_id": (
        _set("datasets.d.rows.1.data_id", "q1"),
        "datasets.d.rows[1].data_id",
        "unique",
    ),
    "empty prompt": (_set("datasets.d.rows.0.prompt", " "), "datasets.d.rows[0].prompt", "empty"),
    "row tags": (_set("datasets.d.rows.0.tags", "math"), "datasets.d.rows[0].tags", "list"),
    "grading for another grader": (
        _set("datasets.d.rows.0.grading", {"tests": "assert True"}),
        "datasets.d.rows[0].grading",
        "exact_match",
    ),
    "file and rows": (_set("datasets.d.file", "d.jsonl"), "datasets.d", "exactly one"),
    "missing dataset file": (
        _set("datasets.d", {"file": "nowhere/d.jsonl"}),
        "datasets.d.file",
        "nowhere/d.jsonl",
    ),
    "faults not a mapping": (_set("faults", [1]), "faults", "mapping"),
}


@pytest.mark.parametrize("case", BAD_CATALOGS)
def test_bad_catalogs_name_the_file_field_and_fix(tmp_path, case):
    mutate, field, hint = BAD_CATALOGS[case]
    document = _valid()
    mutate(document)
    path = _write(tmp_path, document)
    with pytest.raises(CatalogError) as caught:
        load_catalog(path)
    message = str(caught.value)
    assert str(path) in message
    assert field in message
    assert hint in message


def test_a_bad_jsonl_line_is_reported_with_its_line_number(tmp_path):
    (tmp_path / "d.jsonl").write_text(
        '{"data_id": "a", "prompt": "p", "grading": {"answer": "1"}}\n{"data_id": "b",\n'
    )
    document = _valid()
    document["datasets"]["d"] = {"file": "d.jsonl"}
    with pytest.raises(CatalogError, match=r"d\.jsonl:2: datasets\.d\.rows\[1\]: not a JSON"):
        load_catalog(_write(tmp_path, document))


def test_a_repeated_yaml_key_is_rejected(tmp_path):
    path = tmp_path / "catalog.yaml"
    path.write_text("datasets:\n  d: {rows: []}\n  d: {rows: []}\n")
    with pytest.raises(CatalogError, match=r"duplicate key 'd' \(line 3\)"):
        load_catalog(path)


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(CatalogError, match="cannot read the catalog"):
        load_catalog(tmp_path / "absent.yaml")
    (tmp_path / "broken.yaml").write_text("streams: [\n")
    with pytest.raises(CatalogError, match="not valid YAML"):
        load_catalog(tmp_path / "broken.yaml")
    (tmp_path / "list.yaml").write_text("- 1\n")
    with pytest.raises(CatalogError, match=r"\(top level\): expected a mapping"):
        load_catalog(tmp_path / "list.yaml")
