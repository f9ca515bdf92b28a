"""Failure attribution of Arena tasks: a proven model failure (reward 0) or a rejected sample.

Only a ``HARNESS_FAILED`` task that recorded interactions and whose ``raw`` result proves a
model failure through exactly one result family (native receipt, GameAgent outcome code,
legacy Claude log, native runner) trains as reward 0. Every other failure is rejected:
infrastructure statuses and non-task errors as system failures, the rest (``TIMEOUT``,
``NO_OUTPUT``, ambiguous or vetoed results) as unknown. Also here: a result's Harness outcome
code and its bounded metric bucket.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from areal.proxy.hooks import FailureDisposition
from areal.proxy.workflow import HARNESS_OUTCOME_METRIC_CODES
from examples.swe.arena_results import FAILED_TASK_STATUSES, ArenaTaskFailedError, ArenaTaskResult

__all__ = [
    "MODEL_FAILURE_OUTCOME_CODES",
    "SYSTEM_FAILURE_STATUSES",
    "classify_proxy_failure",
    "harness_error_metrics",
    "harness_outcome_bucket",
    "harness_outcome_code",
    "model_attributed",
    "result_families",
    "should_reject_failed_sample",
]

SYSTEM_FAILURE_STATUSES = FAILED_TASK_STATUSES - {"HARNESS_FAILED", "NO_OUTPUT", "TIMEOUT"}
MODEL_FAILURE_OUTCOME_CODES = frozenset(
    {"AGENT_MAX_TURNS_EXCEEDED", "AUTONOMOUS_INCOMPLETE_NO_SHIP"}
)

# --- outcome codes ---

_OUTCOME_MARKER = "GAMEAGENT_OUTCOME_CODE="
_CODE_RE = re.compile(r"[A-Z][A-Z0-9_]{0,127}")
# A marker counts at the start or after whitespace, and only when whitespace or the end follows.
_MARKER_RE = re.compile(r"(?<!\S)GAMEAGENT_OUTCOME_CODE=([A-Z][A-Z0-9_]{0,127})(?!\S)")

# --- text vocabularies ---

_SYSTEM_ERROR_RE = re.compile(
    "|".join(
        (
            r"authentication|unauthorized|invalid api key|permission denied",
            r"rate[\s\S]?limit",
            r"connection (?:reset|refused|error)|connectionerror|connecttimeout|readtimeout",
            r"timed out|timeout",
            r"service unavailable|internal server error|bad gateway|out of memory",
            r"no space left|traceback",
            r"llm_response_failed|system_failure|export_failed|setup_failed|eval_failed",
            r"(?:export|collect|setup)[^\r\n]*?(?:failed|error)",
            r"(?:http error|http|status code|status|api error)\s*[:=]?\s*"
            r"(?:401|403|408|429|500|502|503|504)\b",
        )
    ),
    re.IGNORECASE,
)
_CLAUDE_MODEL_ERROR_RE = re.compile(
    "|".join(
        (
            r"prompt (?:is )?too long",
            r"context (?:window|length) (?:exceeded|exhausted)",
            r"exceeds? (?:the )?(?:maximum )?context (?:window|length)",
            r"maximum context length",
            r"max(?:imum)? turns? (?:exceeded|reached)",
            r"reached (?:the )?max(?:imum)? (?:number of )?turns?",
        )
    ),
    re.IGNORECASE,
)
# Lower-case Claude log markers (the log is searched lower-cased).
_CLAUDE_FIRST_MARKER = "harness: agent phase error: claude reported error:"
_CLAUDE_EXIT_LINE = "harness: harness agent phase exited with code"
_CLAUDE_LIFECYCLE_RE = re.compile(
    r"\n(?:\d{4}/\d{2}/\d{2} \d{2}:\d{2}:\d{2}(?:\.\d+)? )?harness: "
    r"(?:(?P<collect>running collect hook)(?=[\r\n]|\Z)|(?P<claude>claude reported error:))"
)

# --- native receipts ---

_NATIVE_RUN_KEYS = ("runTerminals", "runFailures", "exportedRunCount")
_RUN_TERMINALS = frozenset({"run.completed", "run.failed"})

# --- native runner ---

_RUNNER_IMPLEMENTATION = "rust-core-runtime"
_RUNNER_TURN_STATUS_KEYS = ("turn_statuses", "recorded_turn_statuses", "root_turn_statuses")
_RUNNER_CONTEXT_MESSAGE = (
    'model reported a streaming error (event=error, code=Some("context_length_exceeded"), '
    'type=Some("context_length_exceeded"), reason=None)'
)
# Hook configuration lines, not failures: their "(timeout=...)" must not read as a timeout.
_HOOK_CONFIG_RE = re.compile(r"running (?:setup|collect) hook \(timeout=[0-9.hms]+\)")


def _is_int(value: Any, expected: int) -> bool:
    """``value`` is the int ``expected`` (a bool or a float never is)."""
    return isinstance(value, int) and not isinstance(value, bool) and value == expected


def _error_text(raw: Mapping[str, Any]) -> str:
    text = raw.get("error")
    return text if isinstance(text, str) else ""


def _failure_raw(error: ArenaTaskFailedError) -> Any:
    """The result's ``raw``; ``None`` when the error carries no parsed result."""
    result = error.result
    return result.raw if isinstance(result, ArenaTaskResult) else None


