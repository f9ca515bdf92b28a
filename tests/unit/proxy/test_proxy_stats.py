"""Metrics recorded inside the proxy process reach the rollout worker's ``export_stats``.

The proxy counts concat children whose prompt does not extend their parent's tokens
(docs/design.md#verified-concat-tokenization) and requests sampled off ``actor.temperature``
(docs/design.md#sampling-parameters-recorded-and-checked); ``POST /rl/stats``
(admin) hands them over in ``stats_tracker``'s mergeable form.
"""

from __future__ import annotations

import httpx
import pytest

from areal.api.cli_args import InferenceEngineConfig
from areal.api.io_struct import LocalInfServerInfo
from areal.engine.sglang_remote import RemoteSGLangEngine, combine_mergeable
from areal.utils import stats_tracker
from tests.unit.proxy.conftest import ADMIN, ScriptedEngine, bearer, running_proxy, start_session

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ls",
            "description": "list files",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


def chat(url: str, key: str, messages: list[dict], **extra) -> dict:
    body = {"model": "m", "messages": messages, "max_tokens": 4, "temperature": 1.0, **extra}
    response = httpx.post(f"{url}/chat/completions", headers=bearer(key), json=body, timeout=30)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]


def proxy_stats(url: str) -> dict[str, float]:
    response = httpx.post(f"{url}/rl/stats", headers=bearer(ADMIN), timeout=30)
    response.raise_for_status()
    return response.json()["stats"]


@pytest.fixture(autouse=True)
def _fresh_trackers():
    stats_tracker.export_all()  # the proxy runs in this process here
    yield
    stats_tracker.export_all()


def test_concat_mismatch_and_temperature_mismatch_are_counted(tokenizer, areal_logs):
    engine = ScriptedEngine(tokenizer, ["first answer", "second answer", "third"])
    options = {"chat_template_type": "concat", "expected_temperature": 1.0}
    with running_proxy(engine, tokenizer, **options) as (url, _):
        _, key = start_session(url)
        user = {"role": "user", "content": "hello"}
        reply = chat(url, key, [user], tools=TOOLS)
        # the tools block (with its EOS) is gone from the re-rendered conversation, so the
        # child's prompt cannot be aligned with its parent's tokens
        second = chat(url, key, [user, reply])
        chat(url, key, [user, reply, second, {"role": "user", "content": "more"}])
        chat(url, key, [{"role": "user", "content": "cold"}], temperature=0.5)
        chat(url, key, [{"role": "user", "content": "colder"}], temperature=0.2)
        stats = proxy_stats(url)
        # the second child aligned with its (aligned-alone) parent: 1 of 2 mismatched
        assert stats["proxy/concat_prefix_mismatch"] == 1.0
        assert stats["proxy/concat_prefix_mismatch__sum"] == 1.0
        assert stats["proxy/sampling_temperature_mismatch"] == 2.0  # of 5 requests
        warnings = [r for r in areal_logs.records if "actor.temperature" in r.getMessage()]
        assert len(warnings) == 1  # once per run
        # an export hands the counts over once
        again = proxy_stats(url)
        assert again.get("proxy/concat_prefix_mismatch", 0.0) == 0.0
        assert "proxy/sampling_temperature_mismatch" not in again


def test_stats_need_the_admin_key(tokenizer):
    with running_proxy(ScriptedEngine(tokenizer), tokenizer) as (url, _):
        _, key = start_session(url)
        assert httpx.post(f"{url}/rl/stats").status_code == 401
        assert httpx.post(f"{url}/rl/stats", headers=bearer(key)).status_code == 403


def test_export_stats_of_a_rollout_worker_include_its_proxies(tokenizer):
    engine = ScriptedEngine(tokenizer)
    with running_proxy(engine, tokenizer, expected_temperature=0.7) as (url, _):
        _, key = start_session(url)
        chat(url, key, [{"role": "user", "content": "hi"}])
        config = InferenceEngineConfig(backend="hf:d1")
        config.agent.admin_api_key = ADMIN
        worker = RemoteSGLangEngine(config)
        host, port = url.removeprefix("http://").split(":")
        worker.local_proxies = [LocalInfServerInfo(host, int(port), process=None)]
        stats = worker.export_stats()
    assert stats["proxy/sampling_temperature_mismatch"] == 1.0
    merged = stats_tracker.merge_exports([stats, stats])  # the controller, two workers
    assert merged["proxy/sampling_temperature_mismatch"] == 2.0


def test_combined_exports_stay_mergeable():
    a = {"r": 1.0, "r__count": 1.0, "n": 2.0, "n__sum": 1.0, "lo": 3.0, "lo__min": 1.0}
    b = {"r": 4.0, "r__count": 3.0, "n": 5.0, "n__sum": 1.0, "lo": -1.0, "lo__min": 1.0}
    combined = combine_mergeable([a, b])
    # r: (1*1 + 4*3) / 4 = 3.25 with weight 4; n: 2 + 5; lo: min(3, -1)
    assert combined == {
        "r": 3.25,
        "r__count": 4.0,
        "n": 7.0,
        "n__sum": 1.0,
        "lo": -1.0,
        "lo__min": 1.0,
    }
    c = {"r": 0.0, "r__count": 4.0}
    # merging the combined export with another keeps the weights: (3.25*4 + 0*4) / 8
    assert stats_tracker.merge_exports([combined, c])["r"] == pytest.approx(1.625)
