"""Preflight: check every configured Arena Stream before any GPU is requested.

``python -m examples.swe.arena_preflight --streams-file streams.yaml --base-url URL``

For each Stream, in this order: the Stream exists and is ``ACTIVE``; its grader
(``default_reward_ref``) has not drifted from ``expected_reward_ref``; its Harness
``key@version`` exists and is ``PUBLISHED``; its dataset has at least one row; and its
recent tasks of exactly this Harness and grader are healthy (enough terminal tasks, failure
rate below the bound). It only reads; it never launches a task. Streams are checked one
after another in configuration order; the first failure ends the run, and no request is
sent for the Streams after it.

On success the JSON report goes to stdout (exit 0) and a summary table to stderr. Usage
errors exit 2; any failed check, bad config or HTTP error prints one error line and exits
1 with nothing on stdout. Task env values are never printed, only their names.

Tools and tests written for the reference Arena suite import or patch :func:`_arena_json`
(every Arena call, named by a command-style argument list), :func:`_recent_health`, and this
module's ``time`` and ``httpx``; so each of these is looked up when a call runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import fields
from typing import Any

import httpx

from areal.utils.secrets import SecretStr, redact_url, refuse_printed_form
from areal.utils.table import render_table
from examples.swe.arena_client import ArenaAPIError, infer_llm_protocol_from_harness
from examples.swe.arena_config import load_arena_stream_configs
from examples.swe.arena_http import ArenaRequest, ArenaTransport, check_http_url, encode_path
from examples.swe.arena_results import FAILED_TASK_STATUSES, SUCCESS_TASK_STATUSES
from examples.swe.arena_types import ArenaStreamConfig

__all__ = ["PreflightHTTP", "check_stream", "main", "normalize_api_base", "validate_streams"]

API_SUFFIX = "/openapi/v1"
DEFAULT_HTTP_TIMEOUT = 180.0
DEFAULT_CONNECT_TIMEOUT = 10.0
ARENA_COMMANDS = (
    "stream get ID",
    "harness version-get KEY VERSION",
    "stream dataset ID --limit N",
    "stream tasks ID --limit N --offset M",
)


def normalize_api_base(base_url: str) -> str:
    """``https://x``, ``https://x/`` and ``https://x/openapi/v1/`` all give ``https://x/openapi/v1``."""
    base = base_url.strip().rstrip("/")
    return base if base.endswith(API_SUFFIX) else base + API_SUFFIX


def _api_base(base_url: str) -> str:
    """The checked, normalized API root (errors show the URL without its secret parts)."""
    check_http_url(base_url.strip().rstrip("/"), "Arena base URL", "--base-url")
    return normalize_api_base(base_url)


def _float_env(name: str, default: float) -> float:
    raw = os.environ.get(name, "")
    if not raw.strip():
        return default
    try:
        return float(raw)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {raw!r}") from None


def _openapi_token() -> SecretStr:
    token = os.environ.get("ARENA_OPENAPI_TOKEN", "").strip()
    if not token:
        raise ArenaAPIError("ARENA_OPENAPI_TOKEN is required for Arena preflight")
    try:
        refuse_printed_form(token, "ARENA_OPENAPI_TOKEN")
    except ValueError as e:
        raise ArenaAPIError(str(e)) from None
    return SecretStr(token)


# --- one Arena call ---


def _are_counts(*words: str) -> bool:
    return all(word.isascii() and word.isdigit() for word in words)


def _arena_request(args: Sequence[Any]) -> ArenaRequest:
    """The OpenAPI request named by a command-style argument list (one of ``ARENA_COMMANDS``).

    The dataset probe is a POST with no body; its window travels in the query, from offset 0.
    """
    words = [str(a) for a in args]
    if "" not in words:  # an empty path segment would name another endpoint
        match words:
            case ["stream", "get", sid]:
                return ArenaRequest("GET", f"/streams/{encode_path(sid)}")
            case ["harness", "version-get", key, version]:
                path = f"/harnesses/{encode_path(key)}/versions/{encode_path(version)}"
                return ArenaRequest("GET", path)
            case ["stream", "dataset", sid, "--limit", n] if _are_counts(n):
                query = {"limit": n, "offset": "0"}
                return ArenaRequest("POST", f"/streams/{encode_path(sid)}/dataset", query)
            case ["stream", "tasks", sid, "--limit", n, "--offset", m] if _are_counts(n, m):
                query = {"limit": n, "offset": m}
                return ArenaRequest("GET", f"/streams/{encode_path(sid)}/tasks", query)
    raise ValueError(
        f"unknown Arena command {words!r}; expected one of: {'; '.join(ARENA_COMMANDS)} "
        "(non-empty names, N and M non-negative integers)"
    )