# --- outcome codes ---


def harness_outcome_code(raw: Any) -> str | None:
    """The one outcome code a result reports, else ``None`` (the code is void).

    Candidates, in order: ``outcome.code`` (when the key ``outcome`` exists; an ``outcome``
    that is not an object voids the code), ``outcome_code`` (when the key exists), and every
    valid ``GAMEAGENT_OUTCOME_CODE=<CODE>`` marker in ``error``. One malformed marker, no
    candidate, an invalid candidate or two different values void the code.
    """
    if not isinstance(raw, Mapping):
        return None
    candidates: list[Any] = []
    if "outcome" in raw:
        outcome = raw["outcome"]
        if not isinstance(outcome, Mapping):
            return None
        candidates.append(outcome.get("code"))
    if "outcome_code" in raw:
        candidates.append(raw["outcome_code"])
    text = _error_text(raw)
    markers = _MARKER_RE.findall(text)
    if len(markers) != text.count(_OUTCOME_MARKER):
        return None
    candidates += markers
    if not candidates:
        return None
    if not all(isinstance(c, str) and _CODE_RE.fullmatch(c) for c in candidates):
        return None
    return candidates[0] if len(set(candidates)) == 1 else None


def harness_outcome_bucket(raw: Any) -> str:
    """A bounded metric-key suffix: a listed outcome code as itself, anything else ``OTHER``."""
    code = harness_outcome_code(raw)
    return code if code in HARNESS_OUTCOME_METRIC_CODES else "OTHER"


def harness_error_metrics(status: str | None, raw: Any) -> dict[str, float]:
    """``harness_error/<CODE>`` for each bounded code and ``harness_error/OTHER``, all 0 unless
    ``status`` is ``HARNESS_FAILED`` (then 1 for the result's bucket)."""
    bucket = harness_outcome_bucket(raw) if status == "HARNESS_FAILED" else None
    return {
        f"harness_error/{code}": float(code == bucket)
        for code in (*sorted(HARNESS_OUTCOME_METRIC_CODES), "OTHER")
    }


# --- result families ---


def result_families(raw: Mapping[str, Any]) -> set[str]:
    """The result formats ``raw`` claims (only exactly one can be attributed)."""
    text = _error_text(raw)
    lowered = text.lower()
    families = set()
    if (
        any(isinstance(key, str) and key.startswith("native") for key in raw)
        or any(key in raw for key in _NATIVE_RUN_KEYS)
        or raw.get("harness") == "AReaLHarness"
    ):
        families.add("native")
    if (
        "outcome" in raw
        or "outcome_code" in raw
        or _OUTCOME_MARKER in text
        or "gameagent.envarena:" in text
    ):
        families.add("gameagent")
    if _CLAUDE_EXIT_LINE in lowered and (
        "harness: agent phase error: claude " in lowered or "(claude=" in text
    ):
        families.add("legacy-claude")
    if "implementation" in raw or (isinstance(raw.get("harness"), Mapping) and not families):
        families.add("native-runner")
    return families


