"""Failure attribution of Arena tasks: model failure (reward 0) or a rejected sample.

Baseline rules (spec 9.1) train a ``NO_OUTPUT``/``TIMEOUT``/Claude ``HARNESS_FAILED`` result
that recorded interactions as reward 0. The stricter rules (spec 14.4, selected by
``reject_terminal_task_failures``) do so only for a ``HARNESS_FAILED`` result whose format
is recognized and whose error is attributable to the model. Also here: the Harness outcome
code of a result and its bounded metric bucket.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from areal.proxy.hooks import FailureDisposition
from areal.proxy.workflow import HARNESS_OUTCOME_METRIC_CODES
from examples.swe.arena_agent_common import clean_text
from examples.swe.arena_results import ArenaTaskFailedError, ArenaTaskResult, normalize_status

__all__ = [
    "classify_failure",
    "harness_error_buckets",
    "harness_outcome_code",
    "needs_runner_receipt",
    "strict_rejects_sample",
]

_SYSTEM_FAILURE_STATUSES = frozenset(
    {"CANCELLED", "COLLECT_FAILED", "EVAL_FAILED", "FAILED", "SETUP_FAILED"}
)
_AGENT_PHASE_EXITED = "harness: harness agent phase exited with code"
_CLAUDE_AGENT_PHASE_ERROR = "harness: agent phase error: claude reported error"
_OUTCOME_MARKER = "GAMEAGENT_OUTCOME_CODE="
_OUTCOME_CODE_RE = re.compile(r"[A-Z][A-Z0-9_]{0,127}")
_MODEL_OUTCOME_CODES = frozenset({"AGENT_MAX_TURNS_EXCEEDED", "AUTONOMOUS_INCOMPLETE_NO_SHIP"})
_NATIVE_RUN_FAILURE_CODES = frozenset({"RUNTIME_EXECUTION_FAILED", "DSH_PUBLIC_ANSWER_MISSING"})
# Error text that points at infrastructure, never at the model.
_SYSTEM_ERROR_RE = re.compile(
    "|".join(
        (
            r"authentication",
            r"unauthori[sz]ed",
            r"invalid api key",
            r"permission denied",
            r"rate[ _-]?limit",
            r"connection (?:reset|refused|error)",
            r"timed out",
            r"timeout",
            r"service unavailable",
            r"internal server error",
            r"bad gateway",
            r"out of memory",
            r"no space left",
            r"traceback",
            r"llm_response_failed",
            r"system_failure",
            r"export_failed",
            r"setup_failed",
            r"eval_failed",
            r"(?:http|status|api error)\D{0,12}\b(?:401|403|408|429|500|502|503|504)\b",
        )
    ),
    re.IGNORECASE,
)
_CONTEXT_REASON_RE = re.compile(
    r"prompt.{0,4}too.{0,2}long"
    r"|context (?:window|length).{0,24}(?:exceeded|exhausted)"
    r"|(?:length|window) (?:exceeded|exhausted)"
    r"|maximum context length"
    r"|max(?:imum)?[ _-]turns? (?:exceeded|reached)"
)
_RUNNER_CONTEXT_RE = re.compile(
    r"model.{0,40}(?:length|context)|maximum context|no output|compaction.{0,40}disabled"
)


def _failure_raw(error: BaseException) -> Any:
    result = getattr(error, "result", None)
    if isinstance(result, ArenaTaskResult):
        return result.raw
    payload = getattr(error, "payload", None)
    return payload.get("raw") if isinstance(payload, Mapping) else None


def _raw_error_text(raw: Any) -> str:
    text = raw.get("error") if isinstance(raw, Mapping) else None
    return text if isinstance(text, str) else ""


def harness_outcome_code(raw: Any) -> str | None:
    """The one outcome code a result reports (``raw.outcome.code``, ``raw.outcome_code``,
    ``GAMEAGENT_OUTCOME_CODE=<CODE>`` markers in ``raw.error``), else ``None``.

    A malformed marker voids the result; so do two different codes.
    """
    if not isinstance(raw, Mapping):
        return None
    candidates: list[Any] = []
    outcome = raw.get("outcome")
    if isinstance(outcome, Mapping):
        candidates.append(outcome.get("code"))
    candidates.append(raw.get("outcome_code"))
    codes = {c for c in candidates if isinstance(c, str) and _OUTCOME_CODE_RE.fullmatch(c)}
    for marker in re.finditer(re.escape(_OUTCOME_MARKER) + r"(\S*)", _raw_error_text(raw)):
        if not _OUTCOME_CODE_RE.fullmatch(marker.group(1)):
            return None
        codes.add(marker.group(1))
    return codes.pop() if len(codes) == 1 else None


def _outcome_bucket(code: str | None) -> str:
    """A bounded metric-key suffix: listed codes as themselves, everything else ``OTHER``."""
    return code if code in HARNESS_OUTCOME_METRIC_CODES else "OTHER"


def harness_error_buckets(raw: Any) -> dict[str, float]:
    """``harness_error/<bucket>`` one-hot metrics of a ``HARNESS_FAILED`` result's outcome code."""
    bucket = _outcome_bucket(harness_outcome_code(raw))
    return {
        f"harness_error/{code}": float(code == bucket)
        for code in (*sorted(HARNESS_OUTCOME_METRIC_CODES), "OTHER")
    }


