"""``areal.api.config.support``: configs this port's trainer cannot run are refused at load."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from omegaconf import OmegaConf

from areal.api.cli_args import ConfigError, GRPOConfig, PPOConfig, load_expr_config
from areal.api.config.loader import instantiate_config, to_structured_cfg
from areal.api.config.support import refuse_unsupported, unsupported
from examples.swe.utils import SWEPPOConfig
from tests.conftest import REPO_ROOT, SWE_DIR

_NAMES = {"experiment_name": "exp", "trial_name": "trial"}
_OUTPUTS = {**_NAMES, "fileroot": "/tmp/areal-support-test"}
# A small config every check accepts: 2 FSDP ranks, 2 SGLang servers, disk updates.
BASE: dict[str, Any] = {
    **_NAMES,
    "actor": {**_NAMES, "backend": "fsdp:d2", "weight_update_mode": "disk"},
    "rollout": {"backend": "sglang:d2t1p1", "consumer_batch_size": 4},
    "train_dataset": {"path": "rows", "type": "rl", "batch_size": 4},
    "gconfig": {"max_tokens": 1023},
    "sglang": {"context_length": 1024},
    "saver": _OUTPUTS,
    "evaluator": _OUTPUTS,
    "recover": _OUTPUTS,
    "stats_logger": _OUTPUTS,
}


def build(changes: dict[str, Any] | None = None) -> PPOConfig:
    """BASE with dotted ``changes``, built by the loader (so every load-time rule runs)."""
    data = copy.deepcopy(BASE)
    for dotted, value in copy.deepcopy(changes or {}).items():
        *parents, leaf = dotted.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return instantiate_config(to_structured_cfg(OmegaConf.create(data), PPOConfig), PPOConfig)


def refused(changes: dict[str, Any]) -> list[tuple[str, str]]:
    return [(e.field, e.message) for e in unsupported(build(changes))]


def only(changes: dict[str, Any], field: str, *phrases: str) -> None:
    """``changes`` make exactly one problem, on ``field``, whose message has ``phrases``."""
    [(got, message)] = refused(changes)
    assert got == field
    for phrase in phrases:
        assert phrase in message, message


def test_the_base_config_is_accepted():
    assert unsupported(build()) == []
    assert refuse_unsupported(build()) is None


COLOCATED = {
    "rollout.scheduling_strategy": {"type": "colocation", "target": "actor", "fork": True},
}


# --- 1. awex ---


def test_awex_between_processes_that_are_not_colocated_is_refused():
    only(
        {"actor.weight_update_mode": "awex"},
        "actor.weight_update_mode",
        "never leave the host",
        "set rollout.scheduling_strategy: {type: colocation, target: actor, fork: true}",
        "or actor.weight_update_mode: xccl",
    )


@pytest.mark.parametrize("backend", ["sglang:d2t1p1", "hf:d1p1t2", "sglang:d1t2p1"])
def test_awex_with_the_rollout_colocated_on_the_actor_is_accepted(backend):
    changes = {"actor.weight_update_mode": "awex", "rollout.backend": backend}
    assert refused({**changes, **COLOCATED}) == []


def test_awex_refuses_lora_and_a_megatron_actor_without_ddp():
    awex = {**COLOCATED, "actor.weight_update_mode": "awex"}
    problems = dict(refused({**awex, "actor.backend": "megatron:d2p1t1",
                             "actor.megatron.wrap_with_ddp": False}))  # fmt: skip
    assert "set actor.megatron.wrap_with_ddp: true" in problems["actor.megatron.wrap_with_ddp"]
    lora = refused({**awex, "actor.use_lora": True})
    assert any("awex sends full weights" in m for f, m in lora if f == "actor.weight_update_mode")


@pytest.mark.parametrize("mode", ["disk", "xccl"])
def test_disk_and_xccl_are_accepted(mode):
    assert refused({"actor.weight_update_mode": mode}) == []


# --- 2. Megatron context parallelism ---


@pytest.mark.parametrize(
    "backend", ["megatron:d2c2", "megatron:(attn:d1p1t2c2|ffn:d1e4)"], ids=["plain", "hybrid"]
)
def test_megatron_context_parallelism_is_accepted(backend):
    assert refused({"actor.backend": backend}) == []


def test_megatron_context_parallelism_needs_a_budget_of_two_c_tokens():
    only(
        {"actor.backend": "megatron:d1c4", "actor.mb_spec.max_tokens_per_mb": 7},
        "actor.mb_spec.max_tokens_per_mb",
        "7 tokens cannot hold one sequence under c4",
        "at least 8",
    )


@pytest.mark.parametrize("backend", ["megatron:d1t2p2", "megatron:(attn:d2t2|ffn:d1e4)"])
def test_megatron_tensor_and_pipeline_parallelism_are_accepted(backend):
    assert refused({"actor.backend": backend}) == []


# --- 3. FSDP is data and context parallel only ---


@pytest.mark.parametrize(
    ("backend", "fix"), [("fsdp:d2t2", "'fsdp:d4'"), ("fsdp:t2c2", "'fsdp:d2c2'")]
)
def test_fsdp_tensor_parallelism_is_refused(backend, fix):
    only(
        {"actor.backend": backend},
        "actor.backend",
        f"the FSDP engine is data and context parallel only, but {backend!r} asks for t2",
        f"use {fix} (d and c only) or a megatron backend",
    )


def test_fsdp_pipeline_parallelism_is_already_refused_by_the_allocation_parser():
    with pytest.raises(ConfigError, match=r"^actor\.backend: .*FSDP does not support pipeline"):
        build({"actor.backend": "fsdp:d2p2"})


# --- 4. colocation ---


@pytest.mark.parametrize("backend", ["sglang:d2t1p1", "hf:d2", "sglang:d1t2p1", "hf:d1p1t2"])
def test_n_servers_of_tp_t_on_n_t_actor_workers_are_accepted(backend):
    assert refused({**COLOCATED, "rollout.backend": backend}) == []


def test_colocation_without_fork_is_refused():
    only(
        {**COLOCATED, "rollout.scheduling_strategy.fork": False},
        "rollout.scheduling_strategy.fork",
        "colocation without fork",
        "set rollout.scheduling_strategy.fork: true or rollout.scheduling_strategy.type: "
        "separation",
        "colocation runs as type: colocation, target: actor, fork: true",
    )


def test_colocation_with_another_target_is_refused():
    only(
        {**COLOCATED, "rollout.scheduling_strategy.target": "ref"},
        "rollout.scheduling_strategy.target",
        "colocation with 'ref' is not implemented",
        "set rollout.scheduling_strategy.target: actor",
    )


def test_colocation_without_a_target_is_already_refused_at_load():
    with pytest.raises(ConfigError, match=r"^rollout\.scheduling_strategy\.target: colocation"):
        build({**COLOCATED, "rollout.scheduling_strategy.target": None})


@pytest.mark.parametrize(
    ("backend", "wrong", "fix"),
    [
        ("sglang:d1t1p1", "has 1 server(s) of TP 1 on 1 device(s) for 2 actor worker(s);",
         "sglang:d2p1t1"),
        ("sglang:d2t1p2", "has servers of p2 (pipeline stages are not colocated);",
         "sglang:d2p1t1"),
        ("sglang:d2t2p1", "has 2 server(s) of TP 2 on 4 device(s) for 2 actor worker(s);",
         "sglang:d1p1t2"),
        ("sglang:d1t3p1", "has 1 server(s) of TP 3 on 3 device(s) for 2 actor worker(s);",
         "sglang:d2p1t1"),
    ],
)  # fmt: skip
def test_colocation_of_another_server_shape_is_refused(backend, wrong, fix):
    only(
        {**COLOCATED, "rollout.backend": backend},
        "rollout.backend",
        f"colocated rollout {backend!r} {wrong}",
        f"set rollout.backend: '{fix}' or rollout.scheduling_strategy.type: separation",
        "N servers of TP t (p1) on the N*t actor workers",
    )


def test_separated_rollout_may_have_any_shape():
    assert refused({"rollout.backend": "sglang:d3t4p1"}) == []


# --- 5. LoRA ---


@pytest.mark.parametrize("field", ["actor.use_lora", "rollout.use_lora"])
def test_lora_is_refused(field):
    only(
        {field: True},
        field,
        "/load_lora_adapter is never called",
        "HTTP 400",
        f"set {field}: false",
    )


# --- 6. launch flags SGLang rejects ---

FLAGS = [
    ("sglang.enable_ep_moe", True, "--enable-ep-moe", "use sglang.ep_size"),
    ("sglang.torchao_config", "int8wo", "--torchao-config", "set sglang.torchao_config: ''"),
    ("sglang.enable_nan_detection", True, "--enable-nan-detection", "enable_nan_detection: false"),
]


@pytest.mark.parametrize(("field", "value", "flag", "fix"), FLAGS)
def test_flags_sglang_rejects_are_refused(field, value, flag, fix):
    only({field: value}, field, f"{flag} is not a flag of SGLang", "0.5.23", fix)


@pytest.mark.parametrize(("field", "value", "flag", "fix"), FLAGS)
def test_the_embedded_server_ignores_sglang_flags(field, value, flag, fix):
    assert refused({field: value, "rollout.backend": "hf:d2"}) == []


# --- 7. the context-length off-by-one ---


@pytest.mark.parametrize("backend", ["sglang:d2t1p1", "hf:d2"])
def test_max_tokens_at_the_context_length_is_refused(backend):
    # eval_gconfig is null, so it is a copy of gconfig and shares the bad budget.
    problems = refused({"gconfig.max_tokens": 1024, "rollout.backend": backend})
    assert [field for field, _ in problems] == ["gconfig.max_tokens", "eval_gconfig.max_tokens"]
    server = backend.split(":")[0]
    for field, message in problems:
        assert message == (
            f"1024 is not below sglang.context_length 1024: the {server} server answers 400 "
            f"when prompt + max_new_tokens >= context_length; set {field}: 1023 "
            "(context_length - 1)"
        )


def test_eval_and_engine_budgets_are_checked_on_their_own():
    problems = refused({"eval_gconfig.max_tokens": 4096, "rollout.agent.engine_max_tokens": 1024})
    assert [field for field, _ in problems] == [
        "eval_gconfig.max_tokens",
        "rollout.agent.engine_max_tokens",
    ]
    assert "set eval_gconfig.max_tokens: 1023" in problems[0][1]
    assert "set rollout.agent.engine_max_tokens: 1023" in problems[1][1]


def test_no_context_length_skips_the_budget_check():
    assert refused({"gconfig.max_tokens": 99999, "sglang.context_length": None}) == []


# --- 8. consumer batch vs train batch ---


def test_a_consumer_batch_below_the_train_batch_is_refused():
    only(
        {"rollout.consumer_batch_size": 2},
        "rollout.consumer_batch_size",
        "2 is smaller than train_dataset.batch_size 4",
        "the run hangs without an error",
        "set rollout.consumer_batch_size: 4 (e.g. ${train_dataset.batch_size})",
    )


def test_a_larger_consumer_batch_is_not_refused():
    # It cannot hang (see the comment in support.py), so it is left to the user.
    assert refused({"rollout.consumer_batch_size": 8}) == []


# --- 9. xccl layouts SGLang cannot join ---


@pytest.mark.parametrize("backend", ["sglang:d1t2p2", "hf:d2p2"])
def test_xccl_with_pipeline_parallel_servers_is_refused(backend):
    only(
        {"actor.weight_update_mode": "xccl", "rollout.backend": backend},
        "actor.weight_update_mode",
        f"xccl cannot reach pipeline-parallel servers (p2 in rollout.backend {backend!r})",
        "rank_offset + tp_rank in every pipeline stage",
        "set actor.weight_update_mode: disk, or p1 in rollout.backend",
    )


def test_disk_updates_reach_pipeline_parallel_servers():
    assert refused({"rollout.backend": "sglang:d1t2p2"}) == []


def test_xccl_with_sglang_dp_size_needs_dp_attention():
    xccl = {"actor.weight_update_mode": "xccl", "sglang.dp_size": 2}
    only(
        xccl,
        "sglang.dp_size",
        "xccl with sglang.dp_size 2 and no DP attention fails an assert",
        "HTTP 500",
        "set sglang.dp_size: 1, sglang.enable_dp_attention: true, or actor.weight_update_mode: "
        "disk",
    )
    assert refused({**xccl, "sglang.enable_dp_attention": True}) == []
    assert refused({**xccl, "rollout.backend": "hf:d2"}) == []
    assert refused({**xccl, "actor.weight_update_mode": "disk"}) == []


# --- 10. a batch smaller than the actor's data parallelism ---


@pytest.mark.parametrize(
    ("backend", "dp"),
    [("fsdp:d8", 8), ("megatron:(attn:d4t2|ffn:d2e4)", 4)],
    ids=["fsdp", "hybrid"],
)
def test_a_batch_smaller_than_the_data_parallel_size_is_refused(backend, dp):
    only(
        {"actor.backend": backend, "train_dataset.batch_size": 2, "rollout.consumer_batch_size": 2},
        "train_dataset.batch_size",
        f"2 group(s) per step is fewer than the actor's {dp} data-parallel ranks",
        f"(d{dp} in actor.backend {backend!r})",
        f"set train_dataset.batch_size to at least {dp}",
    )


def test_the_hybrid_form_counts_the_attention_data_parallel_size():
    # attn d4 (ffn d2): a batch of 4 gives every attention data-parallel rank a group.
    assert refused({"actor.backend": "megatron:(attn:d4t2|ffn:d2e4)"}) == []


# --- refuse_unsupported and unset backends ---


def test_refuse_lists_every_problem_one_line_each():
    cfg = build({"actor.weight_update_mode": "awex", "sglang.enable_ep_moe": True})
    with pytest.raises(ConfigError) as raised:
        refuse_unsupported(cfg)
    header, *lines = str(raised.value).splitlines()
    assert header == "this port's trainer cannot run this config (2 problem(s)):"
    assert [line.split(":")[0].strip() for line in lines] == [
        "actor.weight_update_mode",
        "sglang.enable_ep_moe",
    ]
    assert lines == [f"  {e}" for e in unsupported(cfg)]
    assert all(";" in line for line in lines)  # <field>: <why>; <fix>


def test_unset_backends_are_reported():
    problems = [(e.field, e.message) for e in unsupported(PPOConfig())]
    assert problems == [
        ("actor.backend", "is not set; set an allocation, e.g. 'fsdp:d8'"),
        ("rollout.backend", "is not set; set an allocation, e.g. 'sglang:d4t2'"),
    ]


# --- the shipped profiles ---


@pytest.mark.parametrize(
    "profile",
    ["arena_grpo", "arena_multi_stream", "arena_local", "arena_flash_v3_mini"],
)
def test_shipped_arena_profiles_are_supported(profile_env, profile):
    cfg, _ = load_expr_config(["--config", str(SWE_DIR / f"{profile}.yaml")], SWEPPOConfig)
    assert unsupported(cfg) == []


def test_the_toy_profile_is_supported(profile_env):
    toy = REPO_ROOT / "examples" / "toy" / "toy_grpo.yaml"
    cfg, _ = load_expr_config(["--config", str(toy)], GRPOConfig)
    assert unsupported(cfg) == []


def test_the_full_flash_v3_profile_passes_every_config_check(profile_env):
    """awex with 16 TP-4 servers colocated on the 64 ranks of
    megatron:(attn:d2p2t2c8|ffn:d4p2e8): nothing left to refuse."""
    cfg, _ = load_expr_config(["--config", str(SWE_DIR / "arena_flash_v3.yaml")], SWEPPOConfig)
    assert cfg.actor.weight_update_mode == "awex"
    assert cfg.rollout.backend == "sglang:d16t4p1"
    assert unsupported(cfg) == []


def test_xccl_with_colocation_on_gpus_is_refused_but_not_on_cpu():
    colocated = {
        "actor.weight_update_mode": "xccl",
        "rollout.backend": "sglang:d2t1p1",
        "rollout.scheduling_strategy": {"type": "colocation", "target": "actor", "fork": True},
    }
    only(
        {**colocated, "cluster.n_gpus_per_node": 8},
        "actor.weight_update_mode",
        "same GPU, which NCCL refuses",
        "actor.weight_update_mode: disk",
    )
    assert refused({**colocated, "cluster.n_gpus_per_node": 0}) == []


def test_min_new_tokens_without_a_server_tokenizer_is_refused():
    changes = {"sglang.skip_tokenizer_init": True, "gconfig.min_new_tokens": 4}
    problems = dict(refused(changes))
    assert "skip_tokenizer_init is true" in problems["gconfig.min_new_tokens"]
    # stop strings are fine: the client applies them for such a server
    assert refused({"sglang.skip_tokenizer_init": True, "gconfig.stop": ["</answer>"]}) == []
    assert refused({"gconfig.min_new_tokens": 4}) == []
