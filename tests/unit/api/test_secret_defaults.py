"""Secret config fields keep their values through config load, defaults included.

OmegaConf stores a string field as ``str(value)``, and a secret's ``str`` is its printed
form ``<redacted>``: a secret default that entered the schema wrapped loaded as the
public string ``<redacted>`` (the proxy admin key among them, so a proxy off loopback
answered admin calls for anyone sending ``<redacted>``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from areal.api.cli_args import GRPOConfig, load_expr_config
from areal.api.config.fields import ConfigError, ConfigNode, FieldError, cfg_field
from areal.api.config.inference import AgentConfig
from areal.utils.secrets import REDACTED, SecretStr, reveal
from examples.swe.utils import SWEPPOConfig
from tests.conftest import SWE_DIR

REPO = Path(__file__).resolve().parents[3]
TOY_DIR = REPO / "examples" / "toy"


@dataclass
class _Vault(ConfigNode):
    token: str = cfg_field("vault-default-token", help="A secret with a default.", secret=True)
    label: str = cfg_field("plain", help="Not a secret.")


@dataclass
class _Experiment(ConfigNode):
    vault: _Vault = cfg_field(factory=_Vault, help="A nested node built by a factory.")
    vaults: list[_Vault] = cfg_field(factory=list, help="Nodes built from list items.")
    top_token: str = cfg_field("top-default", help="A top-level secret.", secret=True)


def _load(tmp_path: Path, text: str, *overrides: str) -> _Experiment:
    path = tmp_path / "experiment.yaml"
    path.write_text(text)
    cfg, _ = load_expr_config(["--config", str(path), *overrides], _Experiment)
    return cfg


def test_secret_defaults_keep_their_values_through_load(tmp_path):
    cfg = _load(tmp_path, "vaults:\n  - label: a\n  - token: given\n")
    assert isinstance(cfg.vault.token, SecretStr)
    assert reveal(cfg.vault.token) == "vault-default-token"
    assert reveal(cfg.top_token) == "top-default"
    assert [reveal(v.token) for v in cfg.vaults] == ["vault-default-token", "given"]
    assert str(cfg.vault.token) == REDACTED  # still printed redacted


def test_set_secrets_are_kept_as_given(tmp_path):
    cfg = _load(tmp_path, "vault:\n  token: from-yaml\n", "top_token=from-argv")
    assert reveal(cfg.vault.token) == "from-yaml"
    assert reveal(cfg.top_token) == "from-argv"


def test_the_printed_form_is_refused_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"vault\.token.*printed form"):
        _load(tmp_path, "vault:\n  token: '<redacted>'\n")
    with pytest.raises(FieldError, match="admin_api_key"):
        AgentConfig(admin_api_key=" <redacted> ")


def _secret_values(node, path=""):
    """``(dotted path, plain value)`` of every secret field in a config tree."""
    import dataclasses

    if not dataclasses.is_dataclass(node):
        return
    for f in dataclasses.fields(node):
        dotted = f"{path}.{f.name}" if path else f.name
        value = getattr(node, f.name)
        if f.metadata.get("secret"):
            yield dotted, value
        elif dataclasses.is_dataclass(value):
            yield from _secret_values(value, dotted)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                yield from _secret_values(item, f"{dotted}[{i}]")


SWE_PROFILES = sorted(p.name for p in SWE_DIR.glob("*.yaml"))


def _load_profile(config_file: Path, config_cls: type):
    cfg, _ = load_expr_config(["--config", str(config_file)], config_cls)
    return cfg


@pytest.mark.parametrize("profile", SWE_PROFILES)
def test_no_secret_of_a_shipped_profile_loads_as_its_printed_form(profile, profile_env):
    assert "arena_grpo.yaml" in SWE_PROFILES and "arena_local.yaml" in SWE_PROFILES
    cfg = _load_profile(SWE_DIR / profile, SWEPPOConfig)
    found = dict(_secret_values(cfg))
    assert "rollout.agent.admin_api_key" in found and "rollout.admin_api_key" in found
    for path, value in found.items():
        assert value is None or reveal(value).strip() != REDACTED, path


def test_no_secret_of_the_toy_config_loads_as_its_printed_form(tmp_path, monkeypatch):
    monkeypatch.setenv("AREAL_FILEROOT", str(tmp_path))
    monkeypatch.delenv("SWE_RL_ADMIN_API_KEY", raising=False)
    cfg = _load_profile(TOY_DIR / "toy_grpo.yaml", GRPOConfig)
    found = dict(_secret_values(cfg))
    for path, value in found.items():
        assert value is None or reveal(value).strip() != REDACTED, path
    # left unset: empty here, and the trainer generates a random one per run
    assert reveal(cfg.rollout.agent.admin_api_key) == ""
