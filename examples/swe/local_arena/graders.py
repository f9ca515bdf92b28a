"""Graders of the local Arena: turn a harness's answer into a :class:`Grade`.

Three graders, picked by :attr:`RewardSpec.grader`:

* ``exact_match`` compares one expected answer (``grading: {answer: "42"}``). A numeric
  answer is matched against the last number in the text (or in the last ``\\boxed{..}``),
  because models tend to reason first and conclude last; anything else is compared as
  normalized text. Option ``numeric_tolerance`` (absolute, default 0) loosens the match.
* ``python_tests`` runs the answer's code against assert statements
  (``grading: {entry_point: add, tests: "assert add(1, 2) == 3"}``) in a fresh, isolated
  interpreter. Each top-level statement with an ``assert`` in it is one test (others,
  like imports, are setup) and the score is the fraction of tests that pass, so a
  half-right function earns half the reward. Options: ``timeout`` (seconds, default 10) and
  ``memory_mb`` (address-space cap, default 1024).
* ``answer_length`` gives partial credit for the answer's length:
  ``min(1, len(answer.strip()) / target_chars)`` (option ``target_chars``, default 64),
  whatever the row. It is not a task: it gives even an untrained model rewards that differ
  within a group, so smoke runs and CI exercise real gradients and weight updates.

A wrong answer scores 0; :class:`GraderError` means the grader itself could not work
(bad grading data, an interpreter that does not start) and maps to ``EVAL_FAILED``.

The candidate runs in the shared :mod:`.sandbox`: no network, no inherited environment,
and a kill at the end that reaches all it started (a PID namespace where ``unshare`` allows
one, else its process group). The runner program adds rlimits on memory, CPU, file size and
process count before it loads the answer. :mod:`.sandbox` says what this does not protect
against. Linux only (rlimits, ``/proc``).
"""

from __future__ import annotations

import ast
import difflib
import json
import math
import re
import sys
import tempfile
import time
from collections.abc import Callable, Mapping
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import Any

from examples.swe.local_arena import sandbox
from examples.swe.local_arena.types import DatasetRow, Grade, GraderError, RewardSpec

__all__ = [
    "GRADERS",
    "extract_code",
    "extract_last_number",
    "grade",
    "validate_grading",
    "validate_options",
]

# --- validation (shared with the catalog, which checks graders at load time) ---

# grader -> (required grading fields, optional grading fields, option names)
_SCHEMAS: dict[str, tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]] = {
    "exact_match": (("answer",), (), ("numeric_tolerance",)),
    # `reference` is a known-good solution kept for dataset self-checks.
    "python_tests": (("tests",), ("entry_point", "reference"), ("timeout", "memory_mb")),
    # any row: its grading data are not used
    "answer_length": ((), ("answer", "tests", "entry_point", "reference"), ("target_chars",)),
}


