"""Secret redaction of configs and the SecretStr type."""

from __future__ import annotations

import copy
import json
import pickle

import yaml

from areal.api.cli_args import AgentConfig
from areal.utils.config_utils import is_sensitive_key, redact_sensitive_config
from areal.utils.secrets import SecretStr, reveal
from tests.conftest import SECRET_SENTINEL


def test_sensitive_key_rules():
    sensitive = [
        "authorization",
        "Password",
        "SECRET",
        "token",
        "api_key",
        "wandb_api_key",
        "ARENA_LLM_API_KEY",
        "ssh_private_key",
        "db_password",
        "client_secret",
        "ARENA_OPENAPI_TOKEN",
        "aws_credential",
        "arena_streams_yaml_b64",
    ]
    plain = [
        "max_tokens",
        "tokenizer_path",
        "skip_tokenizer_init",
        "max_new_tokens",
        "tokens",
        "secretary",
        "password_hint",
        "credentials_file",
        3,
        None,
    ]
    assert all(is_sensitive_key(k) for k in sensitive)
    assert not any(is_sensitive_key(k) for k in plain)


def test_redacts_nested_values_and_keeps_empty_ones():
    config = {
        "rollout": {"agent": {"admin_api_key": SECRET_SENTINEL, "mode": "inline"}},
        "stats_logger": {"wandb": {"wandb_api_key": "", "project": None}},
        "envs": [{"GITHUB_TOKEN": SECRET_SENTINEL}, ("x", {"password": 123})],
        "secret": {"nested": "whole value replaced"},
        "max_tokens": 32767,
    }
    out = redact_sensitive_config(config)
    assert out["rollout"]["agent"] == {"admin_api_key": "<redacted>", "mode": "inline"}
    assert out["stats_logger"]["wandb"] == {"wandb_api_key": "", "project": None}
    assert out["envs"][0] == {"GITHUB_TOKEN": "<redacted>"}
    assert out["envs"][1] == ("x", {"password": "<redacted>"})
    assert out["secret"] == "<redacted>"
    assert out["max_tokens"] == 32767
    assert config["rollout"]["agent"]["admin_api_key"] == SECRET_SENTINEL  # input untouched


def test_redacts_secret_strings_under_any_key_and_dataclasses():
    out = redact_sensitive_config(
        {
            "innocent": SecretStr(SECRET_SENTINEL),
            "agent": AgentConfig(admin_api_key=SECRET_SENTINEL),
        }
    )
    assert out["innocent"] == "<redacted>"
    assert out["agent"]["admin_api_key"] == "<redacted>"
    assert SECRET_SENTINEL not in json.dumps(out)


def test_secret_str_printed_forms():
    s = SecretStr(SECRET_SENTINEL)
    percent = "%s" % (s,)  # noqa: UP031 - the printf path is what logging uses
    for shown in (str(s), repr(s), f"{s}", percent, f"{s:>30}", str([s]), str({"k": s})):
        assert SECRET_SENTINEL not in shown
    assert "<redacted>" in str(s)
    assert s == SECRET_SENTINEL and s.reveal() == SECRET_SENTINEL
    assert type(s.reveal()) is str
    assert reveal(s) == SECRET_SENTINEL and reveal("plain") == "plain" and reveal(None) == ""
    assert "Bearer " + s == f"Bearer {SECRET_SENTINEL}"  # concatenation sees the value
    assert str(SecretStr("")) == ""


def test_secret_str_survives_copies_and_dumps_redacted():
    s = SecretStr(SECRET_SENTINEL)
    assert copy.deepcopy(s).reveal() == SECRET_SENTINEL
    assert pickle.loads(pickle.dumps(s)).reveal() == SECRET_SENTINEL
    assert SECRET_SENTINEL not in yaml.safe_dump({"k": s})
    assert SECRET_SENTINEL not in yaml.dump({"k": s})
