"""Failed-harness results in the shapes hosted Arena's harnesses report them.

A training client attributes a ``HARNESS_FAILED`` task to the model only when its ``raw``
result proves it through one result family. These builders give the local Arena each
family (and an unattributable failure), for fault injection
(``fail_after_harness: {id: "HARNESS_FAILED:<format>"}``) and for harnesses that report
GameAgent outcome codes:

==================  ====================================================================
format              ``raw`` fields
==================  ====================================================================
``claude``          Claude Code's agent-phase log, reason "Prompt is too long"
``claude_empty``    the same log with an empty reason (the model's only with an overflow)
``gameagent``       GameAgent outcome ``AGENT_MAX_TURNS_EXCEEDED`` (object, code, marker)
``native``          a healthy native receipt v1 whose one run lacked a public answer
``runner``          a native runner's agent-phase exit envelope (needs an overflow)
``unattributed``    a plain error text that proves nothing
==================  ====================================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from examples.swe.local_arena.types import HarnessError

__all__ = ["FAILURE_FORMATS", "HarnessResultError", "failure_fields", "gameagent_fields"]

FAILURE_FORMATS = ("claude", "claude_empty", "gameagent", "native", "runner", "unattributed")

CLAUDE_EXIT = "harness: harness agent phase exited with code 1"
CLAUDE_ERROR = "harness: agent phase error: claude reported error:"


class HarnessResultError(HarnessError):
    """A harness failure that reports result fields (merged into ``raw``) with its message."""

    def __init__(self, message: str, fields: Mapping[str, Any]):
        super().__init__(message)
        self.fields = dict(fields)


def gameagent_fields(code: str, detail: str) -> dict[str, Any]:
    """A GameAgent result: the outcome object, its code, and the marker closing the log."""
    return {
        "outcome": {"code": code},
        "outcome_code": code,
        "error": f"gameagent.envarena: {detail}\nGAMEAGENT_OUTCOME_CODE={code}",
    }


def _native_receipt() -> dict[str, Any]:
    return {
        "nativeRlReceiptVersion": 1,
        "nativeExecutionHealthy": True,
        "nativeExportHealthy": True,
        "status": "ERROR",
        "trajectoryHealth": "healthy",
        "nativeStopReason": "completed",
        "nativeFailure": None,
        "runTerminals": {"main": "run.failed"},
        "exportedRunCount": 1,
        "runFailures": [
            {
                "runId": "main",
                "error": {
                    "code": "RUNTIME_EXECUTION_FAILED",
                    "details": {
                        "runtimeFailure": {
                            "code": "DSH_PUBLIC_ANSWER_MISSING",
                            "reason": "public_answer_missing",
                        }
                    },
                },
            }
        ],
    }


def failure_fields(fmt: str, harness_ref: str = "") -> dict[str, Any]:
    """The ``raw`` fields of a failed harness run in format ``fmt`` (see the module table)."""
    if fmt == "claude":
        return {"error": f"{CLAUDE_EXIT}\n{CLAUDE_ERROR} Prompt is too long"}
    if fmt == "claude_empty":
        return {"error": f"{CLAUDE_EXIT}\n{CLAUDE_ERROR}"}
    if fmt == "gameagent":
        return gameagent_fields("AGENT_MAX_TURNS_EXCEEDED", "the agent used its turn budget")
    if fmt == "native":
        return _native_receipt()
    if fmt == "runner":
        harness = {"phase": "agent", "exit_code": 1, "result_status": "ERROR"}
        if harness_ref:
            harness["ref"] = harness_ref
        return {
            "error": f"{CLAUDE_EXIT}: model stopped without visible output or tool calls",
            "harness": harness,
        }
    if fmt == "unattributed":
        return {"error": "harness failed"}
    raise ValueError(f"unknown failure format {fmt!r}; expected one of {FAILURE_FORMATS}")
