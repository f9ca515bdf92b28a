"""Failure attribution as the reference decides it (docs/arena_training.md, "Failures"):
every acceptance case of the reference's rules, by number (``caseNN-...`` in the test id).

Cases 1-54 and 72 call ``ArenaStreamAgentWorkflow.classify_proxy_failure`` on the class.
Cases 55-64 and 67 run the proxy workflow against a real proxy over loopback (scripted
engine); 61-64 and 67 host the real Arena agent, whose fake Arena "Harness" calls the proxy
with the launch credentials. Cases 65-66, 68 and 71 drive the agent's hooks; 69-70 the
workflow's interaction stats on hand-built exports.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch
from transformers import AutoTokenizer

from areal.infra import workflow_context
from areal.proxy.client import ProxyError
from areal.proxy.interaction import ExportedInteraction
from areal.proxy.workflow import OpenAIProxyWorkflow, record_interaction_stats
from examples.swe.arena_agent import ArenaStreamAgentWorkflow
from examples.swe.arena_client import ArenaAPIError, ArenaOpenAPIClient, ArenaTaskFailedError
from examples.swe.arena_results import ArenaTaskResult
from tests.fakes.live_server import serve
from tests.unit.examples.test_arena_agent_fakes import (
    ARENA_ENV,
    ROW,
    TOKEN,
    FakeArena,
    FakeArenaASGI,
    make_agent,
    make_client,
    metrics,
    run_kwargs,
)
from tests.unit.proxy.conftest import ADMIN, ScriptedEngine, running_proxy

S, U, Z = "system_failure_reject", "unknown_failure_reject", "model_failure_zero"
AMTE = "AGENT_MAX_TURNS_EXCEEDED"
NO_SHIP = "AUTONOMOUS_INCOMPLETE_NO_SHIP"
MISSING = object()  # a failed-task error without a parsed result

CLX = (
    "harness: harness agent phase exited with code 1: "
    "harness: agent phase error: claude reported error:"
)
ENV = {
    "error": "harness: running setup hook (timeout=10m0s)",
    "harness": {"phase": "agent", "exit_code": 1, "result_status": "ERROR"},
}
STREAM_ERROR = (
    'model reported a streaming error (event=error, code=Some("context_length_exceeded"), '
    'type=Some("context_length_exceeded"), reason=None)'
)
FULL = {
    "implementation": "rust-core-runtime",
    "status": "ERROR",
    "exit_code": 1,
    "execution_state": "exited",
    "unconfirmed_tools": [],
    "unconfirmed_tool_count": 0,
    "turn_statuses": ["failed"],
    "recorded_turn_statuses": ["failed"],
    "root_turn_statuses": ["failed"],
    "error": [{"message": STREAM_ERROR}],
}
TS = "2025/01/02 03:04:05.250 "
CLAUDE_LOG_41 = (
    f"harness: harness agent phase exited with code 1\n{TS}"
    "harness: agent phase error: claude reported error:\n"
    f"{TS}harness: running collect hook\n{TS}harness: claude reported error:"
)


def receipt() -> dict[str, Any]:
    """R: the healthy native receipt (one failed run, one completed run)."""
    return {
        "nativeRlReceiptVersion": 1,
        "nativeExecutionHealthy": True,
        "nativeExportHealthy": True,
        "status": "ERROR",
        "trajectoryHealth": "healthy",
        "nativeStopReason": "completed",
        "nativeFailure": None,
        "exportedRunCount": 2,
        "runTerminals": {"main": "run.failed", "child": "run.completed"},
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


def receipt_with(**changes: Any) -> dict[str, Any]:
    return {**receipt(), **changes}


def receipt_without(key: str) -> dict[str, Any]:
    raw = receipt()
    del raw[key]
    return raw


def receipt_failure(change: Callable[[dict], None]) -> dict[str, Any]:
    raw = receipt()
    change(raw["runFailures"][0])
    return raw


def failed(status: str, raw: Any = None) -> ArenaTaskFailedError:
    """A task-failed error as the client raises it (``raw=MISSING``: no parsed result)."""
    if raw is MISSING:
        return ArenaTaskFailedError("task-9", status)
    result = ArenaTaskResult("task-9", status, None, raw)
    return ArenaTaskFailedError("task-9", status, {"status": status, "raw": raw}, result)


def case(number: int, name: str, error: Any, expected: str, *, ovf=False, n=1):
    return pytest.param(error, ovf, n, expected, id=f"case{number:02d}-{name}")


def matrix(number: int, name: str, errors: dict[str, Any], expected: str, ovfs, ns=(1,)):
    return [
        case(number, f"{name}-{label}-ovf{int(o)}-n{k}", e, expected, ovf=o, n=k)
        for label, e in errors.items()
        for o in ovfs
        for k in ns
    ]


BOTH = (False, True)

# Case 15: R with one change each.
R_CHANGES = {
    "version-null": {"nativeRlReceiptVersion": None},
    "version-true": {"nativeRlReceiptVersion": True},
    "version-1.0": {"nativeRlReceiptVersion": 1.0},
    "version-2": {"nativeRlReceiptVersion": 2},
    "exec-healthy-false": {"nativeExecutionHealthy": False},
    "exec-healthy-1": {"nativeExecutionHealthy": 1},
    "export-healthy-false": {"nativeExportHealthy": False},
    "status-OK": {"status": "OK"},
    "trajectory-degraded": {"trajectoryHealth": "degraded"},
    "stop-cancelled": {"nativeStopReason": "cancelled"},
    "native-failure": {"nativeFailure": {"code": "PROVIDER_FAILED"}},
    "run-count-3": {"exportedRunCount": 3},
    "run-count-2.0": {"exportedRunCount": 2.0},
    "child-cancelled": {"runTerminals": {"main": "run.failed", "child": "run.cancelled"}},
    "both-failed": {"runTerminals": {"main": "run.failed", "child": "run.failed"}},
    "failures-empty": {"runFailures": []},
    "failures-null": {"runFailures": [None]},
}
R_FIELDS = (
    "nativeRlReceiptVersion",
    "nativeExecutionHealthy",
    "nativeExportHealthy",
    "status",
    "trajectoryHealth",
    "nativeStopReason",
    "nativeFailure",
    "exportedRunCount",
    "runTerminals",
    "runFailures",
)


def _duplicated(raw: dict) -> dict:
    raw["runFailures"].append(copy.deepcopy(raw["runFailures"][0]))
    return raw


R_FAILURE_CHANGES = {
    "duplicated": _duplicated(receipt()),
    "run-unknown": receipt_failure(lambda f: f.update(runId="unknown")),
    "code-system": receipt_failure(lambda f: f["error"].update(code="SYSTEM_FAILURE")),
    "runtime-provider": receipt_failure(
        lambda f: f["error"]["details"]["runtimeFailure"].update(code="PROVIDER_FAILED")
    ),
    "reason-timeout": receipt_failure(
        lambda f: f["error"]["details"]["runtimeFailure"].update(reason="timeout")
    ),
    "no-details": receipt_failure(lambda f: f["error"].pop("details")),
}
SECOND_FAMILY = {
    "outcome": {"outcome": {"code": AMTE}},
    "outcome-code": {"outcome_code": AMTE},
    "outcome-code-system": {"outcome_code": "SYSTEM_FAILURE"},
    "marker": {"error": f"GAMEAGENT_OUTCOME_CODE={AMTE}"},
    "claude-log": {"error": CLX},
}
RUNNER_MESSAGES = (
    "shared model request budget exhausted",
    "model stopped without visible output or tool calls",
    "tool calls and finish reason disagree",
    "invalid tool name",
)


def runner_exit(message: str) -> dict[str, Any]:
    return {
        "error": f"harness: harness agent phase exited with code 1: {message}",
        "harness": {"exit_code": 1, "phase": "agent", "result_status": "ERROR"},
    }


def with_receipt_72() -> ArenaTaskFailedError:
    error = failed("HARNESS_FAILED", ENV)
    error.harness_result = {
        "implementation": "rust-core-runtime",
        "status": "ERROR",
        "exit_code": 1,
        "turn_statuses": ["failed"],
        "error": [{"message": "model stopped with reason: length"}],
    }
    return error


CLASSIFIER_CASES = [
    *matrix(
        1,
        "non-task-error",
        {
            "api": ArenaAPIError("poll returned HTTP 500"),
            "transport": httpx.ConnectError("connection refused"),
        },
        S,
        (True,),
    ),
    case(2, "local-wait-timeout", TimeoutError("did not finish within 600s"), S),
    case(2, "config-error", ValueError("stream_id is required"), S),
    case(3, "setup-failed-no-raw", failed("SETUP_FAILED"), S, ovf=True),
    case(4, "setup-failed-beats-receipt", failed("SETUP_FAILED", receipt()), S),
    *matrix(5, "error-status", {"receipt": failed("ERROR", receipt())}, S, BOTH, (0, 3)),
    *matrix(
        6,
        "system-status",
        {
            f"{status}-{label}": failed(status, raw)
            for status in ("EVAL_FAILED", "COLLECT_FAILED", "CANCELLED", "FAILED")
            for label, raw in (("receipt", receipt()), ("gameagent", {"outcome_code": AMTE}))
        },
        S,
        BOTH,
    ),
    case(7, "unparsed-lower-case-status", failed("setup_failed", MISSING), U),
    *matrix(
        8, "harness-failed-no-result", {"": failed("HARNESS_FAILED", MISSING)}, U, (True,), (0, 1)
    ),
    case(8, "harness-failed-no-result-no-ovf", failed("HARNESS_FAILED", MISSING), U),
    case(9, "timeout-n1", failed("TIMEOUT", MISSING), U),
    case(9, "timeout-ovf-n0", failed("TIMEOUT", MISSING), U, ovf=True, n=0),
    *matrix(9, "no-output", {"": failed("NO_OUTPUT", MISSING)}, U, (False,), (0, 1)),
    *matrix(
        10,
        "receipt-on-non-harness-status",
        {s: failed(s, receipt()) for s in ("TIMEOUT", "NO_OUTPUT")},
        U,
        BOTH,
    ),
    *matrix(
        11,
        "empty-raw",
        {
            f"{status}-{label}": failed(status, raw)
            for status in ("HARNESS_FAILED", "TIMEOUT", "NO_OUTPUT")
            for label, raw in (
                ("null", None),
                ("{}", {}),
                ("[]", []),
                ("export-unhealthy", {"nativeExportHealthy": False}),
            )
        },
        U,
        BOTH,
    ),
    case(12, "plain-error-n3", failed("HARNESS_FAILED", {"error": "harness failed"}), U, n=3),
    case(12, "plain-error-ovf", failed("HARNESS_FAILED", {"error": "harness failed"}), U, ovf=True),
    case(13, "healthy-receipt", failed("HARNESS_FAILED", receipt()), Z),
    case(14, "healthy-receipt-n0", failed("HARNESS_FAILED", receipt()), U, n=0),
    *matrix(
        15,
        "receipt-changed",
        {k: failed("HARNESS_FAILED", receipt_with(**v)) for k, v in R_CHANGES.items()},
        U,
        (False,),
    ),
    *matrix(
        16,
        "receipt-without",
        {k: failed("HARNESS_FAILED", receipt_without(k)) for k in R_FIELDS},
        U,
        BOTH,
    ),
    *matrix(
        17,
        "receipt-failure-entry",
        {k: failed("HARNESS_FAILED", raw) for k, raw in R_FAILURE_CHANGES.items()},
        U,
        (False,),
    ),
    case(
        18,
        "log-text-only",
        failed("HARNESS_FAILED", {"error": "DSH_PUBLIC_ANSWER_MISSING public_answer_missing"}),
        U,
    ),
    *matrix(
        19,
        "receipt-plus-family",
        {
            f"{label}-{health}": failed(
                "HARNESS_FAILED",
                {
                    **receipt(),
                    **extra,
                    **({"nativeExportHealthy": False} if health == "unhealthy" else {}),
                },
            )
            for label, extra in SECOND_FAMILY.items()
            for health in ("healthy", "unhealthy")
        },
        U,
        BOTH,
    ),
    case(
        20,
        "receipt-vocabulary-veto",
        failed("HARNESS_FAILED", receipt_with(error="agent timed out")),
        U,
    ),
    case(
        21,
        "areal-harness-wrapper",
        failed("HARNESS_FAILED", {"harness": "AReaLHarness", "error": "x"}),
        U,
        ovf=True,
    ),
    case(22, "outcome-code", failed("HARNESS_FAILED", {"outcome_code": AMTE}), Z),
    case(
        23,
        "outcome-code-with-harness-object",
        failed("HARNESS_FAILED", {"outcome_code": AMTE, "harness": {"phase": "agent"}}),
        Z,
    ),
    case(24, "outcome-object", failed("HARNESS_FAILED", {"outcome": {"code": AMTE}}), Z, n=2),
    case(
        25,
        "no-ship-marker",
        failed("HARNESS_FAILED", {"error": f"harness failed\nGAMEAGENT_OUTCOME_CODE={NO_SHIP}\n"}),
        Z,
        n=2,
    ),
    case(26, "outcome-code-n0", failed("HARNESS_FAILED", {"outcome_code": AMTE}), U, ovf=True, n=0),
    case(
        27, "run-timeout", failed("HARNESS_FAILED", {"outcome_code": "AGENT_RUN_TIMEOUT"}), U, n=2
    ),
    case(
        27,
        "response-timeout",
        failed("HARNESS_FAILED", {"outcome_code": "LLM_RESPONSE_TIMEOUT"}),
        U,
        n=2,
    ),
    case(
        27,
        "response-failed-n0",
        failed("HARNESS_FAILED", {"outcome": {"code": "LLM_RESPONSE_FAILED"}}),
        U,
        n=0,
    ),
    case(28, "unknown-code", failed("HARNESS_FAILED", {"outcome_code": "UNKNOWN_FAILURE"}), U),
    case(
        29,
        "marker-without-boundary-before",
        failed("HARNESS_FAILED", {"error": f"XGAMEAGENT_OUTCOME_CODE={AMTE}"}),
        U,
    ),
    case(
        30,
        "marker-without-boundary-after",
        failed("HARNESS_FAILED", {"error": f"GAMEAGENT_OUTCOME_CODE={AMTE}-invalid"}),
        U,
    ),
    case(
        30,
        "marker-lower-case",
        failed("HARNESS_FAILED", {"error": "GAMEAGENT_OUTCOME_CODE=agent_max_turns_exceeded"}),
        U,
    ),
    case(
        31,
        "conflicting-codes",
        failed(
            "HARNESS_FAILED",
            {"outcome": {"code": "SYSTEM_FAILURE"}, "error": f"GAMEAGENT_OUTCOME_CODE={AMTE}"},
        ),
        U,
    ),
    case(
        32,
        "three-agreeing-candidates",
        failed(
            "HARNESS_FAILED",
            {
                "outcome": {"code": AMTE},
                "outcome_code": AMTE,
                "error": f"GAMEAGENT_OUTCOME_CODE={AMTE} GAMEAGENT_OUTCOME_CLASS=model",
            },
        ),
        Z,
    ),
    case(33, "outcome-string", failed("HARNESS_FAILED", {"outcome": AMTE}), U),
    case(33, "outcome-empty", failed("HARNESS_FAILED", {"outcome": {}}), U),
    *matrix(
        34,
        "gameagent-veto",
        {
            label: failed("HARNESS_FAILED", {"outcome_code": AMTE, **extra})
            for label, extra in (
                ("failure", {"failure": "sandbox"}),
                ("status-OK", {"status": "OK"}),
                ("degraded", {"trajectoryHealth": "degraded"}),
                ("error-list", {"error": ["x"]}),
                ("http-503", {"error": "upstream HTTP 503"}),
                ("rate-limit", {"error": "Rate_Limit hit"}),
            )
        },
        U,
        (False,),
    ),
    case(
        35,
        "http-5030-no-boundary",
        failed("HARNESS_FAILED", {"outcome_code": AMTE, "error": "upstream HTTP 5030"}),
        Z,
    ),
    case(
        36,
        "envarena-without-code",
        failed("HARNESS_FAILED", {"error": "gameagent.envarena: finished"}),
        U,
    ),
    case(37, "claude-empty-reason", failed("HARNESS_FAILED", {"error": CLX}), U, n=3),
    case(38, "claude-empty-reason-ovf", failed("HARNESS_FAILED", {"error": CLX}), Z, ovf=True),
    case(
        39,
        "claude-prompt-too-long",
        failed("HARNESS_FAILED", {"error": CLX + " Prompt is too long"}),
        Z,
    ),
    case(
        39,
        "claude-max-turns",
        failed("HARNESS_FAILED", {"error": CLX + " Reached maximum number of turns (40)"}),
        Z,
    ),
    case(
        40,
        "claude-other-reason",
        failed("HARNESS_FAILED", {"error": CLX + " tool failed"}),
        U,
        ovf=True,
    ),
    case(
        41,
        "claude-repeated-empty-ovf",
        failed("HARNESS_FAILED", {"error": CLAUDE_LOG_41}),
        Z,
        ovf=True,
    ),
    case(41, "claude-repeated-empty", failed("HARNESS_FAILED", {"error": CLAUDE_LOG_41}), U),
    case(
        42,
        "claude-ends-in-collect",
        failed(
            "HARNESS_FAILED",
            {"error": CLX + " prompt is too long\nharness: running collect hook"},
        ),
        U,
        ovf=True,
    ),
    case(
        43,
        "claude-repeat-differs",
        failed(
            "HARNESS_FAILED",
            {
                "error": CLX + " prompt is too long\nharness: running collect hook\n"
                "harness: claude reported error: other"
            },
        ),
        U,
    ),
    case(
        44,
        "claude-first-marker-twice",
        failed(
            "HARNESS_FAILED",
            {
                "error": CLX + " prompt is too long\n"
                "harness: agent phase error: claude reported error: prompt is too long"
            },
        ),
        U,
    ),
    case(
        45,
        "claude-collect-failed",
        failed(
            "HARNESS_FAILED", {"error": CLX + " prompt is too long\nharness: collect hook failed"}
        ),
        U,
    ),
    case(
        46,
        "claude-family-without-marker",
        failed(
            "HARNESS_FAILED",
            {"error": "harness: harness agent phase exited with code 1 (claude=2)"},
        ),
        U,
        ovf=True,
    ),
    case(
        47,
        "claude-setup-timeout-veto",
        failed("HARNESS_FAILED", {"error": "harness: running setup hook (timeout=10m0s)\n" + CLX}),
        U,
        ovf=True,
    ),
    case(48, "runner-envelope-ovf", failed("HARNESS_FAILED", ENV), Z, ovf=True),
    case(48, "runner-envelope", failed("HARNESS_FAILED", ENV), U),
    *matrix(
        49,
        "runner-envelope-veto",
        {
            label: failed("HARNESS_FAILED", {**ENV, "error": ENV["error"] + extra})
            for label, extra in (
                ("timed-out", "\nagent timed out"),
                ("http-500", "\nHTTP 500 Internal Server Error"),
                ("collect-failed", "\ncollect hook failed"),
            )
        },
        U,
        (True,),
    ),
    *matrix(
        50,
        "runner-envelope-invalid",
        {
            "exit-137": failed(
                "HARNESS_FAILED", {**ENV, "harness": {**ENV["harness"], "exit_code": 137}}
            ),
            "exit-true": failed(
                "HARNESS_FAILED", {**ENV, "harness": {**ENV["harness"], "exit_code": True}}
            ),
            "native-version": failed("HARNESS_FAILED", {**ENV, "nativeRlReceiptVersion": 1}),
        },
        U,
        (True,),
    ),
    *matrix(
        51,
        "runner-exit",
        {m.replace(" ", "-"): failed("HARNESS_FAILED", runner_exit(m)) for m in RUNNER_MESSAGES},
        U,
        (False,),
    ),
    *matrix(
        52,
        "runner-exit-ovf",
        {m.replace(" ", "-"): failed("HARNESS_FAILED", runner_exit(m)) for m in RUNNER_MESSAGES},
        Z,
        (True,),
    ),
    case(53, "runner-full-receipt-ovf", failed("HARNESS_FAILED", FULL), Z, ovf=True),
    case(53, "runner-full-receipt", failed("HARNESS_FAILED", FULL), U),
    *matrix(
        54,
        "runner-full-receipt-invalid",
        {
            "extra-message": failed(
                "HARNESS_FAILED",
                {**FULL, "error": [*FULL["error"], {"message": "HTTP 500 Internal Server Error"}]},
            ),
            "native-version": failed("HARNESS_FAILED", {**FULL, "nativeRlReceiptVersion": 1}),
            "exit-137": failed("HARNESS_FAILED", {**FULL, "exit_code": 137}),
            "delivery": failed("HARNESS_FAILED", {**FULL, "delivery": {}}),
        },
        U,
        (True,),
    ),
    case(72, "sibling-revision-receipt-not-fetched", with_receipt_72(), U),
]


@pytest.mark.parametrize("error, ovf, n, expected", CLASSIFIER_CASES)
def test_classify_proxy_failure(error, ovf, n, expected):
    disposition = ArenaStreamAgentWorkflow.classify_proxy_failure(
        error, context_overflow=ovf, interaction_count=n
    )
    assert disposition == expected


def test_classifier_is_class_level_and_reads_no_instance_state():
    agent = make_agent(FakeArena(), flag=True)
    error = failed("HARNESS_FAILED", {"outcome_code": AMTE})
    assert agent.classify_proxy_failure(
        error, context_overflow=False, interaction_count=1
    ) == ArenaStreamAgentWorkflow.classify_proxy_failure(
        error, context_overflow=False, interaction_count=1
    )
    # the flag changes no disposition: a TIMEOUT with interactions stays rejected
    timeout = failed("TIMEOUT", MISSING)
    for flagged in (make_agent(FakeArena(), flag=True), make_agent(FakeArena())):
        assert (
            flagged.classify_proxy_failure(timeout, context_overflow=True, interaction_count=5) == U
        )


async def test_error_status_from_the_result_endpoint_is_a_system_failure():
    # case 5 end to end: ERROR is failed-terminal, and the envelope parser normalizes it
    fake = FakeArena()
    fake.polls = [{"status": "RUNNING"}, {"status": " error ", "raw": receipt()}]
    agent = make_agent(fake)
    with pytest.raises(ArenaTaskFailedError) as caught:
        await agent.run(dict(ROW), **run_kwargs())
    assert caught.value.status == "ERROR"
    assert (
        agent.classify_proxy_failure(caught.value, context_overflow=False, interaction_count=3) == S
    )


# --- the proxy workflow (cases 55-64, 67) ---


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(autouse=True)
async def isolated(monkeypatch):
    for name in ARENA_ENV:
        monkeypatch.delenv(name, raising=False)
    metrics()
    yield
    await workflow_context.close_clients()


BOOM = "BOOM-backend-failure"


class FlakyEngine(ScriptedEngine):
    """Answers as scripted; a prompt containing ``BOOM`` fails in the backend (a 5xx)."""

    async def agenerate(self, req):
        if BOOM in self.tokenizer.decode(req.input_ids):
            raise RuntimeError("backend down")
        return await super().agenerate(req)


async def chat(base_url: str, key: str, content: str, first: str = "hi") -> httpx.Response:
    """One chat call; ``first`` starts the conversation (another ``first``: another branch)."""
    async with httpx.AsyncClient(timeout=30) as http:
        return await http.post(
            f"{base_url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {key}"},
            json={
                "model": "m",
                "messages": [
                    {"role": "user", "content": first},
                    {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": content},
                ],
                "max_tokens": 8,
            },
        )


async def harness(
    base_url: str, key: str, *, calls: int = 1, overflow: bool = False, boom: bool = False
) -> None:
    """What a Harness does: ``calls`` good calls, then an overflow and/or a backend failure."""
    for i in range(calls):
        (await chat(base_url, key, f"call {i}")).raise_for_status()
    if overflow:
        assert (await chat(base_url, key, "word " * 500)).status_code == 400
    if boom:
        assert (await chat(base_url, key, BOOM)).status_code >= 500


class GenericAgent:
    """A non-Arena agent with the workflow hooks, recording what the workflow calls."""

    def __init__(self, *, reward=1.0, fail=None, disposition=None, classify=True, **harness):
        self.reward, self.fail, self.disposition, self.harness = reward, fail, disposition, harness
        self.events: list[tuple] = []
        if not classify:
            self.classify_proxy_failure = None  # the workflow treats it as missing

    async def run(self, data, **kwargs):
        self.session_id = kwargs["session_id"]
        await harness(kwargs["base_url"], kwargs["api_key"], **self.harness)
        if self.fail is not None:
            raise self.fail
        return self.reward

    def classify_proxy_failure(self, error, *, context_overflow, interaction_count):
        self.events.append(("classify", context_overflow, interaction_count))
        return self.disposition

    def record_failure_disposition(self, data, error, disposition):
        self.events.append(("disposition", disposition))

    def persist_episode_result(self, data, reward):
        self.events.append(("persist", reward))


def persists(agent) -> list:
    return [e[1] for e in agent.events if e[0] == "persist"]


async def run_workflow(agent, tokenizer, *, task_id=1, engine=None, **options):
    """One episode of ``agent`` against a fresh proxy; returns (result or error, server)."""
    proxy_options = {"engine_max_tokens": 200}
    style = options.pop("export_style", "individual")
    if "chat_template_type" in options:
        proxy_options["chat_template_type"] = options.pop("chat_template_type")
    engine = engine or FlakyEngine(tokenizer, ["the answer"])
    fake = getattr(agent, "fake", None)
    with (
        running_proxy(engine, tokenizer, **proxy_options) as (url, server),
        serve(FakeArenaASGI(fake)) if fake else contextlib.nullcontext() as arena_url,
    ):
        if fake is not None:  # the Arena calls travel over the workflow's own HTTP client
            agent.client = ArenaOpenAPIClient(
                base_url=arena_url, api_token=TOKEN, poll_interval=0.01, request_retries=0
            )
        workflow = OpenAIProxyWorkflow(
            agent=agent, proxy_addr=url, admin_api_key=ADMIN, export_style=style, **options
        )
        with workflow_context.scoped(task_id=task_id):
            try:
                return await workflow.arun_episode(None, dict(ROW)), server
            except Exception as e:  # returned, so tests can look at the server too
                return e, server
            finally:
                if fake is not None:
                    await agent.client.aclose()


async def test_case55_system_error_rejects_without_asking_the_agent(tokenizer):
    agent = GenericAgent(fail=RuntimeError("harness crashed"), disposition=Z, boom=True)
    result, server = await run_workflow(agent, tokenizer)
    assert isinstance(result, RuntimeError) and "harness crashed" in str(result)
    assert server.store.get(agent.session_id) is not None  # never exported
    assert ("disposition", S) in agent.events
    assert not any(e[0] == "classify" for e in agent.events)
    stats = metrics()
    assert "rollout/reward" not in stats
    assert stats["rollout/proxy_system_error"] == 1.0


async def test_case56_success_with_overflow_trains_as_zero(tokenizer):
    agent = GenericAgent(reward=1.0, calls=1, overflow=True)
    result, _ = await run_workflow(agent, tokenizer)
    assert [i.reward for i in result.values()] == [0.0]  # the agent's 1.0 is overridden
    assert persists(agent) == [0.0]
    stats = metrics()
    assert stats["rollout/context_overflow"] == 1.0 and stats["rollout/reward"] == 0.0


async def test_case57_failure_with_overflow_and_nothing_to_train_on(tokenizer):
    agent = GenericAgent(
        fail=RuntimeError("prompt too long"), classify=False, calls=0, overflow=True
    )
    result, _ = await run_workflow(agent, tokenizer)
    assert result is None
    assert persists(agent) == [None]
    stats = metrics()
    assert "rollout/reward" not in stats and stats["rollout/context_overflow"] == 1.0


async def test_case58_success_with_empty_export(tokenizer):
    agent = GenericAgent(reward=1.0, calls=0)
    result, _ = await run_workflow(agent, tokenizer)
    assert result is None
    assert persists(agent) == [None]
    assert "rollout/reward" not in metrics()


async def test_case59_success_with_overflow_and_system_error_is_a_system_failure(tokenizer):
    agent = GenericAgent(reward=1.0, calls=1, overflow=True, boom=True, disposition=Z)
    result, server = await run_workflow(agent, tokenizer)
    assert isinstance(result, RuntimeError) and "system failure" in str(result)
    assert ("disposition", S) in agent.events
    assert persists(agent) == [None]
    assert server.store.get(agent.session_id) is not None  # never exported
    stats = metrics()
    assert "rollout/reward" not in stats
    assert stats["rollout/proxy_system_error"] == 1.0 and stats["rollout/context_overflow"] == 1.0


async def test_case60_success_with_system_error_only_keeps_the_reward(tokenizer):
    agent = GenericAgent(reward=0.75, calls=1, boom=True)
    result, _ = await run_workflow(agent, tokenizer)
    assert [i.reward for i in result.values()] == [0.75]
    assert persists(agent) == [0.75]
    stats = metrics()
    assert stats["rollout/proxy_system_error"] == 1.0 and stats["rollout/reward"] == 0.75


# --- the Arena agent hosted by the workflow ---


class AuditedArenaAgent(ArenaStreamAgentWorkflow):
    """The Arena agent, counting its final-reward hook calls."""

    def __init__(self, fake: FakeArena, *, flag: bool = False, **econfig: Any):
        super().__init__(
            {"stream_id": "stream-a", "arena_llm_route_mode": "direct", **econfig},
            reject_terminal_task_failures=flag,
            arena_client=make_client(fake),  # replaced by one over HTTP in run_workflow
        )
        self.fake = fake
        self.persisted: list[float | None] = []

    async def persist_episode_result(self, data, reward):
        self.persisted.append(reward)
        await super().persist_episode_result(data, reward)


def arena_with(status: str, raw: Any, **harness_options: Any) -> FakeArena:
    """A fake Arena whose Harness calls the proxy, then ends the task with ``status``."""
    fake = FakeArena()

    async def launch(request: httpx.Request) -> None:
        body = json.loads(request.content)
        await harness(body["base_url"], body["api_key"], **harness_options)

    fake.script("launch", launch)
    fake.polls = [{"status": status, "raw": raw}]
    return fake


AMBIGUOUS = {"error": "harness failed"}


@pytest.mark.parametrize(
    "status, raw, ovf",
    [
        pytest.param(s, AMBIGUOUS, o, id=f"case61-{s}-ambiguous-ovf{int(o)}")
        for s in ("HARNESS_FAILED", "TIMEOUT", "NO_OUTPUT")
        for o in BOTH
    ]
    + [pytest.param("EVAL_FAILED", None, o, id=f"case61-EVAL_FAILED-ovf{int(o)}") for o in BOTH],
)
async def test_case61_flag_drops_only_the_failed_sample(tokenizer, status, raw, ovf):
    agent = AuditedArenaAgent(arena_with(status, raw, calls=1, overflow=ovf), flag=True)
    result, server = await run_workflow(agent, tokenizer)
    assert result is None  # dropped alone: no error reaches the group
    assert agent.persisted == [None]
    assert server.store.get(agent.get_episode_metadata()["session_id"]) is not None  # no export
    stats = metrics()
    assert "rollout/reward" not in stats
    assert stats["rollout/context_overflow"] == float(ovf)


@pytest.mark.parametrize(
    "status, flag, boom",
    [
        pytest.param("SETUP_FAILED", True, False, id="case62-SETUP_FAILED-flag-on"),
        pytest.param("HARNESS_FAILED", False, False, id="case62-ambiguous-flag-off"),
        pytest.param("HARNESS_FAILED", True, True, id="case62-ambiguous-flag-on-system-error"),
    ],
)
async def test_case62_rejections_that_raise(tokenizer, status, flag, boom):
    agent = AuditedArenaAgent(arena_with(status, AMBIGUOUS, calls=1, boom=boom), flag=flag)
    result, server = await run_workflow(agent, tokenizer)
    assert isinstance(result, ArenaTaskFailedError) and result.status == status
    assert agent.persisted == [None]
    assert server.store.get(agent.get_episode_metadata()["session_id"]) is not None


MODEL_FAILURES = {
    22: ({"outcome_code": AMTE}, False),
    39: ({"error": CLX + " Prompt is too long"}, False),
    41: ({"error": CLAUDE_LOG_41}, True),
}


@pytest.mark.parametrize(
    "number", [pytest.param(k, id=f"case63-as-case{k}") for k in MODEL_FAILURES]
)
async def test_case63_model_failures_train_as_zero(tokenizer, tmp_path, number):
    raw, ovf = MODEL_FAILURES[number]
    fake = arena_with("HARNESS_FAILED", raw, calls=2, overflow=ovf)
    agent = AuditedArenaAgent(fake, arena_result_dump_dir=str(tmp_path))
    result, _ = await run_workflow(agent, tokenizer)
    assert [i.reward for i in result.values()] == [0.0, 0.0]  # last set to 0, discounted back
    assert agent.persisted == [0.0]
    assert all(i.metadata["arena_status"] == "HARNESS_FAILED" for i in result.values())
    (record,) = [json.loads(line) for f in tmp_path.glob("*.jsonl") for line in f.open()]
    assert record["training_score"] == 0.0


async def test_case64_model_failure_with_a_proxy_system_error_raises(tokenizer):
    agent = AuditedArenaAgent(arena_with("HARNESS_FAILED", {"outcome_code": AMTE}, boom=True))
    result, _ = await run_workflow(agent, tokenizer)
    assert isinstance(result, ArenaTaskFailedError)


async def test_case64_model_failure_without_interactions_raises(tokenizer):
    agent = AuditedArenaAgent(arena_with("HARNESS_FAILED", {"outcome_code": AMTE}, calls=0))
    result, _ = await run_workflow(agent, tokenizer)
    assert isinstance(result, ArenaTaskFailedError)
    assert agent.persisted == [None]


async def test_case64_model_failure_with_an_empty_export(tokenizer):
    # the overflowing request is recorded (so the session counts it) but never completed
    agent = AuditedArenaAgent(
        arena_with("HARNESS_FAILED", {"error": CLAUDE_LOG_41}, calls=0, overflow=True)
    )
    result, _ = await run_workflow(agent, tokenizer)
    assert result is None
    assert agent.persisted == [None]


async def test_case64_export_error_propagates_without_persist(tokenizer):
    # a concat export of interactions recorded in hf mode is refused by the proxy
    agent = AuditedArenaAgent(arena_with("HARNESS_FAILED", {"outcome_code": AMTE}, calls=1))
    result, _ = await run_workflow(agent, tokenizer, export_style="concat")
    assert isinstance(result, ProxyError) and result.status == 400
    assert agent.persisted == []


class BranchingAgent(GenericAgent):
    """Two conversations (branches); the first is rewarded explicitly, then a model failure."""

    def __init__(self, explicit: float | None, **kwargs: Any):
        super().__init__(fail=RuntimeError("agent failed"), disposition=Z, **kwargs)
        self.explicit = explicit

    async def run(self, data, **kwargs):
        base, key = kwargs["base_url"], kwargs["api_key"]
        first = (await chat(base, key, "branch a", first="conversation a")).json()["id"]
        (await chat(base, key, "branch b", first="conversation b")).raise_for_status()
        if self.explicit is not None:
            async with httpx.AsyncClient() as http:
                (
                    await http.post(
                        f"{base}/rl/set_reward",
                        headers={"Authorization": f"Bearer {key}"},
                        json={"interaction_id": first, "reward": self.explicit},
                    )
                ).raise_for_status()
        raise self.fail


async def test_case67_concat_recovery_keeps_explicit_rewards(tokenizer):
    agent = BranchingAgent(explicit=0.5)
    result, _ = await run_workflow(
        agent, tokenizer, chat_template_type="concat", export_style="concat"
    )
    # two leaves: the explicitly rewarded branch keeps 0.5, the last interaction gets 0.0
    assert [i.reward for i in result.values()] == [0.5, 0.0]
    assert persists(agent) == [0.0]


async def test_case67_concat_recovery_requests_the_arena_episode_reward(tokenizer):
    class ArenaLike(BranchingAgent):
        get_failure_reward_for_export = ArenaStreamAgentWorkflow.get_failure_reward_for_export

    agent = ArenaLike(explicit=0.5)
    result, _ = await run_workflow(
        agent, tokenizer, chat_template_type="concat", export_style="concat"
    )
    assert [i.reward for i in result.values()] == [0.0, 0.0]  # episode_reward 0.0 on every leaf
    arena = make_agent(FakeArena())
    assert arena.get_failure_reward_for_export(dict(ROW), export_style="concat") == 0.0
    assert arena.get_failure_reward_for_export(dict(ROW), export_style="individual") is None


# --- audit and episode metrics (cases 65, 66, 68, 71) ---


def shard_records(directory) -> list[dict]:
    return [
        json.loads(line)
        for shard in sorted(directory.glob("arena_results_*.jsonl"))
        for line in shard.read_text().splitlines()
    ]


async def failed_run(agent, fake: FakeArena, status: str, raw: Any, session="sess-1"):
    fake.polls = [{"status": status, "raw": raw}]
    with pytest.raises(ArenaTaskFailedError) as caught:
        await agent.run(dict(ROW), **run_kwargs(session))
    return caught.value


async def test_case65_model_failure_is_audited_once_with_zero(tmp_path):
    fake = FakeArena()
    agent = make_agent(fake, arena_result_dump_dir=str(tmp_path))
    raw = {"outcome_code": AMTE, "error": "turn budget used up"}
    error = await failed_run(agent, fake, "HARNESS_FAILED", raw)
    disposition = agent.classify_proxy_failure(error, context_overflow=False, interaction_count=2)
    assert disposition == Z
    await agent.record_failure_disposition(dict(ROW), error, disposition)
    assert shard_records(tmp_path) == []  # written by the final-reward hook, not now
    await agent.persist_episode_result(dict(ROW), 0.0)
    await agent.persist_episode_result(dict(ROW), 0.0)
    (record,) = shard_records(tmp_path)
    assert record["training_score"] == 0.0 and record["status"] == "HARNESS_FAILED"
    assert record["raw"] == raw and record["harness_outcome_code"] == AMTE


async def test_case66_system_failure_is_audited_at_once_without_a_score(tmp_path):
    fake = FakeArena()
    agent = make_agent(fake, arena_result_dump_dir=str(tmp_path))
    error = await failed_run(agent, fake, "SETUP_FAILED", {"error": "image pull"})
    disposition = agent.classify_proxy_failure(error, context_overflow=False, interaction_count=2)
    assert disposition == S
    await agent.record_failure_disposition(dict(ROW), error, disposition)
    (record,) = shard_records(tmp_path)
    assert record["training_score"] is None and record["status"] == "SETUP_FAILED"
    assert record["harness_outcome_code"] is None
    await agent.persist_episode_result(dict(ROW), None)
    assert len(shard_records(tmp_path)) == 1


BUCKET_KEYS = [
    f"rollout/harness_error/{code}"
    for code in (
        "AGENT_MAX_TURNS_EXCEEDED",
        "AGENT_RUN_TIMEOUT",
        "AUTONOMOUS_INCOMPLETE_NO_SHIP",
        "GAMEAGENT_RUN_FAILED",
        "LLM_RESPONSE_FAILED",
        "LLM_RESPONSE_TIMEOUT",
        "OTHER",
    )
]


@pytest.mark.parametrize(
    "status, raw, success, error, bucket",
    [
        pytest.param("OK", {"passed": 1}, 1.0, 0.0, None, id="case68-OK"),
        pytest.param(
            "HARNESS_FAILED",
            {"outcome_code": "LLM_RESPONSE_FAILED"},
            0.0,
            1.0,
            "LLM_RESPONSE_FAILED",
            id="case68-bounded-code",
        ),
        pytest.param(
            "HARNESS_FAILED",
            {"outcome_code": "WEIRD_CODE_7"},
            0.0,
            1.0,
            "OTHER",
            id="case68-unbounded-code",
        ),
    ],
)
async def test_case68_episode_metrics(status, raw, success, error, bucket):
    fake = FakeArena()
    agent = make_agent(fake)
    if status == "OK":
        fake.polls = [{"status": "OK", "score": 1.0, "raw": raw}]
        await agent.run(dict(ROW), **run_kwargs())
    else:
        await failed_run(agent, fake, status, raw)
    metrics()
    agent.record_episode_metrics(dict(ROW), 0.0)
    stats = metrics()
    assert stats["rollout/harness_success"] == success
    assert stats["rollout/harness_error"] == error
    # all seven keys for every exported episode: rates over exported episodes
    assert {k: stats[k] for k in BUCKET_KEYS} == {
        k: float(k == f"rollout/harness_error/{bucket}") for k in BUCKET_KEYS
    }
    assert not any("WEIRD" in k for k in stats)


async def test_case71_episode_metadata_matches_the_audit_record(tmp_path):
    fake = FakeArena()
    agent = make_agent(fake, arena_result_dump_dir=str(tmp_path))
    error = await failed_run(agent, fake, "HARNESS_FAILED", {"outcome_code": "WEIRD_CODE_7"})
    await agent.record_failure_disposition(dict(ROW), error, "unknown_failure_reject")
    metadata = agent.get_episode_metadata()
    (record,) = shard_records(tmp_path)
    for key in ("session_id", "arena_task_id", "harness_outcome_code"):
        assert record[key] == metadata[key], key
    assert record["status"] == metadata["arena_status"] == "HARNESS_FAILED"
    assert metadata["harness_outcome_code"] == "OTHER"  # the bucket, never the unbounded code


# --- turn-count metrics (cases 69, 70) ---


def exported_episode(turn_ids: list[int] | None, reward: float | None = 1.0, **metadata):
    tensors = {} if turn_ids is None else {"turn_ids": torch.tensor([turn_ids], dtype=torch.int32)}
    interaction = ExportedInteraction("i-1", reward, tensors, dict(metadata))
    return {"i-1": interaction}


class BrokenInteraction(ExportedInteraction):
    def to_tensor_dict(self):
        raise RuntimeError("tensor buffer freed")


def test_case69_turn_metrics_worked_example():
    metrics()
    # 2 turns (padding -1 ignored); 4 turns, LLM_RESPONSE_FAILED; 3 turns, unbounded code
    record_interaction_stats(exported_episode([-1, -1, 0, 0, 1]), "rollout")
    record_interaction_stats(
        exported_episode(
            [-1, 0, 1, 2, 3],
            0.0,
            arena_status="HARNESS_FAILED",
            harness_outcome_code="LLM_RESPONSE_FAILED",
        ),
        "rollout",
    )
    record_interaction_stats(
        exported_episode(
            [0, 1, 1, 2], 0.0, arena_status="HARNESS_FAILED", harness_outcome_code="WEIRD_7"
        ),
        "rollout",
    )
    stats = metrics()
    assert stats["rollout/num_turns_count"] == 3
    # avg (2 + 4 + 3) / 3 = 3
    assert (stats["rollout/num_turns/avg"], stats["rollout/num_turns/min"]) == (3.0, 2.0)
    assert stats["rollout/num_turns/max"] == 4.0
    assert stats["rollout/num_turns_no_harness_err_count"] == 1
    assert stats["rollout/num_turns_no_harness_err/avg"] == 2.0
    assert stats["rollout/num_turns_harness_err_count"] == 2
    assert stats["rollout/num_turns_harness_err/avg"] == 3.5  # (4 + 3) / 2
    assert stats["rollout/num_turns_harness_err/LLM_RESPONSE_FAILED/avg"] == 4.0
    assert stats["rollout/num_turns_harness_err/LLM_RESPONSE_FAILED_count"] == 1
    assert stats["rollout/num_turns_harness_err/OTHER/avg"] == 3.0
    assert not any("WEIRD" in k for k in stats)
    assert stats["rollout/reward"] == pytest.approx(1 / 3)  # (1 + 0 + 0) / 3


def test_case69_masked_denominators_omit_empty_averages():
    metrics()
    record_interaction_stats(exported_episode([0], arena_status="HARNESS_FAILED"), "rollout")
    stats = metrics()
    assert stats["rollout/num_turns_no_harness_err_count"] == 0  # recorded, masked out
    assert not any(k.startswith("rollout/num_turns_no_harness_err/") for k in stats)
    assert stats["rollout/num_turns_harness_err/OTHER_count"] == 1


@pytest.mark.parametrize(
    "exported, reward_recorded, turns_recorded",
    [
        pytest.param(exported_episode([0, 1], None), False, True, id="case70-null-reward"),
        pytest.param(exported_episode(None, 1.0), True, False, id="case70-no-turn-ids"),
        pytest.param(
            {"i-1": BrokenInteraction("i-1", 1.0, {"turn_ids": torch.tensor([[0]])})},
            True,
            False,
            id="case70-tensors-raise",
        ),
        pytest.param({}, False, False, id="case70-no-interactions"),
    ],
)
def test_case70_interaction_stats(exported, reward_recorded, turns_recorded):
    metrics()
    record_interaction_stats(exported, "rollout")
    stats = metrics()
    assert ("rollout/reward" in stats) is reward_recorded
    assert ("rollout/num_turns_count" in stats) is turns_recorded