def _common_veto(raw: Mapping[str, Any]) -> bool:
    """Health, failure and status vetoes that apply to every family."""
    if "trajectoryHealth" in raw and raw["trajectoryHealth"] != "healthy":
        return True
    if "failure" in raw and raw["failure"] is not None:
        return True
    return "status" in raw and raw["status"] != "ERROR"


def _error_veto(raw: Mapping[str, Any]) -> bool:
    """A non-string ``error``, or system-error words in it (never the runner family's rule)."""
    error = raw.get("error")
    if error is not None and not isinstance(error, str):
        return True
    return bool(error) and bool(_SYSTEM_ERROR_RE.search(error))


def _native_receipt_valid(raw: Mapping[str, Any]) -> bool:
    """A version-1, healthy, completed receipt whose every failed run failed only because the
    public answer was missing, each failed run reported exactly once."""
    if not (
        _is_int(raw.get("nativeRlReceiptVersion"), 1)
        and raw.get("nativeExecutionHealthy") is True
        and raw.get("nativeExportHealthy") is True
        and raw.get("status") == "ERROR"
        and raw.get("trajectoryHealth") == "healthy"
        and raw.get("nativeStopReason") == "completed"
        and "nativeFailure" in raw
        and raw["nativeFailure"] is None
    ):
        return False
    terminals = raw.get("runTerminals")
    if not isinstance(terminals, Mapping) or not terminals:
        return False
    if not all(
        isinstance(run, str) and run and t in _RUN_TERMINALS for run, t in terminals.items()
    ):
        return False
    if not _is_int(raw.get("exportedRunCount"), len(terminals)):
        return False
    failures = raw.get("runFailures")
    if not isinstance(failures, list) or not failures:
        return False
    failed_runs = {run for run, terminal in terminals.items() if terminal == "run.failed"}
    reported: set[str] = set()
    for entry in failures:
        if not isinstance(entry, Mapping):
            return False
        run = entry.get("runId")
        if run not in failed_runs or run in reported or not _public_answer_missing(entry):
            return False
        reported.add(run)
    return bool(failed_runs) and reported == failed_runs


def _public_answer_missing(entry: Mapping[str, Any]) -> bool:
    error = entry.get("error")
    details = error.get("details") if isinstance(error, Mapping) else None
    runtime = details.get("runtimeFailure") if isinstance(details, Mapping) else None
    return (
        isinstance(runtime, Mapping)
        and error.get("code") == "RUNTIME_EXECUTION_FAILED"
        and runtime.get("code") == "DSH_PUBLIC_ANSWER_MISSING"
        and runtime.get("reason") == "public_answer_missing"
    )


def _claude_log_attributable(text: str, context_overflow: bool) -> bool:
    """One Claude error whose reason is a model error (or empty, with a proxy overflow)."""
    log = text.lower()
    if log.count(_CLAUDE_FIRST_MARKER) != 1:
        return False
    after = log.split(_CLAUDE_FIRST_MARKER, 1)[1]
    records = list(_CLAUDE_LIFECYCLE_RE.finditer(after))
    reason = (after[: records[0].start()] if records else after).strip()
    if records and records[-1].group("collect"):
        return False  # the log may have been cut off in the collect phase
    for i, record in enumerate(records):
        end = records[i + 1].start() if i + 1 < len(records) else len(after)
        if record.group("claude") and after[record.end() : end].strip() != reason:
            return False
    if reason:
        return bool(_CLAUDE_MODEL_ERROR_RE.search(reason))
    return context_overflow


