"""Every request ``SGLangBackend`` builds goes through SGLang's own FastAPI app and parses as sent.

A stub tokenizer manager stands behind the real routes and records the request object each
route built (``GenerateReqInput``, ``InitWeightsUpdateGroupReqInput``, ...): every field we
send must come back under its own name with its value and type (a key SGLang does not know
would be dropped silently by its parser, so that is checked too), and the route must answer
200. For ``/generate`` the stub also runs what SGLang's tokenizer manager runs on the request
(``normalize_batch_and_arguments``, then ``SamplingParams(**sampling_params)``, ``normalize``,
``verify``), so a sampling key SGLang does not know (a ``TypeError``) or a value it refuses
fails the route.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from areal.api.cli_args import GenerationHyperparameters
from areal.api.io_struct import HttpRequest, ModelRequest, ParamSpec, WeightUpdateMeta
from areal.engine.sglang_backend import SGLangBackend
from tests.conformance.worker_client import SGLangWorker, type_tree, type_tree_of, unwrap

pytestmark = pytest.mark.sglang

BACKEND = SGLangBackend()

# the request object SGLang's route parses each endpoint's body into
ROUTE_CLASS = {
    "/generate": "GenerateReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/init_weights_update_group": "InitWeightsUpdateGroupReqInput",
    "/update_weights_from_distributed": "UpdateWeightsFromDistributedReqInput",
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/update_weight_version": "UpdateWeightVersionReqInput",
    "/abort_request": "AbortReq",
    "/release_memory_occupation": "ReleaseMemoryOccupationReqInput",
    "/resume_memory_occupation": "ResumeMemoryOccupationReqInput",
}

EVERY_SAMPLING_OPTION = GenerationHyperparameters(
    max_new_tokens=64,
    min_new_tokens=2,
    greedy=True,
    top_p=0.9,
    top_k=40,
    temperature=0.7,
    stop_token_ids=[2, 7],
    ignore_eos=True,
    skip_special_tokens=False,
    stop=["</answer>", "\n\n"],
    frequency_penalty=0.5,
    seed=1234,
)


def _generation(gconfig: GenerationHyperparameters, with_lora: bool = False) -> list[HttpRequest]:
    request = ModelRequest(input_ids=[11, 12, 13, 14], gconfig=gconfig)
    return [
        BACKEND.build_generation_request(request, max_new_tokens=16, version=3, with_lora=with_lora)
    ]


def _xccl_meta(n_servers: int, tp: int, backend: str = "gloo") -> WeightUpdateMeta:
    return WeightUpdateMeta(
        type="xccl",
        nccl_master_address="10.1.2.3",
        nccl_master_port=29511,
        nccl_group_name="update_weight_group",
        comm_backend=backend,
        gen_tp_size=tp,
        gen_n_servers=n_servers,
    )


def _init_groups(n_servers: int, tp: int, backend: str = "gloo") -> list[HttpRequest]:
    meta = _xccl_meta(n_servers, tp, backend)
    return [BACKEND.build_init_weights_group_request(i, meta) for i in range(n_servers)]


SPECS = [
    ParamSpec("model.embed_tokens.weight", (8, 4), "bfloat16"),
    ParamSpec("model.norm.weight", (16,), "float32"),
    ParamSpec("lm_head.weight", (3, 5), "float16"),
]

REQUESTS: dict[str, Callable[[], list[HttpRequest]]] = {
    "generate-default-gconfig": lambda: _generation(GenerationHyperparameters()),
    "generate-every-sampling-option": lambda: _generation(EVERY_SAMPLING_OPTION),
    # the field only: serving it needs --enable-lora and an adapter loaded under that name
    "generate-with-lora": lambda: _generation(GenerationHyperparameters(), with_lora=True),
    "update-weights-from-disk": lambda: (
        BACKEND.build_disk_weight_update_requests(
            WeightUpdateMeta(type="disk", path="/ckpt/actor/step-3")
        ).requests
    ),
    "init-group-1-server-tp1": lambda: _init_groups(1, 1),
    "init-group-1-server-tp2": lambda: _init_groups(1, 2),
    "init-group-2-servers-tp1": lambda: _init_groups(2, 1),
    "init-group-2-servers-tp2": lambda: _init_groups(2, 2),
    "init-group-4-servers-tp2-nccl": lambda: _init_groups(4, 2, backend="nccl"),
    "update-weights-from-distributed": lambda: (
        BACKEND.build_distributed_weight_update_requests(_xccl_meta(2, 2), SPECS).requests
    ),
    "pause": BACKEND.pause_requests,
    "continue": lambda: [BACKEND.continue_request()],
    "abort-all": lambda: [BACKEND.abort_all_request()],
    "offload-all": lambda: [BACKEND.offload_request(None)],
    "offload-tags": lambda: [BACKEND.offload_request(["weights", "kv_cache"])],
    "onload-all": lambda: [BACKEND.onload_request(None)],
    "onload-tags": lambda: [BACKEND.onload_request(["weights"])],
}


def send(sglang: SGLangWorker, request: HttpRequest) -> dict:
    """The route's answer and the one request object it handed the tokenizer manager."""
    answer = sglang.call(
        "route", method=request.method, path=request.endpoint, body=request.payload
    )
    assert answer["status"] == 200, f"{request.endpoint}: {answer['status']} {answer['text']}"
    assert len(answer["calls"]) == 1, answer
    return answer["calls"][0]


