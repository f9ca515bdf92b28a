"""Every ``sglang.launch_server`` command ``SGLangConfig.build_cmd`` emits parses with SGLang's
own parser (``argparse`` + ``ServerArgs.add_cli_args``, as ``sglang serve`` builds it) into the
values we meant: the default config, one config with every option the port supports, and each
option alone. ``build_cmd`` is given the worker's SGLang version, as it would find it installed
where the server launches. ``ServerArgs.from_cli_args`` runs too where it needs no accelerator
(0.5.23); on 0.5.10.post1 its ``__post_init__`` asks for a GPU first.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from packaging.version import Version

from areal.api.cli_args import SGLangConfig
from tests.conformance.worker_client import SGLangWorker, unwrap

pytestmark = pytest.mark.sglang

LAUNCH = dict(tp_size=2, base_gpu_id=0, host="127.0.0.1", port=30000)
EVERY_LAUNCH = dict(
    tp_size=4,
    base_gpu_id=2,
    host="10.0.0.7",
    port=30011,
    dist_init_addr="10.0.0.1:5000",
    n_nodes=2,
    node_rank=1,
    pp_size=2,
)

# Options SGLang does not know, on the versions named; the config refuses them at load
# (not here: this documents why). Everything else must parse on every tested version.
UNKNOWN_TO_SGLANG = {
    "enable_ep_moe": {"0.5.10.post1", "0.5.23"},
    "torchao_config": {"0.5.23"},
    "enable_nan_detection": {"0.5.23"},
}

# a non-default value for every option that is not a plain off-by-default switch
NON_DEFAULT: dict[str, Any] = {
    "model_path": "/models/qwen3-4b",
    "random_seed": 7,
    "disable_radix_cache": True,
    "torch_compile_max_bs": 16,
    "cuda_graph_max_bs": 160,
    "cuda_graph_bs": [1, 2, 4, 8],
    "torchao_config": "int8wo",
    "triton_attention_num_kv_splits": 4,
    "num_continuous_decode_steps": 2,
    "load_format": "safetensors",
    "attention_backend": "triton",
    "sampling_backend": "pytorch",
    "context_length": 8192,
    "mem_fraction_static": 0.75,
    "max_running_requests": 64,
    "chunked_prefill_size": 4096,
    "max_prefill_tokens": 16384,
    "schedule_policy": "fcfs",
    "schedule_conservativeness": 0.5,
    "cpu_offload_gb": 2,
    "dtype": "float16",
    "kv_cache_dtype": "fp8_e5m2",
    "dp_size": 2,
    "ep_size": 2,
    "enable_lora": True,
    "max_lora_rank": 16,
    "max_loaded_loras": 4,
    "lora_paths": ["/loras/a", "/loras/b"],
    "lora_backend": "csgmv",
    "log_level": "info",
    "log_level_http": "info",
    "log_requests_level": 2,
    "enable_metrics": True,
    "decode_log_interval": 40,
}
SWITCHES = [
    f.name
    for f in dataclasses.fields(SGLangConfig)
    if f.name not in NON_DEFAULT and f.type == "bool" and f.default is False
]
OPTIONS = [f.name for f in dataclasses.fields(SGLangConfig)]
SUPPORTED = [name for name in OPTIONS if name not in UNKNOWN_TO_SGLANG]


def value_of(option: str) -> Any:
    return NON_DEFAULT.get(option, True)  # the rest are off-by-default switches


def config_with(*options: str) -> SGLangConfig:
    """Those options set, the rest default; a model path always (SGLang requires one)."""
    return SGLangConfig(**({"model_path": "/models/qwen3-4b"} | {o: value_of(o) for o in options}))


def parse(sglang: SGLangWorker, config: SGLangConfig, **launch: Any) -> tuple[dict, dict]:
    """(what build_args meant, what SGLang's parser made of build_cmd's argv)."""
    args = SGLangConfig.build_args(config, sglang_version=sglang.version, **launch)
    argv = SGLangConfig.build_cmd(config, sglang_version=sglang.version, **launch)
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    return args, sglang.call("parse_args", argv=argv[3:])


def assert_parsed_as_meant(args: dict, parsed: dict) -> None:
    assert parsed["ok"], parsed["error"]
    values = parsed["values"]
    for key, meant in args.items():
        if meant is None or meant is False or meant == "" or meant == []:
            continue  # not emitted: SGLang keeps its own default
        flag = "--" + key.replace("_", "-")
        assert flag in parsed["dests"], f"{flag} is no option of SGLang's"
        got = unwrap(values[parsed["dests"][flag]])
        if key == "lora_paths":  # SGLang turns each path into a reference carrying it
            assert len(got) == len(meant) and all(p in str(g) for p, g in zip(meant, got))
        elif key == "model_loader_extra_config":
            assert json.loads(got) == json.loads(meant)
        else:
            assert got == meant, key


def test_every_option_is_covered():
    """A new SGLangConfig field must get a value here, so every check covers it."""
    assert set(OPTIONS) == set(NON_DEFAULT) | set(SWITCHES)
    assert set(UNKNOWN_TO_SGLANG) <= set(OPTIONS)


def test_default_config_parses_as_meant(sglang: SGLangWorker):
    args, parsed = parse(sglang, SGLangConfig(model_path="/models/qwen3-4b"), **LAUNCH)
    assert_parsed_as_meant(args, parsed)


# versions whose ServerArgs.__post_init__ asks for a GPU before it validates anything
POST_INIT_NEEDS_ACCELERATOR = {"0.5.10.post1"}


def test_default_config_passes_server_args_validation_where_it_runs_on_cpu(sglang: SGLangWorker):
    _, parsed = parse(sglang, SGLangConfig(model_path="/models/qwen3-4b"), **LAUNCH)
    outcome = parsed["from_cli_args"]
    if sglang.version in POST_INIT_NEEDS_ACCELERATOR:
        assert not outcome["ok"] and "No accelerator" in outcome["error"], outcome
    else:
        assert outcome["ok"], outcome["error"]


def test_every_supported_option_together_parses_as_meant(sglang: SGLangWorker):
    args, parsed = parse(sglang, config_with(*SUPPORTED), **EVERY_LAUNCH)
    assert_parsed_as_meant(args, parsed)


@pytest.mark.parametrize("option", SUPPORTED)
def test_each_option_alone_parses_as_meant(sglang: SGLangWorker, option: str):
    args, parsed = parse(sglang, config_with(option), **LAUNCH)
    assert_parsed_as_meant(args, parsed)


def test_options_unknown_to_sglang_fail_on_the_versions_named(sglang: SGLangWorker):
    for option, versions in UNKNOWN_TO_SGLANG.items():
        _, parsed = parse(sglang, config_with(option), **LAUNCH)
        if sglang.version in versions:
            assert not parsed["ok"], option
            assert "unrecognized arguments: --" + option.replace("_", "-") in parsed["error"]
        else:
            assert parsed["ok"], parsed.get("error")


def test_cuda_graph_batch_sizes_keep_their_meaning(sglang: SGLangWorker):
    """The floor's --cuda-graph-max-bs / --cuda-graph-bs size its (decode-only) CUDA graphs;
    0.5.14 split the flags by phase, keeping the old names as deprecated aliases of the
    -decode ones, and 0.5.20 dropped the old names. build_args spells them the target's way."""
    config = config_with("cuda_graph_max_bs", "cuda_graph_bs")
    argv = SGLangConfig.build_cmd(config, sglang_version=sglang.version, **LAUNCH)[3:]
    phased = Version(sglang.version) >= Version("0.5.14")
    suffix = "-decode" if phased else ""
    assert argv[argv.index(f"--cuda-graph-max-bs{suffix}") + 1] == "160"
    assert argv[argv.index(f"--cuda-graph-bs{suffix}") + 1 :][:4] == ["1", "2", "4", "8"]
    parsed = sglang.call("parse_args", argv=argv)
    assert parsed["ok"], parsed["error"]
    resolved = sglang.call("cuda_graph_config", argv=argv)
    if not phased:  # the floor: ServerArgs fields its decode CUDA-graph runner reads
        assert resolved is None
        assert unwrap(parsed["values"]["cuda_graph_max_bs"]) == 160
        assert unwrap(parsed["values"]["cuda_graph_bs"]) == [1, 2, 4, 8]
        return
    # SGLang's own resolution step: the decode graphs got both, the prefill graphs neither
    assert {phase: {k: unwrap(v) for k, v in keys.items()} for phase, keys in resolved.items()} == {
        "decode": {"max_bs": 160, "bs": [1, 2, 4, 8]},
        "prefill": {"max_bs": None, "bs": None},
    }


def test_floor_spelling_of_cuda_graph_flags_is_ambiguous_on_newest(sglang: SGLangWorker):
    """Why the rename is needed: 0.5.23 reads --cuda-graph-max-bs as an ambiguous prefix."""
    parsed = sglang.call("parse_args", argv=["--model-path", "/m", "--cuda-graph-max-bs", "8"])
    if sglang.version == "0.5.10.post1":
        assert parsed["ok"]
    else:
        assert not parsed["ok"]
        assert "ambiguous option: --cuda-graph-max-bs" in parsed["error"]