def _runner_full_receipt_valid(raw: Mapping[str, Any]) -> bool:
    """A runner receipt whose every turn failed on a typed context-length streaming error."""
    count = raw.get("unconfirmed_tool_count")
    errors = raw.get("error")
    return (
        raw.get("implementation") == _RUNNER_IMPLEMENTATION
        and raw.get("status") == "ERROR"
        and _is_int(raw.get("exit_code"), 1)
        and raw.get("execution_state") == "exited"
        and isinstance(raw.get("unconfirmed_tools"), list)
        and not raw["unconfirmed_tools"]
        and isinstance(count, (int, float))
        and not isinstance(count, bool)
        and count == 0
        and raw.get("delivery") is None
        and all(
            isinstance(raw.get(key), list)
            and raw[key]
            and all(status == "failed" for status in raw[key])
            for key in _RUNNER_TURN_STATUS_KEYS
        )
        and isinstance(errors, list)
        and bool(errors)
        and all(
            isinstance(e, Mapping) and str(e.get("message", "")) == _RUNNER_CONTEXT_MESSAGE
            for e in errors
        )
    )


def _runner_envelope_valid(raw: Mapping[str, Any]) -> bool:
    """An agent-phase exit (code 1) whose log holds no system-error words."""
    text = raw.get("error", "")
    if not isinstance(text, str):
        return False
    if _SYSTEM_ERROR_RE.search(_HOOK_CONFIG_RE.sub("running hook", text)):
        return False
    harness = raw.get("harness")
    return (
        isinstance(harness, Mapping)
        and harness.get("phase") == "agent"
        and harness.get("result_status") == "ERROR"
        and _is_int(harness.get("exit_code"), 1)
    )


def model_attributed(raw: Any, *, context_overflow: bool) -> bool:
    """Whether a ``HARNESS_FAILED`` result's ``raw`` proves a model failure through exactly one
    result family (docs/arena_training.md#failures-train-with-zero-or-reject)."""
    if not isinstance(raw, Mapping):
        return False
    families = result_families(raw)
    if len(families) != 1 or _common_veto(raw):
        return False
    (family,) = families
    if family == "native-runner":
        if not context_overflow:
            return False
        if "implementation" in raw:
            return _runner_full_receipt_valid(raw)
        return _runner_envelope_valid(raw)
    if _error_veto(raw):
        return False
    if family == "native":
        return _native_receipt_valid(raw)
    if family == "gameagent":
        return harness_outcome_code(raw) in MODEL_FAILURE_OUTCOME_CODES
    return _claude_log_attributable(_error_text(raw), context_overflow)


# --- dispositions ---


def classify_proxy_failure(
    error: BaseException, *, context_overflow: bool, interaction_count: int
) -> FailureDisposition:
    """``model_failure_zero`` (train with reward 0) or a reject disposition.

    Statuses compare exactly (the envelope parser already trimmed and upper-cased them). A
    proxy overflow never proves a model failure on its own: it only completes an empty
    Claude reason and the runner family.
    """
    if not isinstance(error, ArenaTaskFailedError):
        return "system_failure_reject"
    status = error.status
    if not isinstance(status, str):
        return "unknown_failure_reject"
    if status in SYSTEM_FAILURE_STATUSES:
        return "system_failure_reject"
    if (
        status == "HARNESS_FAILED"
        and interaction_count > 0
        and model_attributed(_failure_raw(error), context_overflow=context_overflow)
    ):
        return "model_failure_zero"
    return "unknown_failure_reject"


def should_reject_failed_sample(error: BaseException, disposition: FailureDisposition) -> bool:
    """Whether a rejected failure drops only its own sample (with the agent's flag on)."""
    if not isinstance(error, ArenaTaskFailedError):
        return False
    if error.status == "EVAL_FAILED":
        return disposition == "system_failure_reject"
    if error.status in ("HARNESS_FAILED", "NO_OUTPUT", "TIMEOUT"):
        return disposition == "unknown_failure_reject"
    return False