@pytest.mark.parametrize("case", list(REQUESTS))
def test_route_answers_200_and_parses_every_field_as_sent(sglang: SGLangWorker, case: str):
    for request in REQUESTS[case]():
        parsed = send(sglang, request)
        assert parsed["class"] == ROUTE_CLASS[request.endpoint]
        fields = parsed["fields"]
        for key, sent in request.payload.items():
            assert key in fields, f"{parsed['class']} has no field {key!r}: SGLang drops it"
            assert unwrap(fields[key]) == sent, key
            assert type_tree(fields[key]) == type_tree_of(sent), key


def test_group_request_fields_arrive_as_sglangs_types(sglang: SGLangWorker):
    """The rank arithmetic reaches SGLang as ints (``master_port`` was once sent as a str)."""
    for request in _init_groups(2, 2):
        fields = send(sglang, request)["fields"]
        assert {k: fields[k]["type"] for k in ("master_port", "rank_offset", "world_size")} == {
            "master_port": "int",
            "rank_offset": "int",
            "world_size": "int",
        }
        assert fields["backend"] == {"value": "gloo", "type": "str"}


def test_the_weight_version_route_takes_our_body(sglang: SGLangWorker):
    """``end_weight_update`` sets each server's weight version; 0.5.10 stores it itself,
    0.5.23 hands the parsed request to the tokenizer manager."""
    request = BACKEND.weight_version_request(3)
    answer = sglang.call(
        "route", method=request.method, path=request.endpoint, body=request.payload
    )
    assert answer["status"] == 200, answer["text"]
    for call in answer["calls"]:  # nothing is aborted: abort_all_requests is false
        assert call["class"] == ROUTE_CLASS[request.endpoint]
        assert unwrap(call["fields"]["new_version"]) == "3"
        assert unwrap(call["fields"]["abort_all_requests"]) is False


def test_pause_modes_and_memory_tags_mean_what_the_client_intends(sglang: SGLangWorker):
    abort_pause, in_place_pause = (send(sglang, r)["fields"] for r in BACKEND.pause_requests())
    # {} takes SGLang's default mode, abort: in-flight requests return before the second call
    assert unwrap(abort_pause["mode"]) == "abort"
    assert unwrap(in_place_pause["mode"]) == "in_place"
    assert unwrap(send(sglang, BACKEND.offload_request(None))["fields"]["tags"]) is None  # all
    assert unwrap(send(sglang, BACKEND.abort_all_request())["fields"]["abort_all"]) is True


