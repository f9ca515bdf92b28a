"""Proxy hardening: session ids never repeat, ended sessions refuse work, exports time out.

Session ids used to be ``<task_id>-<k>`` with the smallest free ``k``: after an export
the next session of the same task got the same id, so the exported session's key (still
mapped to that id) and its gateway token (derived from the id) reached the new session,
and a resumed run issued the same ids again. An export of a session nobody ended waited
forever.
"""

from __future__ import annotations

import re

import httpx
import pytest

from areal.proxy.keys import derive_gateway_key, derive_session_token
from tests.unit.proxy.conftest import ADMIN, ScriptedEngine, bearer, running_proxy, start_session

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
AGENT_SESSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}")  # the Arena agent's rule


def gateway_headers(session_id: str) -> dict[str, str]:
    return {
        **bearer(derive_gateway_key(ADMIN)),
        "x-session-id": session_id,
        "x-session-token": derive_session_token(ADMIN, session_id),
    }


def post(url: str, path: str, headers: dict, json: dict | None = None) -> httpx.Response:
    return httpx.post(f"{url}{path}", headers=headers, json=json or {}, timeout=30)


def export(url: str, session_id: str, **options) -> httpx.Response:
    return post(url, "/export_trajectories", bearer(ADMIN), {"session_id": session_id, **options})


@pytest.fixture
def proxy(tokenizer):
    with running_proxy(ScriptedEngine(tokenizer), tokenizer) as (url, server):
        yield url, server


def test_an_ended_session_refuses_generation_and_rewards_with_410(proxy):
    url, server = proxy
    session_id, key = start_session(url, "17:3")
    assert post(url, "/v1/chat/completions", bearer(key), CHAT).status_code == 200
    assert post(url, "/rl/end_session", bearer(key)).status_code == 200
    for path, body in (
        ("/v1/chat/completions", CHAT),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 4}),
        ("/v1/messages", {"max_tokens": 4, "messages": CHAT["messages"]}),
        ("/rl/set_reward", {"reward": 1.0}),
    ):
        response = post(url, path, bearer(key), body)
        assert response.status_code == 410 and "ended" in response.text, (path, response.text)
    gateway = post(url, "/v1/chat/completions", gateway_headers(session_id), CHAT)
    assert gateway.status_code == 410
    # ending again answers the same (a retried end), and nothing was recorded after the end
    again = post(url, "/rl/end_session", bearer(key))
    assert again.status_code == 200 and again.json()["interaction_count"] == 1
    assert server.store.get(session_id).cache.last().reward is None
    assert len(export(url, session_id).json()["interactions"]) == 1


def test_an_exported_key_gets_410_after_a_same_task_id_restart(proxy):
    url, server = proxy
    old_id, old_key = start_session(url, "17:3")
    assert post(url, "/v1/chat/completions", bearer(old_key), CHAT).status_code == 200
    post(url, "/rl/end_session", bearer(old_key)).raise_for_status()
    export(url, old_id).raise_for_status()

    new_id, new_key = start_session(url, "17:3")  # the same task id starts again
    assert new_id != old_id and new_key != old_key
    assert AGENT_SESSION_ID.fullmatch(new_id) and new_id.startswith("17:3-")
    for path, body in (
        ("/v1/chat/completions", CHAT),
        ("/rl/set_reward", {"reward": 1.0}),
        ("/rl/end_session", {}),
    ):
        assert post(url, path, bearer(old_key), body).status_code == 410, path
    assert post(url, "/v1/chat/completions", gateway_headers(old_id), CHAT).status_code == 410
    new = server.store.get(new_id)
    assert len(new.cache) == 0 and not new.finished  # nothing reached the new session
    assert post(url, "/v1/chat/completions", bearer(new_key), CHAT).status_code == 200
    assert post(url, "/v1/chat/completions", gateway_headers(new_id), CHAT).status_code == 200


