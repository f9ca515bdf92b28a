"""Config fields that load but that nothing reads warn once, naming the field."""

from __future__ import annotations

import pytest

from areal.api.cli_args import PPOConfig, load_expr_config
from areal.api.config import loader
from tests.unit.api.test_cli_args import conf_dir  # noqa: F401 - a fixture


@pytest.fixture(autouse=True)
def _fresh_warnings(monkeypatch):
    monkeypatch.setattr(loader, "_warned_unused", set())


def _warnings_naming(logs, key: str) -> list[str]:
    return [r.getMessage() for r in logs.records if f"'{key}'" in r.getMessage()]


def test_an_unused_field_set_to_a_non_default_warns_exactly_once(conf_dir, areal_logs):  # noqa: F811
    argv = ["--config", str(conf_dir / "base.yaml"), "actor.optimizer_dtype=bfloat16"]
    load_expr_config(argv, PPOConfig)
    load_expr_config(argv, PPOConfig)  # the same run loading it again says nothing new
    messages = _warnings_naming(areal_logs, "actor.optimizer_dtype")
    assert len(messages) == 1, messages
    assert "never reads it" in messages[0] and "'float32'" in messages[0]


def test_defaults_and_sections_are_judged_by_their_values(conf_dir, areal_logs):  # noqa: F811
    base = ["--config", str(conf_dir / "base.yaml")]
    cfg, _ = load_expr_config([*base, "actor.optimizer_dtype=float32"], PPOConfig)
    assert loader.unused_fields_set(cfg) == []  # set, but to its default
    cfg, _ = load_expr_config(
        [*base, "actor.fsdp.offload_params=true", "rollout.workers_ready_timeout=5"], PPOConfig
    )
    assert sorted(path for path, _ in loader.unused_fields_set(cfg)) == [
        "actor.fsdp.offload_params",
        "rollout.workers_ready_timeout",
    ]


def test_every_listed_field_exists():
    import dataclasses
    import importlib

    classes = {}
    for name in ("experiment", "inference", "train", "ppo"):
        module = importlib.import_module(f"areal.api.config.{name}")
        for attr in vars(module).values():
            if isinstance(attr, type) and dataclasses.is_dataclass(attr):
                classes[attr.__name__] = attr
    for cls_name, names in loader.UNUSED_FIELDS.items():
        fields = {f.name for f in dataclasses.fields(classes[cls_name])}
        assert set(names) <= fields, (cls_name, set(names) - fields)
