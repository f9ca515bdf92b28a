"""Proxy sessions, keys and bad input; token fidelity of exported trajectories."""

from __future__ import annotations

import base64
import itertools

import httpx
import numpy as np
import pytest
import torch

from areal.proxy.client import deserialize_interactions
from areal.proxy.keys import derive_gateway_key, derive_session_token
from tests.unit.proxy.conftest import (
    ADMIN,
    RecordingEngine,
    ScriptedEngine,
    bearer,
    running_proxy,
    start_session,
)

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def export(url: str, session_id: str, **options) -> list[dict]:
    body = {"session_id": session_id, **options}
    response = httpx.post(
        f"{url}/export_trajectories", headers=bearer(ADMIN), json=body, timeout=30
    )
    response.raise_for_status()
    return response.json()["interactions"]


# --- token fidelity ---


def test_concat_export_is_exactly_what_the_engine_saw_and_produced(real_engine, tokenizer):
    engine = RecordingEngine(real_engine)
    with running_proxy(engine, tokenizer, chat_template_type="concat") as (url, _):
        session_id, key = start_session(url, "fidelity")
        messages = [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Question 1"},
        ]
        for turn in range(4):
            reply = httpx.post(
                f"{url}/v1/chat/completions",
                headers=bearer(key),
                timeout=60,
                json={"model": "m", "messages": messages, "max_tokens": 6, "temperature": 1.0},
            )
            reply.raise_for_status()
            messages = [
                *messages,
                reply.json()["choices"][0]["message"],
                {"role": "user", "content": f"Question {turn + 2}"},
            ]
        httpx.post(
            f"{url}/rl/set_reward", headers=bearer(key), json={"reward": 1.0}
        ).raise_for_status()
        httpx.post(f"{url}/rl/end_session", headers=bearer(key)).raise_for_status()
        (exported,) = deserialize_interactions(export(url, session_id, style="concat")).values()
    t = exported.tensors
    # one contiguous sequence: the last call's prompt is the earlier prompts and outputs,
    # then its own output; every prompt the engine received is a prefix of the next
    calls = engine.calls
    for (prompt, response), (next_prompt, _) in itertools.pairwise(calls):
        assert (
            next_prompt[: len(prompt) + len(response.output_tokens)]
            == prompt + response.output_tokens
        )
    last_prompt, last_response = calls[-1]
    assert t["input_ids"][0].tolist() == last_prompt + last_response.output_tokens
    # generated positions carry mask 1, their own log-prob and version, turn ids 0..3
    expected_mask = [0] * len(t["input_ids"][0])
    expected_logprobs = [0.0] * len(expected_mask)
    expected_turns = [-1] * len(expected_mask)
    for turn, (prompt, response) in enumerate(calls):
        for offset, logprob in enumerate(response.output_logprobs):
            expected_mask[len(prompt) + offset] = 1
            expected_logprobs[len(prompt) + offset] = logprob
            expected_turns[len(prompt) + offset] = turn
    assert t["loss_mask"][0].tolist() == expected_mask
    assert torch.allclose(t["logprobs"][0], torch.tensor(expected_logprobs))
    assert t["turn_ids"][0].tolist() == expected_turns
    assert t["versions"][0].tolist() == [0 if m else -1 for m in expected_mask]
    assert t["rewards"].tolist() == [1.0]
    assert t["attention_mask"].dtype == torch.bool and bool(t["attention_mask"].all())


def test_individual_export_and_discount(tokenizer):
    engine = ScriptedEngine(tokenizer, ["a", "b", "c"])
    with running_proxy(engine, tokenizer) as (url, _):
        session_id, key = start_session(url)
        ids = []
        for _ in range(3):
            ids.append(
                httpx.post(f"{url}/chat/completions", headers=bearer(key), json=CHAT).json()["id"]
            )
        httpx.post(
            f"{url}/rl/set_reward",
            headers=bearer(key),
            json={"reward": 1.0, "interaction_id": ids[0]},
        )
        httpx.post(
            f"{url}/rl/set_reward", headers=bearer(key), json={"reward": 2.0}
        )  # the last one
        httpx.post(f"{url}/rl/end_session", headers=bearer(key))
        exported = export(url, session_id, discount=0.5, style="individual")
    # backwards: r3 = 2; r2 = 0 + 0.5 * 2 = 1; r1 = 1 + 0.5 * 1 = 1.5
    assert [(i["id"], i["reward"]) for i in exported] == [
        (ids[0], 1.5),
        (ids[1], 1.0),
        (ids[2], 2.0),
    ]
    data = exported[0]["tensors"]["rewards"]
    assert np.frombuffer(base64.b64decode(data["data"]), dtype=np.float32).tolist() == [1.5]


# --- sessions and keys ---


