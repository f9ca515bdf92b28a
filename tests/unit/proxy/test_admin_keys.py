"""The proxy admin key: a run that sets none gets a random one; public keys are refused.

The reference documents ``areal-admin-key`` as the default admin key, so anyone can send
it; and ``<redacted>`` is what any secret looks like in a saved config or a log. Neither
may ever let a caller manage a proxy's sessions.
"""

from __future__ import annotations

import pytest

from areal.api.cli_args import GRPOConfig
from areal.api.config.inference import AgentConfig, InferenceEngineConfig
from areal.proxy.keys import DEFAULT_ADMIN_API_KEY, ensure_run_admin_keys, validate_admin_key
from areal.proxy.server import ProxyServer
from areal.utils import logging
from areal.utils.secrets import REDACTED, SecretStr, reveal
from tests.unit.proxy.conftest import ScriptedEngine

OUTWARD = "0.0.0.0"  # a wildcard bind serves the node's outward address


@pytest.mark.parametrize("unset", ["", DEFAULT_ADMIN_API_KEY, f"  {DEFAULT_ADMIN_API_KEY}\n"])
def test_an_unset_or_public_default_admin_key_becomes_a_random_per_run_key(unset):
    config = GRPOConfig(rollout=InferenceEngineConfig(backend="hf:d1"))
    config.rollout.agent.admin_api_key = SecretStr(unset)
    config.rollout.admin_api_key = SecretStr(unset)
    filled = ensure_run_admin_keys(config)
    assert filled == ["rollout.agent.admin_api_key", "rollout.admin_api_key"]
    key = config.rollout.agent.admin_api_key
    assert isinstance(key, SecretStr) and len(reveal(key)) >= 40
    assert reveal(key) not in ("", DEFAULT_ADMIN_API_KEY, REDACTED)
    assert reveal(key) != reveal(config.rollout.admin_api_key)  # each its own
    assert logging.mask_secrets(f"key={reveal(key)}") == f"key={REDACTED}"  # registered
    # a second run's key is another one
    other = GRPOConfig(rollout=InferenceEngineConfig(backend="hf:d1"))
    ensure_run_admin_keys(other)
    assert reveal(other.rollout.agent.admin_api_key) != reveal(key)


def test_a_key_the_user_set_is_used_as_given():
    config = GRPOConfig(rollout=InferenceEngineConfig(backend="hf:d1"))
    config.rollout.agent = AgentConfig(admin_api_key="my-own-admin-key-0c1d")
    filled = ensure_run_admin_keys(config)
    assert filled == ["rollout.admin_api_key"]
    assert reveal(config.rollout.agent.admin_api_key) == "my-own-admin-key-0c1d"
    assert ensure_run_admin_keys(config) == []  # idempotent


def test_the_printed_form_is_refused_as_an_admin_key_on_any_host(tokenizer):
    for host in ("127.0.0.1", OUTWARD):
        with pytest.raises(ValueError, match="printed form"):
            validate_admin_key(REDACTED, host)
        with pytest.raises(ValueError, match="printed form"):
            ProxyServer(ScriptedEngine(tokenizer), tokenizer, SecretStr(REDACTED), host=host)
    with pytest.raises(ValueError, match="only be used on loopback"):
        validate_admin_key(DEFAULT_ADMIN_API_KEY, OUTWARD)
