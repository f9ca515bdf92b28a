"""The proxy client's retries: which failures are retried, how long it waits, what it logs."""

from __future__ import annotations

import logging

import httpx
import pytest

from areal.proxy.client import OpenAIProxyClient, ProxyError

BASE = "http://proxy.test"


class ScriptedProxy:
    """Answers each POST with the next scripted status (or raises a connect error)."""

    def __init__(self, script: list[int | str]):
        self.script = list(script)
        self.paths: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        step = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        if step == "connect":
            raise httpx.ConnectError("refused", request=request)
        if step == 200:
            return httpx.Response(200, json={"session_id": "s-1", "api_key": "k-1"})
        return httpx.Response(step, json={"error": {"message": f"status {step}"}})


def make_client(proxy: ScriptedProxy, sleeps: list[float]) -> OpenAIProxyClient:
    async def record(seconds: float) -> None:
        sleeps.append(seconds)

    http = httpx.AsyncClient(transport=httpx.MockTransport(proxy))
    return OpenAIProxyClient(BASE, "admin-key", http, sleep=record)


async def test_start_session_retries_transient_failures_until_admitted(caplog):
    proxy = ScriptedProxy([503, "connect", 429, 502, 504, 408, 503, 200])
    sleeps: list[float] = []
    with caplog.at_level(logging.INFO):
        session = await make_client(proxy, sleeps).start_session("task-1")
    assert session == ("s-1", "k-1")
    assert len(proxy.paths) == 8
    # 0.5 doubling, capped at 5: 0.5, 1, 2, 4, 8 -> 5, 16 -> 5, 32 -> 5
    assert sleeps == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0]
    messages = [r.getMessage() for r in caplog.records if "retrying" in r.getMessage()]
    assert messages[:2] == [
        "/rl/start_session failed (ProxyError); retrying in 0.5s",
        "/rl/start_session failed (ConnectError); retrying in 1.0s",
    ]
    assert len(messages) == 7


async def test_end_session_gives_up_after_ten_attempts_with_the_last_error():
    proxy = ScriptedProxy([503])
    sleeps: list[float] = []
    with pytest.raises(ProxyError) as raised:
        await make_client(proxy, sleeps).end_session("session-key")
    assert raised.value.status == 503
    assert str(raised.value) == "proxy answered HTTP 503: status 503"
    assert len(proxy.paths) == 10
    assert sleeps == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0, 5.0, 5.0, 5.0]  # 9 waits between 10 tries


async def test_end_session_transport_error_on_the_last_attempt_is_raised_as_is():
    proxy = ScriptedProxy(["connect"])
    with pytest.raises(httpx.ConnectError):
        await make_client(proxy, []).end_session("session-key")
    assert len(proxy.paths) == 10


@pytest.mark.parametrize("status", [400, 401, 404, 409, 500])
async def test_a_non_transient_status_is_not_retried(status):
    proxy = ScriptedProxy([status, 200])
    sleeps: list[float] = []
    with pytest.raises(ProxyError) as raised:
        await make_client(proxy, sleeps).start_session("task-1")
    assert raised.value.status == status
    assert len(proxy.paths) == 1 and sleeps == []
