"""Allocation strings: every grammar rule and error (docs/configs.md#allocation-strings)."""

from __future__ import annotations

import pytest

from areal.api.alloc_mode import (
    AllocationValidationError,
    InvalidAllocationModeError,
    MegatronParallelStrategy,
    ModelAllocation,
    ParallelStrategy,
)
from areal.api.cli_args import SchedulingStrategy


def dims(spec: str) -> tuple[int, int, int, int, int, int]:
    p = ModelAllocation.from_str(spec).parallel
    return (p.dp_size, p.tp_size, p.pp_size, p.cp_size, p.ep_size, p.etp_size)


# --- inference backends ---


def test_sglang_servers_of_tp2():
    a = ModelAllocation.from_str("sglang:d4p1t2")
    assert a.backend == "sglang" and a.name is None and a.is_inference
    assert dims("sglang:d4p1t2") == (4, 2, 1, 1, 1, 1)
    assert (a.n_instances, a.instance_size, a.parallel.world_size) == (4, 2, 8)
    assert a.scheduling_strategy == SchedulingStrategy()  # separation by default


def test_flash_v3_rollout_layout():
    a = ModelAllocation.from_str("sglang:d16t4p1")
    assert (a.n_instances, a.instance_size, a.parallel.world_size) == (16, 4, 64)


def test_embedded_hf_backend():
    a = ModelAllocation.from_str("hf:d1")
    assert a.backend == "hf" and a.is_inference
    assert (a.n_instances, a.instance_size) == (1, 1)


def test_dimension_order_is_free_and_missing_letters_are_one():
    assert dims("sglang:t2d4") == dims("sglang:d4p1t2") == dims("sglang:p1t2d4")
    assert dims("sglang:t4") == (1, 4, 1, 1, 1, 1)


def test_repeated_letter_keeps_last_value():
    assert dims("sglang:d2t2d4") == (4, 2, 1, 1, 1, 1)


def test_whitespace_is_ignored():
    assert dims(" sglang : d4 t2 ") == (4, 2, 1, 1, 1, 1)


def test_bracket_name_and_name_argument():
    assert ModelAllocation.from_str("sglang[gen]:d2").name == "gen"
    assert ModelAllocation.from_str("sglang[gen]:d2", name="rollout").name == "rollout"


def test_scheduling_strategy_is_kept():
    strategy = SchedulingStrategy(type="colocation", target="actor")
    a = ModelAllocation.from_str("sglang:d2", scheduling_strategy=strategy)
    assert a.scheduling_strategy is strategy


@pytest.mark.parametrize("spec", ["sglang:d2c2", "sglang:d2e2", "hf:c2"])
def test_inference_accepts_only_dtp(spec):
    with pytest.raises(ValueError, match="not allowed here"):
        ModelAllocation.from_str(spec)


def test_inference_rejects_hybrid():
    with pytest.raises(ValueError):
        ModelAllocation.from_str("sglang:(attn:d2|ffn:d2)")


# --- training backends ---


def test_fsdp_data_parallel():
    a = ModelAllocation.from_str("fsdp:d8")
    assert not a.is_inference
    assert a.parallel.world_size == 8 and (a.n_instances, a.instance_size) == (8, 1)
    assert dims("fsdp:d8p1t1") == (8, 1, 1, 1, 1, 1)
    assert type(a.parallel) is ParallelStrategy


def test_fsdp_context_parallel_is_allowed():
    assert ModelAllocation.from_str("fsdp:d4c2").parallel.world_size == 8


def test_flash_v3_megatron_hybrid():
    p = ModelAllocation.from_str("megatron:(attn:d2p2t2c8|ffn:d4p2e8)").parallel
    assert isinstance(p, MegatronParallelStrategy)
    assert (p.dp_size, p.pp_size, p.tp_size, p.cp_size) == (2, 2, 2, 8)
    assert (p.ep_size, p.etp_size) == (8, 1)
    # world = 2*2*2*8 = 64; expert-model-parallel = pp*etp*ep = 2*1*8 = 16; edp = 64/16 = 4
    assert p.world_size == 64
    assert p.expert_model_parallel_size == 16
    assert p.edp_size == 4


def test_qwen_moe_hybrid_without_parentheses():
    p = ModelAllocation.from_str("megatron:attn:d1p1t2c4|ffn:d1p1e8").parallel
    # attention 1*2*4 = 8 GPUs; experts: 1 (edp) * 1 (pp) * 8 (ep) = 8
    assert (p.world_size, p.ep_size, p.edp_size) == (8, 8, 1)


def test_hybrid_derives_ffn_data_parallel():
    p = ModelAllocation.from_str("megatron:(attn:d4t2|ffn:e4)").parallel
    # attn world 8; edp = 8 / (ep 4 * etp 1 * pp 1) = 2
    assert (p.world_size, p.ep_size, p.edp_size) == (8, 4, 2)