def _result_families(raw: Mapping[str, Any], text: str) -> set[str]:
    """Which Harness result formats ``raw`` looks like (exactly one is attributable)."""
    lowered = text.lower()
    families = set()
    if (
        any(str(key).startswith("native") for key in raw)
        or any(key in raw for key in ("runTerminals", "runFailures", "exportedRunCount"))
        or raw.get("harness") == "AReaLHarness"
    ):
        families.add("native")
    if (
        "outcome" in raw
        or "outcome_code" in raw
        or _OUTCOME_MARKER in text
        or "gameagent.envarena:" in lowered
    ):
        families.add("gameagent")
    if "harness agent phase exited with code" in lowered and "claude reported error" in lowered:
        families.add("legacy-claude")
    if "implementation" in raw or (isinstance(raw.get("harness"), Mapping) and not families):
        families.add("native-runner")
    return families


def _vetoed(raw: Mapping[str, Any]) -> bool:
    """Signs that a failed result is not the model's doing (14.4 common vetoes)."""
    if "trajectoryHealth" in raw and raw["trajectoryHealth"] != "healthy":
        return True
    if raw.get("failure") is not None:
        return True
    if "status" in raw and raw["status"] != "ERROR":
        return True
    error = raw.get("error")
    if error is not None and not isinstance(error, str):
        return True
    text = error or ""
    if _SYSTEM_ERROR_RE.search(text):
        return True
    return any(
        any(word in line for word in ("export", "collect", "setup"))
        and ("failed" in line or "error" in line)
        for line in text.lower().splitlines()
    )


def _legacy_claude_model_failure(text: str, context_overflow: bool) -> bool:
    lowered = text.lower()
    reasons = {m.group(1).strip() for m in re.finditer(r"claude reported error:?([^\n]*)", lowered)}
    if len(reasons) != 1:
        return False
    lines = [line for line in lowered.splitlines() if line.strip()]
    last = lines[-1].rstrip() if lines else ""
    if "collect" in last and (last.endswith(("...", "\u2026")) or "truncated" in last):
        return False  # the collect log was cut off: the real cause may be missing
    (reason,) = reasons
    if not reason:
        return context_overflow
    return bool(_CONTEXT_REASON_RE.search(reason))


def _native_model_failure(raw: Mapping[str, Any]) -> bool:
    """A version-1, healthy, completed native receipt whose runs failed only at runtime.

    This port reads the receipt from ``raw``: ``nativeReceiptVersion == 1``,
    ``trajectoryHealth == "healthy"``, ``nativeStatus == "completed"`` and a non-empty
    ``runFailures`` list whose every entry has ``code`` RUNTIME_EXECUTION_FAILED or
    DSH_PUBLIC_ANSWER_MISSING (or ``reason`` ``public_answer_missing``).
    """
    version = raw.get("nativeReceiptVersion")
    if isinstance(version, bool) or version != 1:
        return False
    if raw.get("trajectoryHealth") != "healthy":
        return False
    if clean_text(raw.get("nativeStatus")).lower() != "completed":
        return False
    failures = raw.get("runFailures")
    if not isinstance(failures, list) or not failures:
        return False
    return all(
        isinstance(f, Mapping)
        and (
            f.get("code") in _NATIVE_RUN_FAILURE_CODES or f.get("reason") == "public_answer_missing"
        )
        for f in failures
    )


