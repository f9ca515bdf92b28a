"""Secrets planted in URLs (``user:SENTINEL@``, ``?key=SENTINEL``) reach no error, log or file.

Every place the suite parses or validates a URL is covered: the Arena client (its base URL
from the argument or ``ARENA_OPENAPI_BASE``, ``ARENA_LLM_BASE_URL``, the proxy URL a route
is registered to, sync and async), the agent (the proxy URL it registers or launches at),
the preflight CLI and library (``--base-url`` and the gateway probe), the
``econfig.arena_base_url`` field, Arena error bodies, log records and saved configs.
"""

from __future__ import annotations

import logging
import os
import stat

import httpx
import pytest

from areal.api.config.fields import FieldError
from areal.api.config.loader import save_config
from areal.utils import logging as areal_logging
from areal.utils.secrets import redact_url
from examples.swe.arena_agent import ArenaStreamAgentWorkflow
from examples.swe.arena_client import ArenaAPIError, ArenaOpenAPIClient
from examples.swe.arena_http import ArenaRequest, ArenaTransport
from examples.swe.arena_preflight import main as preflight_main
from examples.swe.arena_preflight import probe_llm_gateway, validate_streams
from examples.swe.utils import SWEEnvConfig
from tests.conftest import SECRET_SENTINEL
from tests.unit.examples.test_arena_agent_fakes import ROW, FakeArena, make_agent, run_kwargs

