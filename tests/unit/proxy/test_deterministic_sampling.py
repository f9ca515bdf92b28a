"""``rollout.deterministic_sampling``: the proxy seeds requests that carry no seed.

The seed of a session's k-th request (k counted from 0 on arrival) is the first 4 bytes,
big-endian, of SHA-256("<task id>:<k>"), masked to 31 bits, as the reference seeds them. For task
``task-7``: SHA-256("task-7:0") starts f0 54 0a 3d -> 0x70540a3d = 1884555837, and
SHA-256("task-7:1") starts 20 3b d2 7c -> 540791420.
"""

from __future__ import annotations

import httpx
import pytest

from areal.api.cli_args import InferenceEngineConfig
from tests.unit.proxy.conftest import ScriptedEngine, bearer, running_proxy, start_session

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
        "temperature": 1.0}  # fmt: skip


def seeds_seen(tokenizer, deterministic: bool, bodies: list[dict]) -> list[int | None]:
    engine = ScriptedEngine(tokenizer)
    with running_proxy(engine, tokenizer, deterministic=deterministic) as (url, _):
        _, key = start_session(url, "task-7")
        for body in bodies:
            reply = httpx.post(
                f"{url}/v1/chat/completions", headers=bearer(key), json=body, timeout=30
            )
            reply.raise_for_status()
    return [req.gconfig.seed for req in engine.requests]


def test_requests_without_a_seed_get_the_task_and_turn_seed(tokenizer):
    assert seeds_seen(tokenizer, True, [CHAT, CHAT]) == [1884555837, 540791420]


def test_a_request_seed_is_kept_and_still_counts_as_a_turn(tokenizer):
    # the explicit seed wins; the next request is still the session's second (index 1)
    assert seeds_seen(tokenizer, True, [{**CHAT, "seed": 5}, CHAT]) == [5, 540791420]


def test_without_deterministic_sampling_no_seed_is_added(tokenizer):
    assert seeds_seen(tokenizer, False, [CHAT, CHAT]) == [None, None]


@pytest.mark.parametrize("deterministic", [False, True])
def test_the_rollout_setting_reaches_the_proxy_command(deterministic, monkeypatch):
    """``RemoteSGLangEngine.launch_proxy`` passes ``--deterministic-sampling`` exactly when
    ``rollout.deterministic_sampling`` is on, and the proxy's parser maps it back."""
    from areal.engine import RemoteSGLangEngine
    from areal.proxy import cli

    commands = []

    class LaunchStoppedError(Exception):
        pass

    def fake_popen(cmd, *args, **kwargs):
        commands.append(cmd)
        raise LaunchStoppedError

    config = InferenceEngineConfig(backend="sglang:d1", deterministic_sampling=deterministic)
    config.agent.admin_api_key = "admin-key-for-tests-3f9"
    engine = RemoteSGLangEngine(config)
    engine.addresses = ["127.0.0.1:1"]
    monkeypatch.setattr("subprocess.Popen", fake_popen)
    with pytest.raises(LaunchStoppedError):
        engine.launch_proxy(tokenizer_path="/nonexistent-tokenizer")
    (cmd,) = commands
    assert ("--deterministic-sampling" in cmd) is deterministic
    args = cli._parser().parse_args(cmd[cmd.index("areal.proxy.server") + 1 :])
    assert args.deterministic_sampling is deterministic
