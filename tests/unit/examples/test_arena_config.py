"""Stream configuration and the weighted mixture (README_arena.md#multiple-streams; cases M1-M6)."""

from __future__ import annotations

import base64
import math

import pytest

from examples.swe.arena_config import (
    build_weighted_arena_rows,
    load_arena_stream_configs,
    parse_arena_stream_config,
)
from examples.swe.reward_transforms import identity_reward
from examples.swe.utils import ArenaRewardRefConfig, ArenaStreamConfig, SWEEnvConfig
from tests.conftest import SECRET_SENTINEL, SWE_DIR

# --- one entry ---


def test_parse_minimal_entry_defaults():
    s = parse_arena_stream_config({"name": " a ", "stream_id": " s1 "})
    assert s == ArenaStreamConfig(name="a", stream_id="s1")
    assert s.sampling_weight == 1.0 and s.expected_reward_ref == ArenaRewardRefConfig()


def test_parse_full_entry_and_dataclass_input():
    entry = {
        "name": "astra.v2_x-1",
        "stream_id": "stream-a",
        "sampling_weight": 3,
        "harness": " claude-code@1.0.0 ",
        "llm_protocol": "anthropic",
        "task_envs": {"A": "1"},
        "expected_reward_ref": {"key": "reward-a", "version": 1.0},
        "reward_threshold": 1,
        "reward_transform_fn": "examples.swe.reward_transforms.astra_partial_reward",
    }
    s = parse_arena_stream_config(entry)
    assert s.sampling_weight == 3.0 and isinstance(s.sampling_weight, float)
    assert s.harness == "claude-code@1.0.0"
    assert s.expected_reward_ref == ArenaRewardRefConfig("reward-a", "1.0")
    assert s.reward_threshold == 1.0 and isinstance(s.reward_threshold, float)
    assert parse_arena_stream_config(s) == s


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"name": "bad/name"}, "may only contain"),
        ({"name": ""}, "may only contain"),
        ({"stream_id": "  "}, "stream_id"),
        ({"colour": "red"}, "unknown fields: colour"),
        ({"sampling_weight": True}, "must be numeric"),
        ({"sampling_weight": "2"}, "must be numeric"),
        ({"sampling_weight": 0}, "finite and positive"),
        ({"sampling_weight": -1.0}, "finite and positive"),
        ({"sampling_weight": math.inf}, "finite and positive"),
        ({"llm_protocol": "grpc"}, "llm_protocol"),
        ({"task_envs": {"K": 1}}, "task_envs"),
        ({"task_envs": {"": "v"}}, "task_envs"),
        ({"task_envs": ["K=V"]}, "task_envs"),
        ({"expected_reward_ref": {"key": "k"}}, "both key and version"),
        ({"expected_reward_ref": {"version": "1"}}, "both key and version"),
        ({"expected_reward_ref": {"key": "k", "version": "1", "x": 1}}, "unknown fields: x"),
        ({"expected_reward_ref": "k@1"}, "must be an object"),
        ({"reward_threshold": "0.9"}, "numeric or null"),
        ({"reward_threshold": True}, "numeric or null"),
        ({"reward_threshold": math.nan}, "finite"),
    ],
)
def test_entry_validation(changes, message):  # case 5
    with pytest.raises(ValueError, match=message):
        parse_arena_stream_config({"name": "a", "stream_id": "s", **changes})


def test_entry_must_be_an_object():
    with pytest.raises(ValueError, match="must be an object"):
        parse_arena_stream_config(["name", "a"])  # type: ignore[arg-type]


def test_empty_reward_ref_forms():
    for value in (None, "", {}, {"key": "", "version": ""}):
        s = parse_arena_stream_config({"name": "a", "stream_id": "s", "expected_reward_ref": value})
        assert s.expected_reward_ref == ArenaRewardRefConfig()