def _arena_json(
    base_url: str, args: Sequence[Any], *, retries: int, client: httpx.Client | None = None
) -> Any:
    """One Arena OpenAPI call named by a command-style argument list; its parsed JSON.

    ``args`` is one of ``ARENA_COMMANDS`` (:func:`_arena_request` maps each to its endpoint
    under ``base_url``'s ``/openapi/v1``); the bearer token is ``ARENA_OPENAPI_TOKEN``. A
    transport error, HTTP 429, 5xx or the gateway's transient 403 is retried up to
    ``retries`` more times, sleeping 1, 2, 4, 8, 10... s through this module's ``time.sleep``;
    the last error is raised as ``ArenaAPIError`` naming the method, path and status, never
    the token. Without ``client``, a proxy-free ``httpx.Client`` is opened for this one call
    (timeouts from ``ARENA_PREFLIGHT_*_TIMEOUT``) and closed after it.
    """
    request = _arena_request(args)
    http = ArenaTransport(
        _api_base(base_url),
        _openapi_token(),
        retries=retries,
        trust_env=False,
        sleep=time.sleep,  # this module's `time`, looked up per call: tools patch it
        error_label="Arena preflight",
    )
    own_client = client is None
    if client is None:
        timeout = httpx.Timeout(
            _float_env("ARENA_PREFLIGHT_HTTP_TIMEOUT", DEFAULT_HTTP_TIMEOUT),
            connect=_float_env("ARENA_PREFLIGHT_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT),
        )
        client = httpx.Client(timeout=timeout, trust_env=False, follow_redirects=False)
    try:
        return http.read_json(http.send(request, client), request)
    finally:
        if own_client:
            client.close()


class PreflightHTTP:
    """One preflight run's way to Arena: its API root, retries and one shared, proxy-free
    ``httpx.Client`` that every :func:`_arena_json` call reuses.

    ``transport`` lets tests run without a network.
    """

    def __init__(
        self,
        base_url: str,
        *,
        retries: int = 3,
        timeout: float = DEFAULT_HTTP_TIMEOUT,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        transport: httpx.BaseTransport | None = None,
    ):
        self.api_base = _api_base(base_url)
        self.retries = retries
        self.client = httpx.Client(
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            trust_env=False,
            transport=transport,
            follow_redirects=False,
        )

    def data(self, args: Sequence[Any]) -> Any:
        """Run one command (see ``ARENA_COMMANDS``); the response's ``data`` member, or the
        whole response when it has none. The response must be a JSON object."""
        payload = _arena_json(self.api_base, args, retries=self.retries, client=self.client)
        if not isinstance(payload, dict):
            request = _arena_request(args)
            raise ArenaAPIError(
                f"Arena preflight {request.method} {request.path} did not return an object"
            )
        return payload.get("data", payload)

    def close(self) -> None:
        self.client.close()


# --- one Stream ---


def _stream_object(data: Any, stream_id: str) -> dict:
    if isinstance(data, dict) and isinstance(data.get("stream"), dict):
        return data["stream"]
    if isinstance(data, dict):
        return data
    raise ArenaAPIError(f"Arena response for Stream {stream_id!r} is missing the Stream object")


def _actual_reward_ref(stream: dict, stream_id: str) -> tuple[str, str]:
    ref = stream.get("default_reward_ref")
    if ref is None:
        return "", ""
    if not isinstance(ref, dict):
        raise ArenaAPIError(f"Stream {stream_id!r} default_reward_ref must be an object")
    key, version = ref.get("key"), ref.get("version")
    if not (isinstance(key, str) and key and isinstance(version, str) and version):
        raise ArenaAPIError(f"Stream {stream_id!r} default_reward_ref is incomplete: {ref!r}")
    return key, version


def _resolve_harness(configured: str, stream: dict, stream_id: str) -> tuple[str, str]:
    harness = configured
    ref = stream.get("default_harness_ref")
    if not harness and isinstance(ref, dict):
        key, version = ref.get("key"), ref.get("version")
        if isinstance(key, str) and key and isinstance(version, str) and version:
            harness = f"{key}@{version}"
    key, sep, version = harness.partition("@")
    if not sep or not key or not version:
        raise ArenaAPIError(
            f"Stream {stream_id!r} requires Harness key@version (configure 'harness' or give "
            f"the Stream a default Harness); got {harness!r}"
        )
    return key, version


def _ref_of(task: Mapping[str, Any], field: str) -> tuple[Any, Any] | None:
    ref = task.get(field)
    return (ref.get("key"), ref.get("version")) if isinstance(ref, Mapping) else None


def _ref_pair(ref: Any, what: str) -> tuple[Any, Any]:
    """``(key, version)`` of a ``key@version`` string, a ``{"key", "version"}`` mapping, an
    object with ``key`` and ``version`` attributes or a pair; ``("", "")`` for ``None``."""
    if ref is None:
        return "", ""
    if isinstance(ref, str):
        key, _, version = ref.partition("@")
        return key, version
    if isinstance(ref, Mapping):
        return ref.get("key"), ref.get("version")
    if isinstance(ref, (tuple, list)) and len(ref) == 2:
        return ref[0], ref[1]
    if hasattr(ref, "key") and hasattr(ref, "version"):
        return ref.key, ref.version
    raise TypeError(f"{what} must be key@version, a key/version mapping or a pair, got {ref!r}")


def _recent_health(rows: Iterable[Any], *, harness: Any, reward_ref: Any) -> tuple[int, int]:
    """``(terminal, failures)`` over task rows of exactly this Harness and grader.

    ``harness`` and ``reward_ref`` are each a ``key@version`` string, a ``{"key", "version"}``
    mapping, an object with ``key`` and ``version`` (``ArenaRewardRefConfig``) or a
    ``(key, version)`` pair. A row counts only when its task's ``harness_ref`` equals
    ``harness`` and its ``reward_ref`` equals ``reward_ref``; rows lacking either are ignored.
    A ``reward_ref`` without a key (a Stream with no grader) leaves reward provenance
    unchecked. A row is its task or wraps it as ``{"task": {...}}``; non-object rows are
    ignored. Status ``DONE``/``OK`` is terminal, one of ``FAILED_TASK_STATUSES`` terminal and a
    failure, and any other (a task still running) is not counted.
    """
    harness_pair = _ref_pair(harness, "harness")
    reward_pair = _ref_pair(reward_ref, "reward_ref")
    terminal = failures = 0
    for row in rows:
        task = row.get("task", row) if isinstance(row, Mapping) else None
        if not isinstance(task, Mapping) or _ref_of(task, "harness_ref") != harness_pair:
            continue
        if reward_pair[0] and _ref_of(task, "reward_ref") != reward_pair:
            continue
        status = str(task.get("status") or "").upper()
        if status in SUCCESS_TASK_STATUSES:
            terminal += 1
        elif status in FAILED_TASK_STATUSES:
            terminal += 1
            failures += 1
    return terminal, failures


def recent_health(data: Any, harness: Any, reward_ref: Any) -> tuple[int, int, float]:
    """``(terminal, failures, failure_rate)`` of a task-list payload: ``data`` when it is a
    list, else its ``items`` (see :func:`_recent_health` for what counts)."""
    rows = data.get("items", []) if isinstance(data, Mapping) else data
    rows = rows if isinstance(rows, list) else []
    terminal, failures = _recent_health(rows, harness=harness, reward_ref=reward_ref)
    return terminal, failures, (failures / terminal if terminal else 0.0)


def check_stream(
    http: PreflightHTTP,
    stream: ArenaStreamConfig,
    *,
    recent_tasks: int = 100,
    min_terminal_tasks: int = 1,
    max_failure_rate: float = 0.8,
    allow_unhealthy: bool = False,
) -> dict[str, Any]:
    """Run every check on one Stream; returns its report record (raises on failure)."""
    sid = stream.stream_id
    live = _stream_object(http.data(["stream", "get", sid]), sid)
    if live.get("stream_id") != sid:
        raise ArenaAPIError(
            f"Arena returned Stream {live.get('stream_id')!r} when asked for {sid!r}"
        )
    if live.get("status") != "ACTIVE":
        raise ArenaAPIError(f"Stream {sid!r} is not ACTIVE (status {live.get('status')!r})")

    actual_ref = _actual_reward_ref(live, sid)
    pinned = stream.expected_reward_ref
    if pinned.key and (pinned.key, pinned.version) != actual_ref:
        raise ArenaAPIError(
            f"Stream {sid!r} reward_ref drifted: expected {pinned.key}@{pinned.version}, "
            f"got {actual_ref[0]}@{actual_ref[1]}"
        )

    harness = _resolve_harness(stream.harness, live, sid)
    harness_info = http.data(["harness", "version-get", *harness])
    status = harness_info.get("status") if isinstance(harness_info, Mapping) else None
    if status != "PUBLISHED":
        raise ArenaAPIError(
            f"Harness {harness[0]}@{harness[1]} is not PUBLISHED (status {status!r})"
        )

    dataset = http.data(["stream", "dataset", sid, "--limit", 1])
    total = dataset.get("total") if isinstance(dataset, Mapping) else None
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ArenaAPIError(
            f"Stream {sid!r} must have at least one row in its dataset (total {total!r})"
        )

    tasks = http.data(["stream", "tasks", sid, "--limit", recent_tasks, "--offset", 0])
    terminal, failures, rate = recent_health(tasks, harness, actual_ref)
    unhealthy = terminal < min_terminal_tasks or rate >= max_failure_rate
    if unhealthy and not allow_unhealthy:
        raise ArenaAPIError(
            f"Stream {sid!r} failed health check over its last {recent_tasks} tasks: "
            f"terminal={terminal}, failures={failures}, failure_rate={rate:.4f} (need >= "
            f"{min_terminal_tasks} terminal and a failure rate < {max_failure_rate}; use "
            "--min-terminal-tasks 0 for a new Stream, or --allow-unhealthy)"
        )

    harness_text = f"{harness[0]}@{harness[1]}"
    record: dict[str, Any] = {f.name: getattr(stream, f.name) for f in fields(stream)}
    record.update(
        harness=harness_text,
        llm_protocol=stream.llm_protocol or infer_llm_protocol_from_harness(harness_text),
        task_envs=sorted(stream.task_envs),
        expected_reward_ref={"key": actual_ref[0], "version": actual_ref[1]},
        dataset_total=total,
        recent_terminal_tasks=terminal,
        recent_failures=failures,
        recent_failure_rate=rate,
        unhealthy_override=unhealthy,
    )
    return record


# --- all Streams ---


def validate_streams(
    streams_file: str = "",
    *,
    streams_yaml_b64: str = "",
    base_url: str,
    default_harness: str = "",
    retries: int = 3,
    recent_tasks: int = 100,
    min_terminal_tasks: int = 1,
    max_failure_rate: float = 0.8,
    allow_unhealthy: bool = False,
    http: PreflightHTTP | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> list[dict[str, Any]]:
    """Check every Stream of a streams document, in configured order; their report records.

    Streams are checked one at a time; the first failure is raised at once (``ValueError``
    for bad parameters or config, ``ArenaAPIError`` for failed checks and HTTP errors) and
    nothing is sent for the Streams after it.
    """
    timeout = _float_env("ARENA_PREFLIGHT_HTTP_TIMEOUT", DEFAULT_HTTP_TIMEOUT)
    connect_timeout = _float_env("ARENA_PREFLIGHT_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT)
    if isinstance(retries, bool) or retries < 0:
        raise ValueError(f"retries must be >= 0, got {retries}")
    if recent_tasks < 1:
        raise ValueError(f"recent_tasks must be >= 1, got {recent_tasks}")
    if min_terminal_tasks < 0:
        raise ValueError(f"min_terminal_tasks must be >= 0, got {min_terminal_tasks}")
    if not 0.0 <= max_failure_rate <= 1.0:
        raise ValueError(f"max_failure_rate must be within [0, 1], got {max_failure_rate}")

    streams = load_arena_stream_configs(
        {
            "arena_streams_file": streams_file,
            "arena_streams_yaml_b64": streams_yaml_b64,
            "arena_harness": default_harness,
        }
    )
    own_http = http is None
    if http is None:
        http = PreflightHTTP(
            base_url, retries=retries, timeout=timeout, connect_timeout=connect_timeout
        )
    checks = {
        "recent_tasks": recent_tasks,
        "min_terminal_tasks": min_terminal_tasks,
        "max_failure_rate": max_failure_rate,
        "allow_unhealthy": allow_unhealthy,
    }
    results = []
    try:
        for stream in streams:
            results.append(check_stream(http, stream, **checks))
            if on_progress is not None:
                on_progress(len(results), len(streams))
        return results
    finally:
        if own_http:
            http.close()


# --- the optional LLM gateway probe ---


def probe_llm_gateway(base_url: str, *, transport: httpx.BaseTransport | None = None) -> str:
    """Check ``ARENA_LLM_API_KEY`` against the gateway's model listing (no task launched).

    Returns ``"accepted"`` or ``"inconclusive (HTTP n)"``; raises when the key is missing
    or rejected (401/403), or the gateway cannot be reached.
    """
    key = os.environ.get("ARENA_LLM_API_KEY", "").strip()
    if not key:
        raise ValueError("ARENA_LLM_API_KEY is required for --probe-llm-gateway")
    override = os.environ.get("ARENA_LLM_BASE_URL", "").strip().rstrip("/")
    if override:
        gateway = check_http_url(override, "Arena LLM base URL", "ARENA_LLM_BASE_URL")
    else:
        check_http_url(base_url.strip().rstrip("/"), "Arena base URL", "--base-url")
        gateway = normalize_api_base(base_url)[: -len(API_SUFFIX)] + "/api"
    http = ArenaTransport(
        gateway,
        SecretStr(key),
        retries=1,
        timeout=30.0,
        trust_env=False,
        transport=transport,
        error_label="Arena LLM gateway",
    )
    try:
        request = ArenaRequest("GET", "/v1/models")
        response = http.send(request)
        if response.status_code in (401, 403):
            raise ArenaAPIError(
                f"the Arena LLM gateway {redact_url(gateway)} rejected ARENA_LLM_API_KEY "
                f"(HTTP {response.status_code}); tasks would fail at their first model call"
            )
        if 200 <= response.status_code < 300:
            return "accepted"
        return f"inconclusive (HTTP {response.status_code})"
    finally:
        http.close()


# --- command line ---


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m examples.swe.arena_preflight",
        description="Check that every configured Arena Stream can be trained on (read only).",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--streams-file", metavar="PATH", help="YAML/JSON streams document")
    source.add_argument(
        "--streams-env-b64",
        metavar="NAME",
        help="name of an environment variable holding the base64 streams document",
    )
    parser.add_argument("--base-url", required=True, help="Arena OpenAPI base URL")
    parser.add_argument(
        "--default-harness",
        default="",
        metavar="KEY@VER",
        help="Harness for Streams that name none",
    )
    parser.add_argument("--retries", type=int, default=3, help="retries per request (default 3)")
    parser.add_argument(
        "--recent-tasks",
        type=int,
        default=100,
        help="recent tasks examined for health (default 100)",
    )
    parser.add_argument(
        "--min-terminal-tasks",
        type=int,
        default=1,
        help="terminal tasks required in the window (default 1; 0 for new Streams)",
    )
    parser.add_argument(
        "--max-failure-rate",
        type=float,
        default=0.8,
        help="a Stream whose failure rate is >= this is unhealthy (default 0.8)",
    )
    parser.add_argument(
        "--allow-unhealthy", action="store_true", help="report unhealthy Streams instead of failing"
    )
    parser.add_argument(
        "--probe-llm-gateway",
        action="store_true",
        help="also check ARENA_LLM_API_KEY against the Arena LLM gateway",
    )
    parser.add_argument("--quiet", action="store_true", help="no summary table on stderr")
    return parser


def _summary(records: list[dict[str, Any]], gateway: str | None) -> str:
    rows = [
        [
            r["name"],
            r["stream_id"],
            r["harness"],
            r["llm_protocol"],
            r["dataset_total"],
            r["recent_terminal_tasks"],
            r["recent_failures"],
            f"{r['recent_failure_rate']:.2%}",
            "UNHEALTHY (allowed)" if r["unhealthy_override"] else "ok",
        ]
        for r in records
    ]
    columns = [
        "stream",
        "id",
        "harness",
        "protocol",
        "rows",
        "terminal",
        "failed",
        "fail rate",
        "verdict",
    ]
    text = render_table(f"Arena preflight: {len(records)} Stream(s) passed", columns, rows)
    if gateway is not None:
        text += f"\nLLM gateway key: {gateway}"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    encoded = ""
    if args.streams_env_b64 is not None:
        encoded = os.environ.get(args.streams_env_b64, "")
        if not encoded.strip():
            parser.error(f"--streams-env-b64: environment variable {args.streams_env_b64} is empty")

    def progress(done: int, total: int) -> None:
        print(f"\rpreflight: {done}/{total} Streams checked", end="", file=sys.stderr, flush=True)
        if done == total:
            print(file=sys.stderr)

    try:
        records = validate_streams(
            args.streams_file or "",
            streams_yaml_b64=encoded,
            base_url=args.base_url,
            default_harness=args.default_harness,
            retries=args.retries,
            recent_tasks=args.recent_tasks,
            min_terminal_tasks=args.min_terminal_tasks,
            max_failure_rate=args.max_failure_rate,
            allow_unhealthy=args.allow_unhealthy,
            on_progress=progress if sys.stderr.isatty() else None,
        )
        gateway = probe_llm_gateway(args.base_url) if args.probe_llm_gateway else None
    except (ArenaAPIError, ValueError, OSError) as e:
        print(f"arena_preflight: error: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(json.dumps({"streams": records}, indent=2, ensure_ascii=False) + "\n")
    sys.stdout.flush()
    if not args.quiet:
        print(_summary(records, gateway), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