def _runner_model_failure(raw: Mapping[str, Any], receipt: Any, context_overflow: bool) -> bool:
    """A typed context-length failure the proxy also saw, or a fetched runner receipt with
    exactly one failed turn whose message is about model length, no output or compaction."""
    typed = raw.get("error_type", raw.get("errorType"))
    if context_overflow and clean_text(typed).lower() == "context_length_exceeded":
        return True
    turns = receipt.get("turns") if isinstance(receipt, Mapping) else None
    if not isinstance(turns, list):
        return False
    failed = [
        t
        for t in turns
        if isinstance(t, Mapping) and clean_text(t.get("status")).lower() == "failed"
    ]
    if len(failed) != 1 or not isinstance(failed[0].get("error"), str):
        return False
    return bool(_RUNNER_CONTEXT_RE.search(failed[0]["error"].lower()))


def _model_attributed(error: ArenaTaskFailedError, context_overflow: bool) -> bool:
    raw = _failure_raw(error)
    if not isinstance(raw, Mapping) or _vetoed(raw):
        return False
    text = _raw_error_text(raw)
    families = _result_families(raw, text)
    if len(families) != 1:
        return False
    (family,) = families
    if family == "gameagent":
        return harness_outcome_code(raw) in _MODEL_OUTCOME_CODES
    if family == "legacy-claude":
        return _legacy_claude_model_failure(text, context_overflow)
    if family == "native":
        return _native_model_failure(raw)
    return _runner_model_failure(raw, error.harness_result, context_overflow)


def _baseline_model_failure(
    error: ArenaTaskFailedError, status: str, context_overflow: bool
) -> bool:
    """Spec 9.1: no output or a timeout, or a context-overflow or Claude Harness failure."""
    if status in ("NO_OUTPUT", "TIMEOUT"):
        return True
    if status != "HARNESS_FAILED":
        return False
    text = _raw_error_text(_failure_raw(error)).lower()
    claude_error = _AGENT_PHASE_EXITED in text and _CLAUDE_AGENT_PHASE_ERROR in text
    return context_overflow or claude_error


def _strict_model_failure(error: ArenaTaskFailedError, status: str, context_overflow: bool) -> bool:
    """Spec 14.4: only a ``HARNESS_FAILED`` result whose format and error blame the model."""
    return status == "HARNESS_FAILED" and _model_attributed(error, context_overflow)


def classify_failure(
    error: BaseException, *, strict: bool, context_overflow: bool, interaction_count: int
) -> FailureDisposition:
    """``model_failure_zero`` (train with reward 0) or a reject disposition (strict or baseline).

    Infrastructure statuses and non-task errors always reject; a model failure also needs
    at least one recorded interaction to train on.
    """
    if not isinstance(error, ArenaTaskFailedError):
        return "system_failure_reject"
    status = normalize_status(error.status)
    if status in _SYSTEM_FAILURE_STATUSES:
        return "system_failure_reject"
    model_failure = _strict_model_failure if strict else _baseline_model_failure
    if interaction_count > 0 and model_failure(error, status, context_overflow):
        return "model_failure_zero"
    return "unknown_failure_reject"


def strict_rejects_sample(error: BaseException, disposition: FailureDisposition) -> bool:
    """Under the strict rules, whether to drop only this failed group member."""
    if not isinstance(error, ArenaTaskFailedError):
        return False
    status = normalize_status(error.status)
    if status == "EVAL_FAILED":
        return disposition == "system_failure_reject"
    if status in ("HARNESS_FAILED", "NO_OUTPUT", "TIMEOUT"):
        return disposition == "unknown_failure_reject"
    return False


def needs_runner_receipt(error: ArenaTaskFailedError) -> bool:
    """Whether attribution needs the fetched Harness receipt (a native-runner failure)."""
    raw = _failure_raw(error)
    if normalize_status(error.status) != "HARNESS_FAILED" or not isinstance(raw, Mapping):
        return False
    return _result_families(raw, _raw_error_text(raw)) == {"native-runner"}