def _unknown_key_message(key: str, allowed: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(key, allowed, n=1)
    hint = f"did you mean {close[0]!r}? " if close else ""
    return f"unknown field {key!r}; {hint}allowed: {', '.join(allowed)}"


def _schema(grader: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    if grader not in _SCHEMAS:
        raise GraderError(f"unknown grader {grader!r}; expected one of {', '.join(_SCHEMAS)}")
    return _SCHEMAS[grader]


def validate_options(grader: str, options: Mapping[str, Any]) -> None:
    """Raise :class:`GraderError` when ``options`` do not suit ``grader``."""
    names = _schema(grader)[2]
    for key, value in options.items():
        if key not in names:
            raise GraderError(_unknown_key_message(key, names))
        positive = key in ("timeout", "memory_mb", "target_chars")
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            raise GraderError(f"option {key!r} must be a non-negative number, got {value!r}")
        if positive and value == 0:
            raise GraderError(f"option {key!r} must be positive, got {value!r}")


def validate_grading(grader: str, grading: Mapping[str, Any]) -> None:
    """Raise :class:`GraderError` when a row's ``grading`` data do not suit ``grader``."""
    required, optional, _ = _schema(grader)
    for key in required:
        if key not in grading:
            raise GraderError(f"missing field {key!r} (the {grader} grader needs it)")
    for key in grading:
        if key not in required + optional:
            raise GraderError(_unknown_key_message(key, required + optional))
    if grader == "answer_length":
        return
    if grader == "exact_match":
        answer = grading["answer"]
        if isinstance(answer, bool) or not isinstance(answer, str | int | float):
            raise GraderError(f"field 'answer' must be a string or a number, got {answer!r}")
        if not str(answer).strip():
            raise GraderError("field 'answer' is empty")
        return
    entry_point = grading.get("entry_point")
    if entry_point is not None and not (
        isinstance(entry_point, str) and entry_point.isidentifier()
    ):
        raise GraderError(f"field 'entry_point' must be a Python name, got {entry_point!r}")
    for key in ("tests", "reference"):
        if key in grading and not isinstance(grading[key], str):
            raise GraderError(f"field {key!r} must be a string of Python code")
    _split_tests(grading["tests"])


# --- exact_match ---

# A number not glued to a word: "7", "-3", "1,000", "2.5", ".5". The look-behind keeps the
# minus of "5-3" from reading as -3 and skips digits inside names like "x2".
_NUMBER = re.compile(r"(?<![\w.])[-−]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|(?<![\w.])[-−]?\.\d+")
# Small models sometimes spell the number out; only used when the text has no digits.
_SPELLED_NUMBERS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
)
_NUMBER_WORDS = {word: str(value) for value, word in enumerate(_SPELLED_NUMBERS.split())}
_WORD = re.compile(r"[a-z]+")
_TRAILING_PUNCTUATION = ".!?,;:"


def _to_decimal(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", "").replace("−", "-"))
    except InvalidOperation:
        return None


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}``, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, begin = 0, start + len("\\boxed{")
    for index in range(begin, len(text)):
        if text[index] == "{":
            depth += 1
        elif text[index] == "}":
            if depth == 0:
                return text[begin:index]
            depth -= 1
    return None


def extract_last_number(text: str) -> str | None:
    """The number a text concludes with: the last one in the last ``\\boxed{}`` if any, else
    the last one in the text, else the last number word ("five"); commas are dropped."""
    boxed = _last_boxed(text)
    numbers = _NUMBER.findall(boxed if boxed is not None else text)
    if numbers:
        return numbers[-1].replace(",", "").replace("−", "-")
    words = [w for w in _WORD.findall(text.casefold()) if w in _NUMBER_WORDS]
    return _NUMBER_WORDS[words[-1]] if words else None


def _normalize(text: str) -> str:
    text = " ".join(text.replace("**", "").split()).casefold()
    return text.strip().strip("\"'`").rstrip(_TRAILING_PUNCTUATION).strip()


def _text_candidates(text: str) -> list[str]:
    """Readings of a free-text answer: all of it, the boxed part, the part after the last
    "answer is"/"answer:", and the last line."""
    candidates = [text]
    boxed = _last_boxed(text)
    if boxed is not None:
        candidates.append(boxed)
    marker = re.split(r"answer\s*(?:is|:)", text, flags=re.IGNORECASE)
    if len(marker) > 1:
        candidates.append(marker[-1])
    lines = [line for line in text.splitlines() if line.strip()]
    if lines:
        candidates.append(lines[-1])
    return [_normalize(c) for c in candidates]


def _exact_match(reward: RewardSpec, row: DatasetRow, answer: str) -> Grade:
    expected = str(row.grading["answer"]).strip()
    tolerance = Decimal(str(reward.options.get("numeric_tolerance", 0)))
    expected_number = _to_decimal(expected) if _NUMBER.fullmatch(expected) else None
    if expected_number is not None:
        extracted = extract_last_number(answer)
        value = _to_decimal(extracted) if extracted is not None else None
        correct = value is not None and abs(value - expected_number) <= tolerance
        detail = {"mode": "numeric", "expected": expected, "extracted": extracted}
        return Grade(1.0 if correct else 0.0, detail)
    target = _normalize(expected)
    candidates = _text_candidates(answer)
    correct = target in candidates
    extracted = target if correct else candidates[-1]
    return Grade(
        1.0 if correct else 0.0,
        {"mode": "text", "expected": expected, "extracted": _clip(extracted, 200)},
    )


# --- python_tests ---

_FENCE = re.compile(r"```[ \t]*([\w+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON_LANGS = ("python", "py", "python3")
_OUTPUT_LIMIT = 2000  # characters of stdout/stderr kept in the detail
_FAILURES_SHOWN = 5


def extract_code(answer: str) -> str:
    """The code in an answer: the last ```python block, else the last fenced block of any
    language, else the whole text. An unclosed last fence (a reply cut off by max_tokens)
    counts as a block up to the end."""
    blocks = _FENCE.findall(answer)
    python = [code for lang, code in blocks if lang.casefold() in _PYTHON_LANGS]
    if python:
        return python[-1]
    if blocks:
        return blocks[-1][1]
    return answer


def _contains_assert(node: ast.stmt) -> bool:
    return any(isinstance(child, ast.Assert) for child in ast.walk(node))


def _split_tests(tests: str) -> list[tuple[str, bool]]:
    """The top-level statements of ``tests`` as ``(source, is_test)``. A statement is a
    test when it contains an ``assert``; the others (imports, helpers) are setup."""
    try:
        module = ast.parse(tests)
    except SyntaxError as exc:
        message = f"field 'tests' is not valid Python: {exc.msg} (line {exc.lineno})"
        raise GraderError(message) from exc
    statements = [
        (ast.get_source_segment(tests, node) or ast.unparse(node), _contains_assert(node))
        for node in module.body
    ]
    if not any(is_test for _, is_test in statements):
        raise GraderError("field 'tests' has no assert statement to score")
    return statements


def _clip(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... [{len(text) - limit} more characters]"


# Runs in the child: guards, limits, then the candidate and each test statement, writing
# one JSON line per step so a crash part-way still leaves what happened before it.
_RUNNER = (
    sandbox.SOCKET_GUARD
    + r"""
import json, os, resource, sys

with open(sys.argv[1]) as job_file:
    job = json.load(job_file)
out = open(sys.argv[2], "w", buffering=1)

def report(**event):
    out.write(json.dumps(event) + "\n")

def user_tasks():
    # RLIMIT_NPROC counts every thread of this user, not just ours: cap relative to now.
    count, uid = 0, os.getuid()
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/status") as status:
                fields = dict(line.split(":", 1) for line in status if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, ValueError, KeyError):
            pass
    return count

limits = job["limits"]
for name, value in [
    ("RLIMIT_AS", limits["memory_bytes"]),
    ("RLIMIT_CPU", limits["cpu_seconds"]),
    ("RLIMIT_FSIZE", limits["file_bytes"]),
    ("RLIMIT_NPROC", user_tasks() + limits["extra_processes"]),
]:
    kind = getattr(resource, name)
    hard = resource.getrlimit(kind)[1]
    if hard != resource.RLIM_INFINITY:
        value = min(value, hard)
    # Soft and hard alike, so the candidate cannot raise them again.
    resource.setrlimit(kind, (value, value))
report(event="start")

def describe(exc):
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text[:300]

namespace = {"__name__": "__solution__"}
try:
    exec(compile(job["code"], "<answer>", "exec"), namespace)
    report(event="load", error=None)
except BaseException as exc:
    report(event="load", error=describe(exc))
entry_point = job["entry_point"]
if entry_point and not callable(namespace.get(entry_point)):
    report(event="entry_point", missing=entry_point)
else:
    for index, (source, is_test) in enumerate(job["statements"]):
        try:
            exec(compile(source, f"<test {index}>", "exec"), namespace)
            report(event="statement", index=index, ok=True)
        except BaseException as exc:
            report(event="statement", index=index, ok=False, error=describe(exc))
report(event="done")
"""
)


def _read_events(path: Path) -> list[dict[str, Any]]:
    events = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                events.append(json.loads(line))
            except json.JSONDecodeError:
                break  # a line cut off by a crash
    return events


def _run_sandboxed(
    workdir: Path, argv: list[str], timeout: float
) -> tuple[int | None, float, str, str]:
    """Run ``argv`` in ``workdir`` in the sandbox; returns (exit code or None on timeout,
    seconds, stdout, stderr). Output goes to files so the file-size limit caps it."""
    stdout_path, stderr_path = workdir.parent / "stdout", workdir.parent / "stderr"
    started = time.monotonic()
    with stdout_path.open("wb") as stdout, stderr_path.open("wb") as stderr:
        try:
            code = sandbox.run_to_files(
                [*sandbox.unshare_prefix(pid=True), *argv],
                sandbox.minimal_env(workdir),
                workdir,
                timeout,
                stdout=stdout,
                stderr=stderr,
            )
        except OSError as exc:
            raise GraderError(f"cannot start the Python interpreter: {exc}") from exc
    seconds = round(time.monotonic() - started, 3)

    def tail(path: Path) -> str:
        return _clip(path.read_text(errors="replace"), _OUTPUT_LIMIT)

    return code, seconds, tail(stdout_path), tail(stderr_path)


def _python_tests(reward: RewardSpec, row: DatasetRow, answer: str) -> Grade:
    statements = _split_tests(row.grading["tests"])
    total = sum(is_test for _, is_test in statements)
    code = extract_code(answer)
    try:
        compile(code, "<answer>", "exec")
    except (SyntaxError, ValueError) as exc:
        message = exc.msg if isinstance(exc, SyntaxError) else str(exc)
        line = getattr(exc, "lineno", None)
        return Grade(0.0, {"passed": 0, "total": total, "syntax_error": f"{message} (line {line})"})

    timeout = float(reward.options.get("timeout", 10))
    job = {
        "code": code,
        "entry_point": row.grading.get("entry_point"),
        "statements": statements,
        "limits": {
            "memory_bytes": int(reward.options.get("memory_mb", 1024)) * 2**20,
            "cpu_seconds": math.ceil(timeout) + 1,
            "file_bytes": 16 * 2**20,
            "extra_processes": 32,
        },
    }
    with tempfile.TemporaryDirectory(prefix="local-arena-grade-") as tmp:
        root = Path(tmp)
        workdir = root / "work"
        workdir.mkdir()
        (root / "runner.py").write_text(_RUNNER)
        (root / "job.json").write_text(json.dumps(job))
        argv = [sys.executable, "-I", str(root / "runner.py"), str(root / "job.json")]
        exit_code, seconds, stdout, stderr = _run_sandboxed(
            workdir, [*argv, str(root / "events.jsonl")], timeout
        )
        events = _read_events(root / "events.jsonl")

    detail: dict[str, Any] = {
        "passed": 0,
        "total": total,
        "timeout": exit_code is None,
        "exit_code": exit_code,
        "seconds": seconds,
        "sandbox": "namespace" if sandbox.unshare_prefix(pid=True) else "process",
        "stdout": stdout,
        "stderr": stderr,
    }
    if not any(event.get("event") == "start" for event in events) and exit_code is not None:
        raise GraderError(f"the grading interpreter did not start (exit {exit_code}): {stderr}")
    if exit_code is None:
        return Grade(0.0, detail)

    failures = []
    passed = 0
    for event in events:
        if event.get("event") == "load" and event.get("error"):
            detail["load_error"] = event["error"]
        elif event.get("event") == "entry_point":
            detail["entry_point_missing"] = event["missing"]
        elif event.get("event") == "statement":
            source, is_test = statements[event["index"]]
            if event["ok"]:
                passed += is_test
            else:
                failures.append({"statement": _clip(source, 200), "error": event["error"]})
    if not any(event.get("event") == "done" for event in events):
        detail["crashed"] = True  # os._exit, a signal or a limit stopped the run part-way
    detail["passed"] = passed
    detail["failures"] = failures[:_FAILURES_SHOWN]
    return Grade(passed / total, detail)


# --- answer_length ---


def _answer_length(reward: RewardSpec, row: DatasetRow, answer: str) -> Grade:
    target = float(reward.options.get("target_chars", 64))
    length = len(answer.strip())
    return Grade(min(1.0, length / target), {"chars": length, "target_chars": target})


# --- entry point ---

GRADERS: dict[str, Callable[[RewardSpec, DatasetRow, str], Grade]] = {
    "exact_match": _exact_match,
    "python_tests": _python_tests,
    "answer_length": _answer_length,
}


def grade(reward: RewardSpec, row: DatasetRow, answer: str) -> Grade:
    """Grade ``answer`` to ``row`` with the grader of ``reward``.

    Raises :class:`GraderError` when the grader cannot work (unknown grader, bad grading
    data or options, no interpreter); a wrong answer is a score of 0."""
    validate_options(reward.grader, reward.options)
    validate_grading(reward.grader, row.grading)
    return GRADERS[reward.grader](reward, row, answer)
