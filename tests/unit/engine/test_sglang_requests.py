"""Requests that only a real SGLang server answers, checked field by field against a
recording peer (docs/inference.md): NCCL group, distributed update, memory, pause."""

from __future__ import annotations

import dataclasses
import json

import pytest

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, SGLangConfig
from areal.api.io_struct import ModelRequest, ParamSpec, WeightUpdateMeta
from areal.engine.sglang_remote import HFBackend, RemoteSGLangEngine, SGLangBackend
from areal.inference.auth import API_KEY_ENV
from tests.fakes.live_server import ScriptedASGI, serve
from tests.fakes.scripted_http import ScriptedHTTP, reply


@pytest.fixture
def two_servers():
    peers = [ScriptedHTTP(), ScriptedHTTP()]
    for peer in peers:
        peer.on("GET", "/health", reply(200, {}))
        for path in (
            "/pause_generation",
            "/continue_generation",
            "/abort_request",
            "/release_memory_occupation",
            "/resume_memory_occupation",
            "/init_weights_update_group",
            "/update_weights_from_distributed",
            "/update_weights_from_disk",
            "/update_weight_version",
        ):
            peer.on("POST", path, reply(200, {"success": True}))
    with serve(ScriptedASGI(peers[0])) as a, serve(ScriptedASGI(peers[1])) as b:
        config = InferenceEngineConfig(backend="sglang:d2t2", setup_timeout=10, request_retries=3)
        engine = RemoteSGLangEngine(config)
        engine.initialize(addr=[a.removeprefix("http://"), b.removeprefix("http://")])
        yield engine, peers
        engine.destroy()


def bodies(peer: ScriptedHTTP, path: str) -> list[dict]:
    return [json.loads(r.body or b"{}") for r in peer.calls("POST", path)]


def meta() -> WeightUpdateMeta:
    return WeightUpdateMeta(
        type="xccl",
        nccl_master_address="10.0.0.7",
        nccl_master_port=29511,
        nccl_group_name="update_weight_group",
        gen_tp_size=2,
        gen_pp_size=1,
        gen_n_servers=2,
    )


def test_backend_kind_follows_the_allocation():
    assert (
        type(RemoteSGLangEngine(InferenceEngineConfig(backend="sglang:d4t2")).backend)
        is SGLangBackend
    )
    assert type(RemoteSGLangEngine(InferenceEngineConfig(backend="hf:d1")).backend) is HFBackend


def test_generation_request_fields():
    g = GenerationHyperparameters(
        temperature=0.7,
        top_p=0.9,
        top_k=50,
        max_new_tokens=99,
        stop_token_ids=[2],
        frequency_penalty=0.1,
        stop=["</s>"],
        seed=7,
        lora_name="adapter",
    )
    request = SGLangBackend().build_generation_request(
        ModelRequest(input_ids=[1, 2, 3], gconfig=g), max_new_tokens=64, version=3, with_lora=True
    )
    assert request.endpoint == "/generate"
    assert request.payload == {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "top_p": 0.9,
            "top_k": 50,
            "max_new_tokens": 64,
            "temperature": 0.7,
            "stop_token_ids": [2],
            "ignore_eos": False,
            "skip_special_tokens": True,
            "frequency_penalty": 0.1,
            "stop": ["</s>"],
            "sampling_seed": 7,
        },
        "return_logprob": True,
        "stream": False,
        "lora_path": "adapter-v3",
    }
    greedy = SGLangBackend().build_generation_request(
        ModelRequest(input_ids=[1], gconfig=GenerationHyperparameters(greedy=True)), 5, 0
    )
    assert greedy.payload["sampling_params"]["temperature"] == 0.0
    assert "lora_path" not in greedy.payload


def test_generation_response_parsing():
    backend = SGLangBackend()
    ok = {
        "output_ids": [5, 6],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 6},
            "output_token_logprobs": [[-0.5, 5, None], [-1.5, 6, None]],
        },
    }
    result = backend.parse_generation_response(ok)
    assert (result.output_tokens, result.output_logprobs, result.stop_reason) == (
        [5, 6],
        [-0.5, -1.5],
        "stop",
    )
    before_prefill = {
        "meta_info": {
            "finish_reason": {"type": "abort", "message": "Abort before prefill"},
            "output_token_logprobs": [[-0.1, 9, None]],
        }
    }
    assert backend.parse_generation_response(before_prefill).output_tokens == []
    with pytest.raises(RuntimeError, match="non-finite"):
        backend.parse_generation_response(
            {
                "meta_info": {
                    "finish_reason": {"type": "length"},
                    "output_token_logprobs": [[float("nan"), 1, None]],
                }
            }
        )
    with pytest.raises(RuntimeError, match="disagree"):
        backend.parse_generation_response(
            {
                "output_ids": [1, 2],
                "meta_info": {
                    "finish_reason": {"type": "length"},
                    "output_token_logprobs": [[-1.0, 1, None]],
                },
            }
        )


def test_init_weights_update_group(two_servers):
    engine, peers = two_servers
    engine.init_weights_update_group(meta()).result()
    # SGLang's rule, tp 2 per server: rank offsets 1 and 3, world = 4 server ranks + trainer
    for index, peer in enumerate(peers):
        assert bodies(peer, "/init_weights_update_group") == [
            {
                "master_address": "10.0.0.7",
                "master_port": 29511,
                "backend": "nccl",
                "rank_offset": 1 + index * 2,
                "world_size": 5,
                "group_name": "update_weight_group",
            }
        ]