# Each plant hides the sentinel in a different secret part of an otherwise valid URL.
PLANTS = {
    "password": f"https://user:{SECRET_SENTINEL}@arena.test",
    "username": f"https://{SECRET_SENTINEL}@arena.test:8443/base",
    "query": f"https://arena.test/base?key={SECRET_SENTINEL}",
    "fragment": f"https://arena.test/base#{SECRET_SENTINEL}",
}


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ("ARENA_OPENAPI_BASE", "ARENA_LLM_BASE_URL", "ARENA_LLM_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("ARENA_OPENAPI_TOKEN", "tok-for-url-tests")
    # secrets registered by earlier tests (the same sentinel as a W&B key, say) would mask
    # the sentinel as <redacted> before the URL rules run: start from none
    monkeypatch.setattr(areal_logging, "_secrets", set())


def refused(call) -> str:
    with pytest.raises(ValueError) as info:
        call()
    return str(info.value)


# --- redact_url itself (hand-checked) ---


def test_redact_url_keeps_scheme_host_port_and_path():
    url = f"https://u:{SECRET_SENTINEL}@h.test:8443/p/q?key={SECRET_SENTINEL}&x=1&flag#frag"
    assert redact_url(url) == "https://***@h.test:8443/p/q?key=***&x=***&***#***"
    assert redact_url("http://h.test:80/api") == "http://h.test:80/api"
    # not a valid URL (space, bad port) and still redacted
    assert redact_url(f"https://a:{SECRET_SENTINEL}@h :99999") == "https://***@h :99999"


# --- the Arena client ---


@pytest.mark.parametrize("plant", PLANTS)
def test_client_base_url_argument_is_refused_without_its_secret(plant):
    message = refused(lambda: ArenaOpenAPIClient(base_url=PLANTS[plant]))
    assert SECRET_SENTINEL not in message
    assert "econfig.arena_base_url" in message and "Arena base URL" in message
    assert "arena.test" in message  # the harmless parts still help the reader


@pytest.mark.parametrize("plant", PLANTS)
def test_client_base_url_from_the_environment_is_refused_without_its_secret(monkeypatch, plant):
    monkeypatch.setenv("ARENA_OPENAPI_BASE", PLANTS[plant])
    message = refused(lambda: ArenaOpenAPIClient())
    assert SECRET_SENTINEL not in message and "ARENA_OPENAPI_BASE" in message


@pytest.mark.parametrize("plant", PLANTS)
def test_llm_base_url_override_is_refused_without_its_secret(monkeypatch, plant):
    monkeypatch.setenv("ARENA_LLM_BASE_URL", PLANTS[plant])
    message = refused(lambda: ArenaOpenAPIClient(base_url="https://arena.test"))
    assert SECRET_SENTINEL not in message
    assert message.startswith("ARENA_LLM_BASE_URL gives an invalid Arena LLM base URL")


@pytest.mark.parametrize("plant", ["password", "query"])
def test_route_upstream_url_is_refused_without_its_secret(plant):
    client = ArenaOpenAPIClient(
        base_url="https://arena.test", transport=httpx.MockTransport(lambda r: httpx.Response(500))
    )
    message = refused(lambda: client.register_llm_proxy("stream-areal-x", PLANTS[plant], "key"))
    assert SECRET_SENTINEL not in message and "proxy base URL" in message


def test_reprs_show_no_url_secret():
    transport = ArenaTransport(PLANTS["password"], "tok")
    assert SECRET_SENTINEL not in repr(transport)
    assert "arena.test" in repr(transport)


def test_arena_error_bodies_lose_url_secrets():
    body = f"upstream https://svc:{SECRET_SENTINEL}@internal.test/x?sig={SECRET_SENTINEL} failed"
    http = ArenaTransport(
        "https://arena.test",
        "tok",
        retries=0,
        transport=httpx.MockTransport(lambda r: httpx.Response(502, text=body)),
    )
    request = ArenaRequest("GET", "/openapi/v1/streams")
    with pytest.raises(ArenaAPIError) as info:
        http.check_status(http.send(request), request)
    assert SECRET_SENTINEL not in str(info.value)
    assert "https://***@internal.test/x?sig=***" in str(info.value)


@pytest.mark.parametrize("plant", ["password", "query"])
async def test_route_upstream_url_of_an_async_registration_is_refused_without_its_secret(plant):
    client = ArenaOpenAPIClient(
        base_url="https://arena.test",
        async_transport=httpx.MockTransport(lambda r: httpx.Response(500)),
    )
    with pytest.raises(ValueError) as info:
        await client.register_llm_proxy_async(
            model_name="stream-areal-x",
            upstream_base_url=PLANTS[plant],
            upstream_api_key="key",
            deployment_id="d",
        )
    assert SECRET_SENTINEL not in str(info.value) and "proxy base URL" in str(info.value)


# --- the agent: the proxy URL it is handed ---


def _agent(fake: FakeArena, mode: str) -> ArenaStreamAgentWorkflow:
    return make_agent(fake, arena_llm_route_mode=mode)


@pytest.mark.parametrize("plant", ["password", "query"])
async def test_agent_gateway_route_refuses_a_proxy_url_without_its_secret(plant):
    fake = FakeArena()
    with pytest.raises(ValueError) as info:
        await _agent(fake, "gateway").run(dict(ROW), **run_kwargs(base_url=PLANTS[plant]))
    assert SECRET_SENTINEL not in str(info.value) and "proxy base URL" in str(info.value)
    assert fake.ops("register", "launch") == []  # refused before anything was sent


@pytest.mark.parametrize(
    "url", [f"http://user:{SECRET_SENTINEL}@:1234/x", f"http:///x?key={SECRET_SENTINEL}"]
)
async def test_agent_direct_route_refuses_a_hostless_proxy_url_without_its_secret(url):
    fake = FakeArena()
    with pytest.raises(ValueError, match="has no host name") as info:
        await _agent(fake, "direct").run(dict(ROW), **run_kwargs(base_url=url))
    assert SECRET_SENTINEL not in str(info.value)
    assert fake.calls == []


# --- preflight ---


@pytest.mark.parametrize("plant", PLANTS)
def test_preflight_library_refuses_the_base_url_without_its_secret(tmp_path, plant):
    # The entry point submit_arena.sh calls (no CLI in between).
    streams = tmp_path / "streams.yaml"
    streams.write_text("streams:\n  - {name: a, stream_id: s-a, harness: h@1}\n")
    message = refused(lambda: validate_streams(str(streams), base_url=PLANTS[plant]))
    assert SECRET_SENTINEL not in message and "--base-url" in message


@pytest.mark.parametrize("plant", PLANTS)
def test_preflight_gateway_probe_refuses_the_base_url_without_its_secret(monkeypatch, plant):
    monkeypatch.setenv("ARENA_LLM_API_KEY", "llm-key-for-url-tests")  # no ARENA_LLM_BASE_URL
    message = refused(lambda: probe_llm_gateway(PLANTS[plant]))
    assert SECRET_SENTINEL not in message and "--base-url" in message


@pytest.mark.parametrize("plant", PLANTS)
def test_preflight_base_url_is_refused_up_front(tmp_path, capsys, plant):
    streams = tmp_path / "streams.yaml"
    streams.write_text("streams:\n  - {name: a, stream_id: s-a, harness: h@1}\n")
    code = preflight_main(["--streams-file", str(streams), "--base-url", PLANTS[plant]])
    out, err = capsys.readouterr()
    assert code == 1 and out == ""
    assert SECRET_SENTINEL not in err
    assert "--base-url gives an invalid Arena base URL" in err


@pytest.mark.parametrize("plant", PLANTS)
def test_preflight_gateway_probe_names_the_variable_not_the_secret(monkeypatch, plant):
    monkeypatch.setenv("ARENA_LLM_API_KEY", "llm-key-for-url-tests")
    monkeypatch.setenv("ARENA_LLM_BASE_URL", PLANTS[plant])
    rejecting = httpx.MockTransport(lambda r: httpx.Response(401))
    message = refused(lambda: probe_llm_gateway("https://arena.test", transport=rejecting))
    assert SECRET_SENTINEL not in message and "ARENA_LLM_BASE_URL" in message


# --- the config field, saved configs and log records ---


@pytest.mark.parametrize("plant", PLANTS)
def test_econfig_arena_base_url_is_refused_at_load_naming_the_field(plant):
    with pytest.raises(FieldError) as info:
        SWEEnvConfig(arena_base_url=PLANTS[plant])
    assert info.value.field == "arena_base_url"
    assert SECRET_SENTINEL not in str(info.value)


def test_saved_config_has_no_url_secret_and_is_private(tmp_path):
    config = {
        "econfig": {"arena_base_url": PLANTS["password"]},
        "stats_logger": {"wandb": {"wandb_base_url": PLANTS["query"]}},
        "notes": f"see {PLANTS['username']} and {PLANTS['fragment']}",
        "plain": "https://arena.test/openapi/v1",
    }
    saved = save_config(config, tmp_path / "logs" / "exp" / "trial")
    text = saved.read_text()
    assert SECRET_SENTINEL not in text
    assert "https://***@arena.test" in text and "plain: https://arena.test/openapi/v1" in text
    assert stat.S_IMODE(os.stat(saved).st_mode) == 0o600
    for created in (tmp_path / "logs", tmp_path / "logs" / "exp", saved.parent):
        assert stat.S_IMODE(os.stat(created).st_mode) & 0o077 == 0, created
    assert list(saved.parent.iterdir()) == [saved]  # no temp file left behind


def test_saved_config_replaces_an_old_world_readable_file(tmp_path):
    old = tmp_path / "config.yaml"
    old.write_text("old: 1\n")
    old.chmod(0o644)
    saved = save_config({"new": 2}, tmp_path)
    assert saved.read_text() == "new: 2\n"
    assert stat.S_IMODE(os.stat(saved).st_mode) == 0o600


def test_log_records_lose_url_secrets(tmp_path):
    path = areal_logging.setup_file_logging(tmp_path, "urls.log")
    try:
        log = areal_logging.getLogger("url-test")
        log.warning("connecting to %s", PLANTS["password"])
        log.warning("callback %s", PLANTS["query"])
        try:
            raise RuntimeError(f"cannot reach {PLANTS['username']}")
        except RuntimeError:
            log.exception("failed")
        for handler in logging.getLogger("areal").handlers:
            handler.flush()
    finally:
        areal_logging.stop_file_logging(path)
    text = path.read_text()
    assert SECRET_SENTINEL not in text
    assert "https://***@arena.test" in text and "?key=***" in text