def expected_sampling(params: dict) -> dict:
    """What SGLang's ``SamplingParams`` should hold for our params, in its own terms."""
    greedy = params["temperature"] == 0.0
    expected = {
        "max_new_tokens": params["max_new_tokens"],
        # temperature 0 is SGLang's greedy: it samples with temperature 1 from the top 1 token
        "temperature": 1.0 if greedy else params["temperature"],
        "top_k": 1 if greedy else params["top_k"],
        "top_p": params["top_p"],
        "stop_token_ids": sorted(params["stop_token_ids"]) or None,  # a set; [] means none
        "ignore_eos": params["ignore_eos"],
        "skip_special_tokens": params["skip_special_tokens"],
        "frequency_penalty": params["frequency_penalty"],
        "min_new_tokens": params.get("min_new_tokens", 0),
        "stop_strs": params.get("stop") or [],  # normalize() moves stop into stop_strs
        "sampling_seed": params.get("sampling_seed"),
    }
    return expected


@pytest.mark.parametrize("case", ["generate-default-gconfig", "generate-every-sampling-option"])
def test_sglang_sampling_params_take_our_sampling_params(sglang: SGLangWorker, case: str):
    [request] = REQUESTS[case]()
    params = request.payload["sampling_params"]
    sampling = send(sglang, request)["sampling"]
    assert sampling["ok"], sampling["error"]
    got = {key: unwrap(sampling["fields"][key]) for key in expected_sampling(params)}
    assert got == expected_sampling(params)


def test_every_sampling_option_is_sent(sglang: SGLangWorker):
    """The every-option case really exercises every optional key the builder can send."""
    [request] = REQUESTS["generate-every-sampling-option"]()
    assert {"min_new_tokens", "stop", "sampling_seed"} <= set(request.payload["sampling_params"])
    assert request.payload["sampling_params"]["temperature"] == 0.0  # greedy


def test_default_sampling_params_need_no_server_tokenizer(sglang: SGLangWorker):
    """A server started with ``skip_tokenizer_init`` (arena_grpo.yaml) takes the default gconfig."""
    [request] = REQUESTS["generate-default-gconfig"]()
    params = request.payload["sampling_params"]
    assert sglang.call("sampling", params=params, with_tokenizer=False)["ok"]


# SGLang 0.5.23 refuses stop strings and min_new_tokens when the server has no tokenizer:
# it cannot decode to match a stop string, nor find the EOS to hold back. 0.5.10.post1 takes
# them at the HTTP layer (its scheduler then needs the tokenizer it does not have).
NEEDS_SERVER_TOKENIZER = {"0.5.10.post1": set(), "0.5.23": {"stop", "min_new_tokens"}}


@pytest.mark.parametrize("key", ["stop", "min_new_tokens"])
def test_sampling_keys_a_tokenizer_free_server_refuses(sglang: SGLangWorker, key: str):
    [request] = REQUESTS["generate-every-sampling-option"]()
    every = request.payload["sampling_params"]
    params = {k: v for k, v in every.items() if k not in ("stop", "min_new_tokens")}
    params[key] = every[key]
    answer = sglang.call("sampling", params=params, with_tokenizer=False)
    refused = key in NEEDS_SERVER_TOKENIZER[sglang.version]
    assert answer["ok"] is not refused, answer
    if refused:
        assert "skip_tokenizer_init" in answer["error"]


def test_unknown_sampling_key_is_a_type_error_in_sglang(sglang: SGLangWorker):
    """The premise of the key check above: SGLang does not ignore a key it does not know."""
    answer = sglang.call("sampling", params={"max_new_tokens": 4, "not_a_sampling_key": 1})
    assert not answer["ok"]
    assert answer["error"].startswith("TypeError")