# --- sources ---


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def test_file_source_merges_common_envs_and_harness(tmp_path):  # M1
    path = tmp_path / "streams.yaml"
    path.write_text(
        "streams:\n"
        "  - name: a\n    stream_id: s-a\n    task_envs: {SHARED: own}\n"
        "    expected_reward_ref: {key: r-a, version: '1'}\n"
        "  - name: b\n    stream_id: s-b\n    harness: codex@2\n"
    )
    econfig = {
        "arena_streams_file": str(path),
        "arena_task_envs": {"SHARED": "common", "X": "1"},
        "arena_harness": "claude@1",
    }
    a, b = load_arena_stream_configs(econfig)
    assert a.task_envs == {"SHARED": "own", "X": "1"} and b.task_envs == {
        "SHARED": "common",
        "X": "1",
    }
    assert (a.harness, b.harness) == ("claude@1", "codex@2")
    assert a.expected_reward_ref == ArenaRewardRefConfig("r-a", "1")
    assert a.reward_transform_fn == "" and b.reward_threshold is None


def test_file_source_accepts_json_and_bare_lists(tmp_path):
    path = tmp_path / "streams.json"
    path.write_text('[{"name": "a", "stream_id": "s"}]')
    assert [s.name for s in load_arena_stream_configs({"arena_streams_file": str(path)})] == ["a"]


def test_file_source_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_arena_stream_configs({"arena_streams_file": str(tmp_path / "nope.yaml")})


def test_base64_source(monkeypatch):  # M2
    payload = b64("streams:\n  - name: a\n    stream_id: s\n    sampling_weight: 3\n")
    (s,) = load_arena_stream_configs(SWEEnvConfig(arena_streams_yaml_b64=payload))
    assert s.sampling_weight == 3.0


@pytest.mark.parametrize(
    "payload", ["%%%not-base64%%%", b64("x") + "!", base64.b64encode(b"\xff\xfe").decode()]
)
def test_invalid_base64_never_falls_back(payload):  # M4, case 3
    with pytest.raises(ValueError, match="not valid base64 UTF-8"):
        load_arena_stream_configs({"arena_streams_yaml_b64": payload, "stream_id": "legacy"})


def test_invalid_base64_does_not_echo_the_payload():
    secret = b64(f"streams: [{{name: a, stream_id: s, task_envs: {{K: {SECRET_SENTINEL}}}}}]") + "*"
    with pytest.raises(ValueError) as info:
        load_arena_stream_configs({"arena_streams_yaml_b64": secret})
    assert secret not in str(info.value)


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ("streams: []\n", "non-empty 'streams' list"),
        ("[]\n", "non-empty 'streams' list"),
        ("streams:\n  - {name: a, stream_id: s}\nextra: 1\n", "unknown top-level fields: extra"),
        ("just text\n", "non-empty 'streams' list"),
        ("streams: {name: a}\n", "non-empty 'streams' list"),
        ("streams: [\n", "not valid YAML"),
    ],
)
def test_document_shapes(document, message):  # case 4
    with pytest.raises(ValueError, match=message):
        load_arena_stream_configs({"arena_streams_yaml_b64": b64(document)})


def test_sources_are_mutually_exclusive(tmp_path):
    with pytest.raises(ValueError, match="mutually exclusive"):
        load_arena_stream_configs(
            {"arena_streams": [{"name": "a", "stream_id": "s"}], "arena_streams_file": "x.yaml"}
        )


def test_uniqueness():  # M5
    with pytest.raises(ValueError, match="names must be unique"):
        load_arena_stream_configs(
            {"arena_streams": [{"name": "a", "stream_id": "s1"}, {"name": "a", "stream_id": "s2"}]}
        )
    with pytest.raises(ValueError, match="ids must be unique"):
        load_arena_stream_configs(
            {"arena_streams": [{"name": "a", "stream_id": "s"}, {"name": "b", "stream_id": "s"}]}
        )


def test_entry_errors_name_the_entry():
    with pytest.raises(ValueError, match=r"econfig\.arena_streams, entry 1: .*may only contain"):
        load_arena_stream_configs(
            {"arena_streams": [{"name": "a", "stream_id": "s"}, {"name": "b/c", "stream_id": "t"}]}
        )


def test_common_task_envs_validated():
    with pytest.raises(ValueError, match="arena_task_envs must map"):
        load_arena_stream_configs({"arena_task_envs": {"K": 3}})