def test_a_resumed_run_never_reissues_an_id_or_accepts_an_old_token(tokenizer):
    task_ids = [f"{task}:{sample}" for task in range(8) for sample in range(6)]  # 48 sessions
    with running_proxy(ScriptedEngine(tokenizer), tokenizer) as (url, _):
        first_run = [start_session(url, task_id)[0] for task_id in task_ids]
    with running_proxy(ScriptedEngine(tokenizer), tokenizer) as (url, _):  # the resumed run
        second_run = [start_session(url, task_id)[0] for task_id in task_ids]
        assert not set(first_run) & set(second_run)
        for old_id in first_run[:3]:  # a harness of the first run still holding its token
            stale = post(url, "/v1/chat/completions", gateway_headers(old_id), CHAT)
            assert stale.status_code == 401
    assert len(set(first_run)) == len(first_run)


def test_a_given_run_nonce_ends_every_session_id(tokenizer):
    with running_proxy(ScriptedEngine(tokenizer), tokenizer, run_nonce="resume2") as (url, _):
        assert start_session(url, "5")[0] == "5-0.resume2"
        assert start_session(url, "5")[0] == "5-1.resume2"
    from areal.proxy.server import ProxyServer

    with pytest.raises(ValueError, match="nonce"):
        ProxyServer(ScriptedEngine(tokenizer), tokenizer, ADMIN, run_nonce="has space")


def test_an_export_of_a_never_ended_session_times_out_with_a_clear_error(tokenizer):
    with running_proxy(ScriptedEngine(tokenizer), tokenizer, export_timeout=0.5) as (url, server):
        session_id, key = start_session(url)
        post(url, "/v1/chat/completions", bearer(key), CHAT).raise_for_status()
        response = httpx.post(
            f"{url}/export_trajectories",
            headers=bearer(ADMIN),
            json={"session_id": session_id},
            timeout=10,
        )
        assert response.status_code == 409
        message = response.json()["error"]["message"]
        assert "not ended within 0.5 s" in message and "--export-timeout" in message
        # nothing was lost: the session can still be ended and exported
        assert server.store.get(session_id) is not None
        post(url, "/rl/end_session", bearer(key)).raise_for_status()
        assert len(export(url, session_id).json()["interactions"]) == 1


def test_a_zero_reward_decided_after_the_end_travels_with_the_export(proxy):
    url, _ = proxy
    session_id, key = start_session(url)
    post(url, "/v1/chat/completions", bearer(key), CHAT).raise_for_status()
    post(url, "/rl/set_reward", bearer(key), {"reward": 1.0}).raise_for_status()
    post(url, "/rl/end_session", bearer(key)).raise_for_status()
    (exported,) = export(url, session_id, last_reward=0.0).json()["interactions"]
    assert exported["reward"] == 0.0


def test_start_session_takes_only_a_fresh_key(proxy):
    """A caller-chosen session key must be fresh: an exported (or merely ended) session's
    key, the gateway key or a secret's printed form would hand the new session to whoever
    holds that string (the gateway key is derived from the admin key and shared by every
    proxy of the run; an old session key is still in some harness's environment)."""
    url, _ = proxy
    admin = bearer(ADMIN)

    def start(key: str) -> httpx.Response:
        post(url, "/grant_capacity", admin)
        return post(url, "/rl/start_session", admin, {"task_id": "t", "api_key": key})

    exported_id, exported_key = start_session(url, "t", api_key="sk-caller-chosen-1")
    assert post(url, "/rl/end_session", bearer(exported_key)).status_code == 200
    assert export(url, exported_id).status_code == 200
    _, ended_key = start_session(url, "t", api_key="sk-caller-chosen-2")
    assert post(url, "/rl/end_session", bearer(ended_key)).status_code == 200

    refusals = {
        "exported session's key": (exported_key, 409),
        "ended session's key": (ended_key, 409),
        "gateway key": (derive_gateway_key(ADMIN), 400),
        "admin key": (ADMIN, 400),
        "printed form": ("<redacted>", 400),
    }
    for what, (key, status) in refusals.items():
        response = start(key)
        assert response.status_code == status, (what, response.text)
    # the refused keys reach nothing new: the exported one is gone, the ended one ended
    assert post(url, "/v1/chat/completions", bearer(exported_key), CHAT).status_code == 410
    assert post(url, "/v1/chat/completions", bearer(ended_key), CHAT).status_code == 410
    fresh = start("sk-caller-chosen-3")
    assert fresh.status_code == 200 and fresh.json()["api_key"] == "sk-caller-chosen-3"