def test_session_ids_capacity_and_key_binding(tokenizer):
    with running_proxy(ScriptedEngine(tokenizer), tokenizer, run_nonce="r1") as (url, _server):
        # <task id>-<sessions started so far>.<run nonce>: never the same id twice
        assert start_session(url, "17:3")[0] == "17:3-0.r1"
        assert start_session(url, "17:3")[0] == "17:3-1.r1"
        admin = bearer(ADMIN)
        no_capacity = httpx.post(f"{url}/rl/start_session", headers=admin, json={"task_id": "x"})
        assert no_capacity.status_code == 429
        httpx.post(f"{url}/grant_capacity", headers=admin)
        as_admin = httpx.post(
            f"{url}/rl/start_session", headers=admin, json={"task_id": "x", "api_key": ADMIN}
        )
        assert as_admin.status_code == 400
        _, key = start_session(url, "y", api_key="sk-chosen-by-caller")
        assert key == "sk-chosen-by-caller"
        httpx.post(f"{url}/grant_capacity", headers=admin)
        busy = httpx.post(
            f"{url}/rl/start_session", headers=admin, json={"task_id": "z", "api_key": key}
        )
        assert busy.status_code == 409
        httpx.post(f"{url}/rl/end_session", headers=bearer(key))
        # never re-bound once used, not even after its session ended: whoever holds the
        # old key would reach the new session
        again = httpx.post(
            f"{url}/rl/start_session", headers=admin, json={"task_id": "z", "api_key": key}
        )
        assert again.status_code == 409
        assert start_session(url, "z", api_key="sk-another-fresh-key")[0] == "z-3.r1"


def test_key_scope_matrix(tokenizer):
    with running_proxy(ScriptedEngine(tokenizer), tokenizer) as (url, _):
        mine_id, mine = start_session(url, "mine")
        other_id, other = start_session(url, "other")
        gateway = derive_gateway_key(ADMIN)
        good_headers = {
            "x-session-id": mine_id,
            "x-session-token": derive_session_token(ADMIN, mine_id),
        }
        wrong_token = {
            "x-session-id": mine_id,
            "x-session-token": derive_session_token(ADMIN, other_id),
        }
        credentials = {
            "none": {},
            "wrong": bearer("sk-not-a-key"),
            "admin": bearer(ADMIN),
            "session": bearer(mine),
            "other_session": bearer(other),
            "gateway_with_headers": {**bearer(gateway), **good_headers},
            "gateway_in_x_api_key": {
                "Authorization": "Bearer arena-own-key",
                "x-api-key": gateway,
                **good_headers,
            },
            "gateway_without_headers": bearer(gateway),
            "gateway_other_token": {**bearer(gateway), **wrong_token},
        }
        expected = {
            # endpoint: statuses per credential, in the order of `credentials`
            "/v1/chat/completions": [401, 401, 401, 200, 200, 200, 200, 401, 401],
            "/rl/set_reward": [401, 401, 401, 200, 200, 403, 403, 403, 403],
            "/grant_capacity": [401, 403, 200, 403, 403, 403, 403, 403, 403],
            "/rl/start_session": [401, 403, 200, 403, 403, 403, 403, 403, 403],
            "/export_trajectories": [401, 403, 404, 403, 403, 403, 403, 403, 403],
        }
        bodies = {
            "/v1/chat/completions": CHAT,
            "/rl/set_reward": {"reward": 1.0},
            "/grant_capacity": {},
            "/rl/start_session": {"task_id": "m"},
            "/export_trajectories": {"session_id": "no-such-session"},
        }
        for path, statuses in expected.items():
            for (name, headers), status in zip(credentials.items(), statuses):
                response = httpx.post(f"{url}{path}", headers=headers, json=bodies[path])
                assert response.status_code == status, (path, name, response.text)
        # the gateway request with valid headers generated inside *my* session
        end = httpx.post(f"{url}/rl/end_session", headers={**bearer(gateway), **good_headers})
        assert end.status_code == 403
        mine_end = httpx.post(f"{url}/rl/end_session", headers=bearer(mine)).json()
        assert mine_end["interaction_count"] == 3  # session key, gateway x2
        # a finished session accepts no gateway generation, and an exported one answers 410
        assert (
            httpx.post(
                f"{url}/v1/chat/completions", headers={**bearer(gateway), **good_headers}, json=CHAT
            ).status_code
            == 410
        )
        export(url, mine_id)
        assert (
            httpx.post(f"{url}/v1/chat/completions", headers=bearer(mine), json=CHAT).status_code
            == 410
        )
        assert httpx.post(f"{url}/rl/end_session", headers=bearer(mine)).status_code == 410