def test_legacy_single_stream_mode(areal_logs):  # M8 (threshold string accepted)
    econfig = SWEEnvConfig(
        stream_id=" stream-a ",
        arena_harness="claude@1",
        arena_llm_protocol="anthropic",
        arena_task_envs={"K": "v"},
        arena_reward_transform_fn=" pkg.mod.fn ",
    )
    (s,) = load_arena_stream_configs(econfig)
    assert s == ArenaStreamConfig(
        name="default",
        stream_id="stream-a",
        sampling_weight=1.0,
        harness="claude@1",
        llm_protocol="anthropic",
        task_envs={"K": "v"},
        reward_transform_fn="pkg.mod.fn",
    )
    (s,) = load_arena_stream_configs({"stream_id": "s", "arena_reward_threshold": "0.98"})
    assert s.reward_threshold == 0.98
    with pytest.raises(ValueError, match="numeric or null"):
        load_arena_stream_configs({"arena_reward_threshold": "high"})
    with pytest.raises(ValueError, match="finite"):
        load_arena_stream_configs({"arena_reward_threshold": "inf"})
    (s,) = load_arena_stream_configs({})
    assert s.stream_id == "" and s.name == "default"


def test_legacy_fields_are_reported_when_ignored(areal_logs):
    load_arena_stream_configs(
        {
            "arena_streams": [{"name": "a", "stream_id": "s"}],
            "stream_id": "legacy",
            "arena_reward_threshold": 0.5,
        }
    )
    assert "econfig.stream_id, econfig.arena_reward_threshold ignored" in areal_logs.text


def test_multi_stream_profile_streams_load(profile_env):  # M3 companion: profile -> loader
    from areal.api.cli_args import load_expr_config
    from examples.swe.utils import SWEPPOConfig

    cfg, _ = load_expr_config(["--config", str(SWE_DIR / "arena_multi_stream.yaml")], SWEPPOConfig)
    streams = load_arena_stream_configs(cfg.econfig)
    assert [(s.name, s.stream_id, s.reward_transform_fn) for s in streams] == [
        ("first", "your-first-stream", ""),
        ("second", "your-second-stream", ""),
    ]


def test_flash_v3_dataset_config_through_the_loader():  # case 53
    path = SWE_DIR / "dataset_configs" / "flash-v3-multi-stream.yaml"
    streams = load_arena_stream_configs({"arena_streams_file": str(path)})
    assert [s.name for s in streams] == ["vn_greenfield", "favor_app_online_scratch"]
    assert [s.llm_protocol for s in streams] == ["anthropic", "anthropic"]
    assert [s.expected_reward_ref for s in streams] == [
        ArenaRewardRefConfig("vn-creation-x2env-greenfield-reward", "2.0.8"),
        ArenaRewardRefConfig("favor-app-online-scratch-reward", "2.0.2"),
    ]
    assert {s.reward_transform_fn for s in streams} == {
        "examples.swe.reward_transforms.identity_reward"
    }
    assert identity_reward(0.75, {}) == 0.75
    for bad in (1.5, math.nan):
        with pytest.raises(ValueError, match=r"within \[0, 1\]"):
            identity_reward(bad, {})


# --- the mixture (README_arena.md#mixture-semantics) ---


def rows(prefix: str, n: int) -> list[dict]:
    return [{"data_id": f"{prefix}-{i}", "stream": prefix} for i in range(n)]


def streams(**weights: float) -> list[ArenaStreamConfig]:
    return [
        ArenaStreamConfig(name=n, stream_id=f"id-{n}", sampling_weight=w)
        for n, w in weights.items()
    ]


def mix(sizes: dict[str, int], weights: dict[str, float], **kwargs) -> list[dict]:
    return build_weighted_arena_rows(
        {n: rows(n, k) for n, k in sizes.items()}, streams(**weights), **kwargs
    )


def test_weighted_subset_3_to_1():
    out = mix({"a": 9, "b": 9}, {"a": 3, "b": 1}, epoch_size=12)
    # shares 12*27/36 = 9 (capped at a's 9 rows) and 3
    assert [r["stream"] for r in out].count("a") == 9 and len(out) == 12
    assert len({r["data_id"] for r in out}) == 12
    assert [r["stream"] for r in out[:4]] == ["a", "a", "a", "b"]
    assert [r["data_id"] for r in out if r["stream"] == "b"] == ["b-0", "b-1", "b-2"]  # a prefix


def test_named_weighted_subset_like_the_trainer():
    out = mix({"astra": 9, "tbench": 9}, {"astra": 3, "tbench": 1}, epoch_size=12)
    assert [r["stream"] for r in out[:4]] == ["astra", "astra", "astra", "tbench"]


