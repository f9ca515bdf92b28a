"""``econfig.dataset_source``: 'arena' is the default and the only source the loader accepts."""

from __future__ import annotations

import pytest

from areal.api.cli_args import ConfigError, load_expr_config
from areal.api.config.fields import FieldError
from examples.swe.utils import SWEEnvConfig, SWEPPOConfig
from tests.conftest import SWE_DIR


def test_the_default_source_is_arena():
    assert SWEEnvConfig().dataset_source == "arena"


def test_jsonl_is_refused_when_the_config_loads(profile_env):
    with pytest.raises(ConfigError) as caught:
        load_expr_config(
            ["--config", str(SWE_DIR / "arena_grpo.yaml"), "econfig.dataset_source=jsonl"],
            SWEPPOConfig,
        )
    message = str(caught.value)
    assert message.startswith("econfig.dataset_source: 'jsonl' is not supported")
    assert "examples.swe.agent" in message  # why: the agent it selects is not shipped
    assert "the supported value is 'arena'" in message


@pytest.mark.parametrize("source", ["jsonl", "parquet", ""])
def test_any_other_source_names_the_field_and_arena(source):
    with pytest.raises(FieldError) as caught:
        SWEEnvConfig(dataset_source=source)
    assert caught.value.field == "dataset_source"
    assert f"{source!r} is not supported" in caught.value.message
    assert "'arena'" in caught.value.message