def test_a_session_key_cannot_touch_another_session(tokenizer):
    with running_proxy(ScriptedEngine(tokenizer), tokenizer) as (url, server):
        mine_id, mine = start_session(url, "a")
        other_id, other = start_session(url, "b")
        other_call = httpx.post(f"{url}/chat/completions", headers=bearer(other), json=CHAT).json()[
            "id"
        ]
        denied = httpx.post(
            f"{url}/rl/set_reward",
            headers=bearer(mine),
            json={"reward": 5.0, "interaction_id": other_call},
        )
        assert denied.status_code == 400  # not an interaction of *this* session
        assert server.store.get(other_id).cache[other_call].reward is None
        assert len(server.store.get(mine_id).cache) == 0


# --- bad input ---


def test_bad_requests_get_clear_statuses_and_the_server_stays_healthy(tokenizer):
    with running_proxy(ScriptedEngine(tokenizer), tokenizer, engine_max_tokens=64) as (url, server):
        session_id, key = start_session(url)
        headers = bearer(key)
        cases = [
            (
                httpx.post(
                    f"{url}/v1/chat/completions",
                    headers={**headers, "content-type": "application/json"},
                    content=b"{oops",
                ),
                400,
                "not valid JSON",
            ),
            (
                httpx.post(
                    f"{url}/v1/chat/completions",
                    headers={**headers, "content-type": "text/plain"},
                    content=b"{}",
                ),
                422,
                "application/json",
            ),
            (
                httpx.post(f"{url}/v1/chat/completions", headers=headers, json={**CHAT, "n": 2}),
                400,
                "n=1",
            ),
            (
                httpx.post(
                    f"{url}/v1/chat/completions", headers=headers, json={**CHAT, "messages": []}
                ),
                400,
                "messages",
            ),
            (
                httpx.post(
                    f"{url}/v1/chat/completions",
                    headers=headers,
                    json={**CHAT, "max_completion_tokens": 5},
                ),
                400,
                "not both",
            ),
            (
                httpx.post(
                    f"{url}/v1/messages",
                    headers=headers,
                    json={
                        "model": "c",
                        "max_tokens": 5,
                        "messages": [{"role": "robot", "content": "x"}],
                    },
                ),
                400,
                "role",
            ),
        ]
        for response, status, phrase in cases:
            assert response.status_code == status, response.text
            assert phrase in response.text
        long = {**CHAT, "messages": [{"role": "user", "content": "word " * 400}]}
        over = httpx.post(f"{url}/v1/chat/completions", headers=headers, json=long)
        assert (
            over.status_code == 400 and over.json()["detail"]["type"] == "context_length_exceeded"
        )
        anthropic_over = httpx.post(
            f"{url}/v1/messages",
            headers=headers,
            json={"model": "c", "max_tokens": 5, "messages": long["messages"]},
        )
        assert anthropic_over.status_code == 400 and anthropic_over.json()["type"] == "error"
        assert server.store.get(session_id).context_overflow
        unknown = httpx.post(
            f"{url}/export_trajectories", headers=bearer(ADMIN), json={"session_id": "nope"}
        )
        assert unknown.status_code == 404
        assert (
            httpx.post(f"{url}/export_trajectories", headers=bearer(ADMIN), json={}).status_code
            == 422
        )
        assert httpx.get(f"{url}/health").json()["status"] == "ok"
        assert (
            httpx.post(f"{url}/v1/chat/completions", headers=headers, json=CHAT).status_code == 200
        )


def test_engine_failure_is_a_500_and_marks_the_session(tokenizer):
    class Broken(ScriptedEngine):
        async def agenerate(self, req):
            raise RuntimeError("server gone")

    with running_proxy(Broken(tokenizer), tokenizer) as (url, _server):
        _session_id, key = start_session(url)
        response = httpx.post(f"{url}/chat/completions", headers=bearer(key), json=CHAT)
        assert response.status_code == 500 and "RuntimeError: server gone" in response.text
        diagnostics = httpx.post(f"{url}/rl/end_session", headers=bearer(key)).json()
        assert diagnostics["system_error"] is True


def test_default_admin_key_is_refused_off_loopback(tokenizer):
    from areal.proxy.server import ProxyServer

    with pytest.raises(ValueError, match="loopback"):
        ProxyServer(ScriptedEngine(tokenizer), tokenizer, "areal-admin-key", host="0.0.0.0")
    with pytest.raises(ValueError, match="empty"):
        ProxyServer(ScriptedEngine(tokenizer), tokenizer, "  ")
    ProxyServer(ScriptedEngine(tokenizer), tokenizer, "areal-admin-key", host="127.0.0.1")


def test_store_false_is_served_but_not_recorded(tokenizer):
    with running_proxy(ScriptedEngine(tokenizer), tokenizer) as (url, server):
        session_id, key = start_session(url)
        response = httpx.post(
            f"{url}/chat/completions", headers=bearer(key), json={**CHAT, "store": False}
        )
        assert response.status_code == 200
        assert len(server.store.get(session_id).cache) == 0