def test_equal_weights_concatenation_order():
    out = mix({"large": 4, "small": 1}, {"large": 1, "small": 1})
    assert len(out) == 5 and len({r["data_id"] for r in out}) == 5
    assert [r["stream"] for r in out[:2]] == ["large", "small"]


def test_union_of_three_is_not_padded():
    out = mix({"a": 56, "b": 441, "c": 20}, {"a": 1, "b": 1, "c": 1}, size_multiple=4)
    assert len(out) == 517 and len({r["data_id"] for r in out}) == 517
    assert [r["stream"] for r in out[:4]] == ["a", "b", "c", "a"]


def test_default_epoch_never_repeats():
    out = mix({"a": 2, "b": 3}, {"a": 2, "b": 1})
    assert sorted(r["data_id"] for r in out) == ["a-0", "a-1", "b-0", "b-1", "b-2"]


def test_weight_scale_invariance():
    sizes = {"a": 7, "b": 5, "c": 3}
    assert mix(sizes, {"a": 0.5, "b": 1, "c": 0.25}, epoch_size=10) == mix(
        sizes, {"a": 1, "b": 2, "c": 0.5}, epoch_size=10
    )
    assert mix({"a": 2, "b": 3}, {"a": 0.5, "b": 1}) == mix({"a": 2, "b": 3}, {"a": 1, "b": 2})


def test_mass_overflow():
    with pytest.raises(ValueError, match="overflowed the mixture mass"):
        mix({"a": 2, "b": 2}, {"a": 1e308, "b": 1e308})  # each mass is already inf


def test_finite_masses_whose_sum_overflows():
    # One row each: both masses are 1e308 (finite) but their sum is not; the intended
    # ValueError, not the OverflowError math.fsum raises on such a sum.
    with pytest.raises(ValueError, match="overflowed the mixture mass"):
        mix({"a": 1, "b": 1}, {"a": 1e308, "b": 1e308})


def test_epoch_larger_than_the_union():
    with pytest.raises(ValueError, match="cannot exceed the 5 unique source rows"):
        mix({"a": 2, "b": 3}, {"a": 1, "b": 1}, epoch_size=6)


def test_no_padding_to_the_batch_size():
    out = mix({"a": 1, "b": 5, "c": 1}, {"a": 1, "b": 1, "c": 1}, size_multiple=4)
    assert len(out) == 7


def test_epoch_must_divide_by_the_batch_size():
    with pytest.raises(ValueError, match="divisible by the training batch size 4"):
        mix({"a": 5, "b": 5}, {"a": 1, "b": 1}, epoch_size=6, size_multiple=4)


@pytest.mark.parametrize("epoch", [-1, 1.5, True])
def test_bad_epoch_sizes(epoch):
    with pytest.raises(ValueError, match="non-negative"):
        mix({"a": 5}, {"a": 1}, epoch_size=epoch)


@pytest.mark.parametrize("multiple", [0, True, 2.0])
def test_bad_size_multiples(multiple):
    with pytest.raises(ValueError, match="size_multiple"):
        mix({"a": 5}, {"a": 1}, size_multiple=multiple)


def test_empty_stream_is_rejected():
    with pytest.raises(ValueError, match="contains no dataset rows"):
        mix({"a": 5, "b": 0}, {"a": 1, "b": 1})


def test_water_filling_with_capping_and_fraction_ties():
    # size 10 over capacities a=2, b=10, c=10 with equal weights:
    # shares 10*2/22 = 0.9 (a), 4.5, 4.5 -> nothing capped; floors 0, 4, 4; leftover 2
    # goes to the largest fractional parts: a (0.909) then b (0.545, tie with c -> name b).
    out = mix({"a": 2, "b": 10, "c": 10}, {"a": 1, "b": 1, "c": 1}, epoch_size=10)
    counts = {n: [r["stream"] for r in out].count(n) for n in "abc"}
    assert counts == {"a": 1, "b": 5, "c": 4}
    # a small, heavy Stream is capped and the rest is shared by the others
    out = mix({"a": 2, "b": 10, "c": 10}, {"a": 100, "b": 1, "c": 1}, epoch_size=10)
    assert [r["stream"] for r in out].count("a") == 2


def test_rows_are_copies():
    source = {"a": rows("a", 2)}
    out = build_weighted_arena_rows(source, streams(a=1))
    out[0]["data_id"] = "changed"
    assert source["a"][0]["data_id"] == "a-0"