def test_a_worker_numbers_its_servers_from_its_first_index(two_servers):
    engine, peers = two_servers
    engine.init_weights_update_group(
        dataclasses.replace(meta(), gen_n_servers=4), first_server_index=2
    ).result()
    offsets = [bodies(peer, "/init_weights_update_group")[0]["rank_offset"] for peer in peers]
    assert offsets == [5, 7]  # servers 2 and 3 of 4, tp 2


def test_pipeline_stages_do_not_widen_the_group():
    # SGLang repeats TP ranks in every pipeline stage: p never enters the rank rule
    m = WeightUpdateMeta(gen_tp_size=4, gen_pp_size=2, gen_n_servers=3)
    payload = SGLangBackend().build_init_weights_group_request(2, m).payload
    assert (payload["rank_offset"], payload["world_size"]) == (9, 13)
    assert "pp_rank" not in payload
    with pytest.raises(ValueError, match="server index 3 outside the 3 rollout servers"):
        SGLangBackend().build_init_weights_group_request(3, m)


def test_update_weights_from_distributed(two_servers):
    engine, peers = two_servers
    specs = [
        ParamSpec("model.embed_tokens.weight", (1024, 64), "bfloat16"),
        ParamSpec("lm_head.weight", (1024, 64), "bfloat16"),
    ]
    engine.update_weights_from_distributed(meta(), specs).result()
    for peer in peers:
        assert bodies(peer, "/update_weights_from_distributed") == [
            {
                "names": ["model.embed_tokens.weight", "lm_head.weight"],
                "dtypes": ["bfloat16", "bfloat16"],
                "shapes": [[1024, 64], [1024, 64]],
                "group_name": "update_weight_group",
                "abort_all_requests": True,
            }
        ]


def test_collective_calls_are_single_attempt(two_servers):
    engine, peers = two_servers
    peers[1].routes[("POST", "/init_weights_update_group")].clear()
    peers[1].on("POST", "/init_weights_update_group", reply(500, text="boom"), reply(200, {}))
    with pytest.raises(RuntimeError, match="HTTP 500"):
        engine.init_weights_update_group(meta()).result()
    assert len(peers[1].calls("POST", "/init_weights_update_group")) == 1


def test_barrier_abort_memory_and_disk(two_servers):
    engine, peers = two_servers
    engine.begin_weight_update(3)
    engine.begin_weight_update(3)  # closing a closed barrier sends nothing
    engine.end_weight_update(3)
    engine.abort_all()
    engine.offload(["weights", "kv_cache"])
    engine.onload()
    engine.update_weights_from_disk(WeightUpdateMeta(type="disk", path="/ckpt/v3")).result()
    for peer in peers:
        assert bodies(peer, "/pause_generation") == [{}, {"mode": "in_place"}]
        assert bodies(peer, "/continue_generation") == [{}]
        assert bodies(peer, "/update_weight_version") == [
            {"new_version": "3", "abort_all_requests": False}
        ]
        assert bodies(peer, "/abort_request") == [{"abort_all": True}]
        assert bodies(peer, "/release_memory_occupation") == [{"tags": ["weights", "kv_cache"]}]
        assert bodies(peer, "/resume_memory_occupation") == [{}]
        assert bodies(peer, "/update_weights_from_disk") == [
            {"model_path": "/ckpt/v3", "abort_all_requests": True}
        ]


def test_fan_out_retries_then_fails(two_servers):
    engine, peers = two_servers
    peers[0].routes[("POST", "/continue_generation")].clear()
    peers[0].on("POST", "/continue_generation", reply(503), reply(200, {}))
    engine.client.continue_servers()  # the second attempt succeeds
    assert len(peers[0].calls("POST", "/continue_generation")) == 2
    peers[0].routes[("POST", "/abort_request")].clear()
    peers[0].on("POST", "/abort_request", reply(500))
    with pytest.raises(RuntimeError, match="abort_request"):
        engine.abort_all()
    assert len(peers[0].calls("POST", "/abort_request")) == 3


def test_sticky_routing_and_round_robin(two_servers):
    engine, _ = two_servers
    first = engine.client.choose_server("rid-1")
    assert engine.client.choose_server("rid-1") == first
    second = engine.client.choose_server("rid-2")
    assert second != first and engine.client.choose_server("rid-2") == second
    for i in range(200):
        engine.client.choose_server(f"other-{i}")
    assert len(engine.client._sticky) == 128


def test_server_launch_commands():
    sglang = SGLangConfig(
        model_path="/m",
        context_length=4096,
        random_seed=3,
        dtype="bfloat16",
        max_running_requests=8,
    )
    cmd = SGLangBackend().launch_command(
        SGLangBackend().server_args(sglang, "10.0.0.1", 3000, tp_size=2)
    )
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    assert "--tp-size" in cmd and "--port" in cmd and "3000" in cmd
    hf = HFBackend().launch_command(HFBackend().server_args(sglang, "127.0.0.1", 3001))
    assert hf[1:] == [
        "-m",
        "areal.inference.server",
        "--model-path",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "3001",
        "--dtype",
        "bfloat16",
        "--context-length",
        "4096",
        "--max-running-requests",
        "8",
        "--random-seed",
        "3",
        "--tp-size",
        "1",
    ]
    # the embedded server joins weight-update groups with t ranks (the model stays on one)
    assert HFBackend().server_args(sglang, "h", 1, tp_size=2)["tp_size"] == 2


def test_fan_out_never_retries_a_refused_key(two_servers):
    engine, peers = two_servers
    peers[0].routes[("POST", "/continue_generation")].clear()
    peers[0].on("POST", "/continue_generation", reply(403))
    with pytest.raises(RuntimeError, match=API_KEY_ENV):
        engine.client.continue_servers()
    assert len(peers[0].calls("POST", "/continue_generation")) == 1  # request_retries is 3