def test_hybrid_ffn_tensor_parallel_is_expert_tp():
    p = ModelAllocation.from_str("megatron:(attn:d4t2|ffn:t2e2)").parallel
    # etp 2, ep 2: edp = 8 / (2 * 2 * 1) = 2; attention tp stays 2
    assert (p.tp_size, p.etp_size, p.ep_size, p.edp_size) == (2, 2, 2, 2)


def test_hybrid_inherits_attention_pipeline():
    p = ModelAllocation.from_str("megatron:(attn:d2p2|ffn:e2)").parallel
    # world 4, expert-model-parallel = pp 2 * ep 2 = 4, edp 1
    assert (p.pp_size, p.edp_size) == (2, 1)


def test_megatron_common_dims_with_experts():
    p = ModelAllocation.from_str("megatron:d2t2e4").parallel
    assert (p.world_size, p.ep_size, p.edp_size) == (4, 4, 1)


def test_no_expert_parallel_means_edp_is_dp():
    assert ModelAllocation.from_str("megatron:d4t2").parallel.edp_size == 4


def test_hybrid_world_size_mismatch():
    with pytest.raises(InvalidAllocationModeError, match="must match"):
        ModelAllocation.from_str("megatron:(attn:d2t2|ffn:d4e2)")


def test_hybrid_pipeline_mismatch():
    with pytest.raises(InvalidAllocationModeError, match="pipeline"):
        ModelAllocation.from_str("megatron:(attn:d2p2|ffn:p1e2)")


def test_hybrid_underived_ffn_data_parallel():
    with pytest.raises(InvalidAllocationModeError, match="does not divide"):
        ModelAllocation.from_str("megatron:(attn:d3|ffn:e2)")


def test_hybrid_needs_both_parts():
    with pytest.raises(ValueError, match="hybrid"):
        ModelAllocation.from_str("megatron:(attn:d2)")
    with pytest.raises(ValueError, match="parentheses"):
        ModelAllocation.from_str("megatron:(attn:d2|ffn:e2")


def test_expert_parallel_must_divide_world():
    with pytest.raises(AllocationValidationError, match="must divide"):
        ModelAllocation.from_str("megatron:d3e2")


@pytest.mark.parametrize("spec", ["fsdp:d2p2", "fsdp:p2"])
def test_fsdp_rejects_pipeline(spec):
    with pytest.raises(AllocationValidationError, match="pipeline"):
        ModelAllocation.from_str(spec)


def test_fsdp_rejects_experts():
    with pytest.raises(AllocationValidationError, match="expert"):
        ModelAllocation.from_str("fsdp:d2e2")


def test_virtual_pipeline_needs_pipeline():
    with pytest.raises(AllocationValidationError, match="pp > 1"):
        MegatronParallelStrategy(virtual_pipeline_parallel_size=2)
    assert MegatronParallelStrategy(pipeline_parallel_size=2, virtual_pipeline_parallel_size=2)


def test_aliases():
    p = ParallelStrategy(
        tensor_parallel_size=2,
        pipeline_parallel_size=3,
        data_parallel_size=4,
        context_parallel_size=5,
        expert_parallel_size=1,
        expert_tensor_parallel_size=1,
    )
    assert (p.tp_size, p.pp_size, p.dp_size, p.cp_size, p.ep_size, p.etp_size) == (2, 3, 4, 5, 1, 1)
    assert p.world_size == 120


@pytest.mark.parametrize(
    "spec",
    [
        "sglang:d4p1t2",
        "fsdp:d8",
        "megatron:(attn:d2p2t2c8|ffn:d4p2e8)",
        "hf:d2t2",
        "megatron[actor]:d2t2c2",
    ],
)
def test_str_round_trip(spec):
    a = ModelAllocation.from_str(spec)
    b = ModelAllocation.from_str(str(a))
    assert (a.backend, a.name, a.parallel) == (b.backend, b.name, b.parallel)


# --- malformed strings: ValueError with a hint ---


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("d4t2", "no backend prefix"),
        ("[gen]:d4", "does not start with a backend"),
        ("sglang.d4", "use ':' not '.'"),
        ("vllm:d1", "vllm is not supported in this port"),
        ("archon:d1", "archon is not supported in this port"),
        ("tpu:d1", "unknown backend 'tpu'"),
        ("sglang:d4t2+fsdp:d8", "give each engine its own"),
        ("sglang:", "no parallel dimensions"),
        ("", "empty allocation"),
        ("sglang:d0", "positive integer"),
        ("sglang:d04", "positive integer"),
        ("sglang:x4", "not allowed here"),
        ("sglang:d4t", "cannot parse dimensions"),
        ("sglang[1bad]:d4", "brackets"),
        ("sglang d4", "expected ':' after the backend"),
    ],
)
def test_parse_errors(spec, message):
    with pytest.raises(ValueError, match=message) as info:
        ModelAllocation.from_str(spec)
    assert not isinstance(info.value, AllocationValidationError)


def test_non_string():
    with pytest.raises(ValueError, match="must be a string"):
        ModelAllocation.from_str(4)  # type: ignore[arg-type]
