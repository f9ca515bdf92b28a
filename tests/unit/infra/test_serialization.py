"""RPC value encoding: round trips, JSON safety, the class allowlist, no pickle."""

from __future__ import annotations

import ast
import enum
import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from areal.api.cli_args import BaseExperimentConfig, SchedulingSpec, WandBConfig
from areal.api.io_struct import ParamSpec, WeightUpdateMeta
from areal.infra.rpc import serialization
from areal.infra.rpc.serialization import (
    TYPE_KEY,
    SerializationError,
    deserialize_value,
    json_dumps,
    json_loads,
    serialize_value,
)
from areal.utils.secrets import SecretStr
from tests.unit.infra.fake_engines import Point


class Color(enum.Enum):
    RED = "red"
    BLUE = 2


def round_trip(value, **kwargs):
    # through real JSON text, strictly (no NaN literals)
    text = json.dumps(serialize_value(value, **kwargs), allow_nan=False)
    return deserialize_value(json.loads(text))


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        3,
        -(2**80),
        2.5,
        "text",
        [1, "a", None],
        {"a": [1, 2], "b": {"c": None}},
        (1, (2, 3)),
        {1: "int key", (2, 3): "tuple key"},
        {TYPE_KEY: "looks like an envelope"},
        {1, 2, 3},
        frozenset({"x"}),
        b"\x00\xffbytes",
        Path("/tmp/some/file"),
    ],
)
def test_plain_values_round_trip(value):
    out = round_trip(value)
    assert out == value
    assert type(out) is type(value)


def test_non_finite_floats():
    out = round_trip([float("nan"), float("inf"), float("-inf")])
    assert np.isnan(out[0]) and out[1] == float("inf") and out[2] == float("-inf")


@pytest.mark.parametrize(
    "tensor",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.tensor([[1.5, -2.25]], dtype=torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.tensor(7, dtype=torch.int64),  # 0-dim
        torch.empty(0, 5, dtype=torch.float16),
        torch.arange(10, dtype=torch.int32)[::2],  # non-contiguous
    ],
)
def test_tensor_round_trip(tensor):
    out = round_trip(tensor)
    assert out.dtype == tensor.dtype and out.shape == tensor.shape
    assert torch.equal(out, tensor)
    out.zero_()  # decoded tensors are writable


def test_tensor_is_detached_and_on_cpu():
    weight = torch.ones(2, 2, requires_grad=True)
    out = round_trip(weight * 3)
    assert not out.requires_grad
    assert out.device.type == "cpu"
    assert torch.equal(out, torch.full((2, 2), 3.0))


def test_numpy_and_dtypes():
    arr = np.arange(6, dtype=np.float64).reshape(2, 3)
    out = round_trip({"arr": arr, "scalar": np.int16(-3), "dtype": torch.bfloat16})
    np.testing.assert_array_equal(out["arr"], arr)
    assert out["arr"].dtype == np.float64
    out["arr"][0, 0] = 1.0  # writable copy
    assert out["scalar"] == -3 and out["scalar"].dtype == np.int16
    assert out["dtype"] is torch.bfloat16


def test_object_arrays_are_refused():
    with pytest.raises(SerializationError, match="dtype object"):
        serialize_value(np.array([object()], dtype=object))


def test_dataclasses_round_trip():
    meta = WeightUpdateMeta(type="disk", path="/ckpt/v3", version=3)
    specs = [ParamSpec(name="w", shape=(4, 8), dtype="bfloat16")]
    out = round_trip({"meta": meta, "specs": specs, "point": Point(1, 2.5, ["a"])})
    assert out["meta"] == meta
    assert out["specs"] == specs and out["specs"][0].shape == (4, 8)
    assert out["point"] == Point(1, 2.5, ["a"])


def test_config_tree_round_trips():
    config = BaseExperimentConfig(experiment_name="exp", trial_name="t0", seed=7)
    out = round_trip(config)
    assert isinstance(out, BaseExperimentConfig)
    assert out == config
    assert round_trip(SchedulingSpec(gpu=1, env_vars={"A": "1"})).env_vars == {"A": "1"}


def test_enums_round_trip():
    assert round_trip([Color.RED, Color.BLUE]) == [Color.RED, Color.BLUE]


def test_secret_stays_secret():
    out = round_trip({"key": SecretStr("s3cr3t-value")})
    assert isinstance(out["key"], SecretStr)
    assert out["key"].reveal() == "s3cr3t-value"
    assert "s3cr3t" not in repr(out)


def test_redacted_secrets_do_not_travel():
    config = WandBConfig(wandb_api_key="wandb-secret-123")
    encoded = json.dumps(serialize_value(config, reveal_secrets=False))
    assert "wandb-secret-123" not in encoded
    out = deserialize_value(json.loads(encoded))
    assert isinstance(out.wandb_api_key, SecretStr) and out.wandb_api_key == ""


@dataclass
class Foreign:
    a: int


def test_sender_refuses_classes_outside_the_allowlist(monkeypatch):
    monkeypatch.setattr(Foreign, "__module__", "thirdparty.models")
    with pytest.raises(SerializationError, match=r"thirdparty\.models\.Foreign"):
        serialize_value({"x": [Foreign(1)]})


@pytest.mark.parametrize(
    ("module", "qualname"),
    [("os", "system"), ("subprocess", "Popen"), ("builtins", "eval"), ("arealx.mod", "Cls")],
)
def test_receiver_refuses_classes_outside_the_allowlist(module, qualname):
    envelope = {TYPE_KEY: "dataclass", "module": module, "qualname": qualname, "fields": {}}
    with pytest.raises(SerializationError, match="cannot travel over RPC"):
        deserialize_value({"payload": envelope})


def test_receiver_refuses_non_dataclasses_inside_the_allowlist():
    envelope = {
        TYPE_KEY: "dataclass",
        "module": "areal.utils.network",
        "qualname": "find_free_port",
        "fields": {},
    }
    with pytest.raises(SerializationError, match="not a dataclass"):
        deserialize_value(envelope)


def test_local_classes_are_refused():
    @dataclass
    class Local:
        a: int

    with pytest.raises(SerializationError, match="inside a function"):
        serialize_value(Local(1))


def test_unsupported_objects_name_their_path():
    with pytest.raises(SerializationError, match=r"value\['cb'\]"):
        serialize_value({"cb": object()})


def test_malformed_envelopes():
    with pytest.raises(SerializationError, match="unknown envelope"):
        deserialize_value({TYPE_KEY: "pickle", "data": ""})
    with pytest.raises(SerializationError, match="malformed"):
        deserialize_value({TYPE_KEY: "tensor", "dtype": "float32"})
    with pytest.raises(SerializationError, match="unknown torch dtype"):
        deserialize_value({TYPE_KEY: "torch_dtype", "name": "manual_seed"})


def test_no_pickle_anywhere(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("pickle used")

    for name in ("dumps", "loads", "dump", "load"):
        monkeypatch.setattr(pickle, name, forbidden)
    value = {"t": torch.ones(3), "meta": WeightUpdateMeta(), "a": np.zeros(2)}
    out = deserialize_value(json_loads(json_dumps(serialize_value(value))))
    assert torch.equal(out["t"], torch.ones(3))
    tree = ast.parse(Path(serialization.__file__).read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module)])
    }
    assert not imported & {"pickle", "cloudpickle", "dill", "marshal", "shelve"}
