"""Stream projection (README_arena.md#checking-streams-before-you-submit; cases 21-24)."""

from __future__ import annotations

import base64

import pytest
import yaml

from areal.api.cli_args import load_expr_config
from examples.swe.arena_config import load_arena_stream_configs
from examples.swe.arena_stream_config_projection import main, project_arena_streams
from examples.swe.utils import SWEPPOConfig
from tests.conftest import SWE_DIR

MULTI = SWE_DIR / "arena_multi_stream.yaml"


def test_multi_stream_profile_projection(capsys):  # case 21
    code = main([str(MULTI)])
    out = capsys.readouterr().out
    assert code == 0 and not out.endswith("\n")
    document = yaml.safe_load(base64.b64decode(out))
    assert list(document) == ["streams"]
    assert [list(entry) for entry in document["streams"]] == [
        ["name", "stream_id", "sampling_weight", "harness", "expected_reward_ref"]
    ] * 2
    assert document["streams"][0] == {
        "name": "first",
        "stream_id": "your-first-stream",
        "sampling_weight": 1,
        "harness": "your-harness@version",
        "expected_reward_ref": {"key": "your-reward", "version": "1.0.0"},
    }
    assert [s["name"] for s in document["streams"]] == ["first", "second"]


def write(tmp_path, text: str, name: str = "train.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    ("streams", "where"),
    [
        (
            "[{name: a, stream_id: s, harness: '${oc.env:H}'}]",
            r"econfig\.arena_streams\[0\]\.harness",
        ),
        (
            "[{name: a, stream_id: s}, {name: b, stream_id: s2, task_envs: {K: '${x}'}}]",
            r"econfig\.arena_streams\[1\]\.task_envs\.K",
        ),
        (
            "[{name: a, stream_id: s, extra: [ok, 'pre-${oc.env:Y}']}]",
            r"econfig\.arena_streams\[0\]\.extra\[1\]",
        ),
    ],
)
def test_interpolations_are_refused_with_their_path(tmp_path, streams, where):  # case 22
    path = write(tmp_path, f"econfig:\n  arena_streams: {streams}\n")
    with pytest.raises(ValueError, match=where):
        project_arena_streams(path)


def test_non_string_scalars_and_keys_are_accepted(tmp_path):
    path = write(
        tmp_path,
        "econfig:\n  arena_streams: [{name: a, stream_id: s, sampling_weight: 2.5, '${k}': 1}]\n",
    )
    assert yaml.safe_load(project_arena_streams(path))["streams"][0]["sampling_weight"] == 2.5


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("- a\n- b\n", "must be a YAML mapping"),
        ("experiment_name: x\n", "no 'econfig' mapping"),
        ("econfig: 3\n", "no 'econfig' mapping"),
        ("econfig: {stream_id: x}\n", "non-empty list"),
        ("econfig: {arena_streams: []}\n", "non-empty list"),
        ("econfig: {arena_streams: {name: a}}\n", "non-empty list"),
    ],
)
def test_malformed_configs(tmp_path, text, message):  # case 23
    with pytest.raises(ValueError, match=message):
        project_arena_streams(write(tmp_path, text))


def test_flash_v3_profile_is_rejected(capsys):  # case 23
    assert main([str(SWE_DIR / "arena_flash_v3.yaml")]) == 1
    out, err = capsys.readouterr()
    assert out == "" and "non-empty list" in err and "arena_flash_v3.yaml" in err


def test_missing_argument_exits_2():
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def test_hydra_defaults_are_followed(tmp_path):
    write(tmp_path, "econfig:\n  arena_streams: [{name: base, stream_id: s}]\n", "base.yaml")
    child = write(tmp_path, "defaults: [base, _self_]\nseed: 3\n", "child.yaml")
    assert yaml.safe_load(project_arena_streams(child))["streams"][0]["name"] == "base"


def test_round_trip_matches_training(profile_env, tmp_path):  # case 24
    path = tmp_path / "streams.yaml"
    path.write_bytes(project_arena_streams(MULTI))
    from_projection = load_arena_stream_configs({"arena_streams_file": str(path)})
    cfg, _ = load_expr_config(["--config", str(MULTI)], SWEPPOConfig)
    assert from_projection == load_arena_stream_configs(cfg.econfig)
