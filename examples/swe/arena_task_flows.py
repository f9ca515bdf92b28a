"""Launching one Arena task and polling it until it is terminal, as transport flows.

The launch (``POST /streams/{stream_id}/launch_one_task``) may answer with a terminal
result at once; otherwise its ``task_id`` is polled (``GET /tasks/{task_id}/result``)
right away, then every ``poll_interval`` seconds. A failed status raises
:class:`ArenaTaskFailedError` carrying the parsed result; a successful one must carry a
top-level ``score``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from areal.utils.secrets import reveal
from examples.swe.arena_http import ArenaRequest, ArenaTransport, Flow, Pause, encode_path
from examples.swe.arena_results import (
    FAILED_TASK_STATUSES,
    LAUNCH_PLACEHOLDER_TASK_ID,
    SUCCESS_TASK_STATUSES,
    ArenaAPIError,
    ArenaTaskFailedError,
    ArenaTaskResult,
    _parse_task_result,
)

__all__ = ["MANAGED_TASK_ENVS", "launch_body", "launch_task_flow", "poll_task_flow"]

API = "/openapi/v1"
MANAGED_TASK_ENVS = ("MODEL_NAME", "BASE_URL", "API_KEY")
"""Task environment variables always set to the route the Harness must call."""


def launch_body(
    data_id: str,
    model_name: str,
    proxy_base_url: str,
    proxy_api_key: str,
    *,
    session_id: str = "",
    harness: str = "",
    task_envs: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """The JSON body of a launch; ``task_envs`` must map non-empty strings to strings."""
    envs = dict(task_envs or {})
    if not all(isinstance(k, str) and k and isinstance(v, str) for k, v in envs.items()):
        raise ValueError("Arena task_envs keys and values must be strings (non-empty keys)")
    api_key = reveal(proxy_api_key).strip()
    envs.update(MODEL_NAME=model_name, BASE_URL=proxy_base_url, API_KEY=api_key)
    body: dict[str, Any] = {
        "data_id": data_id,
        "model_name": model_name,
        "base_url": proxy_base_url,
        "api_key": api_key,
        "envs": envs,
    }
    if session_id:
        body["session_id"] = session_id
    if harness:
        body["harness"] = harness
    return body


def _check_success(result: ArenaTaskResult) -> None:
    if result.score is None:
        raise ArenaAPIError(
            f"Arena task {result.task_id} is {result.status} without a top-level 'score'"
        )


def launch_task_flow(
    http: ArenaTransport,
    stream_id: str,
    body: Mapping[str, Any],
    poll_interval: float,
    on_launch_success: Callable[[str | None], Any] | None = None,
) -> Flow[ArenaTaskResult]:
    """Launch ``body`` on ``stream_id`` and follow the task to its terminal result.

    ``on_launch_success(task_id)`` runs once Arena accepted the task (``None`` when a
    terminal answer came without a task id).
    """
    request = ArenaRequest(
        "POST", f"{API}/streams/{encode_path(stream_id)}/launch_one_task", json=dict(body)
    )
    payload = http.read_json((yield request), request)
    result = _parse_task_result(payload, fallback_task_id=LAUNCH_PLACEHOLDER_TASK_ID)
    if result.status in FAILED_TASK_STATUSES:
        raise ArenaTaskFailedError(result.task_id, result.status, payload, result)
    has_task_id = result.task_id != LAUNCH_PLACEHOLDER_TASK_ID
    if result.status in SUCCESS_TASK_STATUSES:
        _check_success(result)
        if on_launch_success is not None:
            on_launch_success(result.task_id if has_task_id else None)
        return result
    if not has_task_id:
        raise ArenaAPIError(f"Arena launch returned status {result.status} but no task_id to poll")
    if on_launch_success is not None:
        on_launch_success(result.task_id)
    return (yield from poll_task_flow(http, result.task_id, poll_interval))


def poll_task_flow(
    http: ArenaTransport, task_id: str, poll_interval: float
) -> Flow[ArenaTaskResult]:
    """Poll right after the launch, then every ``poll_interval`` seconds until terminal."""
    request = ArenaRequest("GET", f"{API}/tasks/{encode_path(task_id)}/result")
    while True:
        payload = http.read_json((yield request), request)
        result = _parse_task_result(payload, fallback_task_id=task_id)
        if result.task_id != task_id:
            raise ArenaAPIError(
                f"Arena poll of task {task_id} returned an unexpected task_id {result.task_id!r}"
            )
        if result.status in FAILED_TASK_STATUSES:
            raise ArenaTaskFailedError(task_id, result.status, payload, result)
        if result.status in SUCCESS_TASK_STATUSES:
            _check_success(result)
            return result
        yield Pause(poll_interval)
