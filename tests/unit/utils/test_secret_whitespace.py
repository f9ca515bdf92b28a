"""Keys are stripped of surrounding whitespace before use and before redaction.

A key read from a file or an environment variable often ends in a newline. Kept, it breaks
the ``Authorization`` header and escapes masking: the registered value ``key\\n`` does not
match the bare ``key`` that an error message quotes.
"""

from __future__ import annotations

import httpx

from areal.api.cli_args import AgentConfig
from areal.utils import logging as areal_logging
from areal.utils.secrets import SecretStr
from examples.swe.arena_client import ArenaOpenAPIClient, resolve_arena_credentials
from tests.conftest import SECRET_SENTINEL


def test_secret_strings_drop_surrounding_whitespace():
    assert SecretStr(f" {SECRET_SENTINEL}\r\n").reveal() == SECRET_SENTINEL
    assert SecretStr(SecretStr("abc\n")).reveal() == "abc"  # not its printed form
    assert AgentConfig(admin_api_key="hunter2-admin\n").admin_api_key.reveal() == "hunter2-admin"


def test_a_registered_key_with_a_newline_is_masked_bare(tmp_path):
    areal_logging.register_secret(f"nl-{SECRET_SENTINEL}\n")
    path = areal_logging.setup_file_logging(tmp_path, "keys.log")
    try:
        areal_logging.getLogger("key-test").warning("header Bearer nl-%s rejected", SECRET_SENTINEL)
    finally:
        areal_logging.stop_file_logging(path)
    text = path.read_text()
    assert SECRET_SENTINEL not in text and "Bearer <redacted> rejected" in text


def test_arena_token_and_llm_key_are_sent_stripped(monkeypatch):
    monkeypatch.delenv("ARENA_LLM_BASE_URL", raising=False)
    monkeypatch.setenv("ARENA_OPENAPI_TOKEN", "env-token\n")
    assert resolve_arena_credentials("https://arena.test") == ("https://arena.test", "env-token")
    seen: list[str] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers["authorization"])
        return httpx.Response(200, json={"items": []})

    client = ArenaOpenAPIClient(
        base_url="https://arena.test",
        api_token="arg-token \n",
        llm_api_key="\tllm-key\n",
        transport=httpx.MockTransport(answer),
    )
    assert client.list_streams() == []
    assert seen == ["Bearer arg-token"]
    assert client.llm_gateway_api_key.reveal() == "llm-key"
