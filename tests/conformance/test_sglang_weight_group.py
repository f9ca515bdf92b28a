"""The weight-update group forms between this port's trainer and SGLang's own server-side code.

Each SGLang TP rank is a process forked by the version's worker that does what SGLang's
scheduler does: it joins its server's default (TP) group, then runs SGLang's own model-runner
``init_weights_update_group`` (``rank = rank_offset + tp_rank``, ``init_custom_process_group``
with ``init_method=tcp://addr:port`` over gloo) and ``update_weights_from_distributed``
(``torch.distributed.broadcast(tensor, src=0, group=group)``), with the fields SGLang's route
parsed from the requests our ``SGLangBackend`` built. The trainer is
:func:`areal.utils.nccl_group.init_weight_update_group` as rank 0 in this process. Every rank
must receive every tensor bit-exactly. A mixed group also puts one embedded server
(:func:`areal.inference.weight_group.join_weight_update_group`) beside an SGLang-built one,
under either trainer: ours, or SGLang's trainer-facing side (``init_custom_process_group`` as
rank 0 plus ``torch.distributed.broadcast``).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from areal.api.io_struct import ParamSpec, WeightUpdateMeta
from areal.engine.sglang_backend import SGLangBackend
from areal.utils.network import find_free_ports
from tests.conformance.group_ranks import (
    TENSORS,
    embedded_server,
    expected_digests,
    forkserver,
    trainer_broadcast,
)
from tests.conformance.worker_client import SGLangWorker, unwrap

pytestmark = pytest.mark.sglang

BACKEND = SGLangBackend()
TIMEOUT_S = 60.0
JOIN_FIELDS = ("master_address", "master_port", "rank_offset", "world_size", "group_name")


def xccl_meta(n_servers: int, tp: int, port: int) -> WeightUpdateMeta:
    return WeightUpdateMeta(
        type="xccl",
        nccl_master_address="127.0.0.1",
        nccl_master_port=port,
        nccl_group_name=f"conformance-{uuid.uuid4().hex[:8]}",
        comm_backend="gloo",
        gen_tp_size=tp,
        gen_n_servers=n_servers,
    )


def parsed_by_sglang(sglang: SGLangWorker, endpoint: str, payload: dict) -> dict[str, Any]:
    """The request fields as SGLang's route parsed them (what its scheduler would receive)."""
    answer = sglang.call("route", method="POST", path=endpoint, body=payload)
    assert answer["status"] == 200, answer["text"]
    return {k: unwrap(v) for k, v in answer["calls"][0]["fields"].items()}


def sglang_server_specs(
    sglang: SGLangWorker, meta: WeightUpdateMeta, servers: list[int], tp_ports: list[int]
) -> list[dict[str, Any]]:
    """One spec per TP rank of each SGLang-built server, from SGLang's parse of our requests."""
    specs = [ParamSpec(name, tuple(shape), dtype) for name, dtype, shape in TENSORS]
    [update] = BACKEND.build_distributed_weight_update_requests(meta, specs).requests
    bucket = parsed_by_sglang(sglang, update.endpoint, update.payload)
    out = []
    for server, tp_port in zip(servers, tp_ports, strict=True):
        init = BACKEND.build_init_weights_group_request(server, meta)
        join = parsed_by_sglang(sglang, init.endpoint, init.payload)
        for tp_rank in range(meta.gen_tp_size):
            out.append(
                {
                    "role": "sglang_server_rank",
                    "name": f"sglang-server{server}-tp{tp_rank}",
                    "server": server,
                    "tp_rank": tp_rank,
                    "tp_size": meta.gen_tp_size,
                    "tp_group_port": tp_port,
                    "backend": join["backend"],
                    **{key: join[key] for key in JOIN_FIELDS},
                    **{key: bucket[key] for key in ("names", "dtypes", "shapes")},
                }
            )
    return out


def assert_sglang_ranks_received(results: dict, specs: list[dict], meta: WeightUpdateMeta) -> None:
    expected = expected_digests()
    for spec in specs:
        result = results[spec["name"]]
        assert result["ok"], result.get("error")
        assert result["joined"], result["message"]
        # SGLang's rule: server i's TP rank r is group rank 1 + i * t + r
        assert result["group_rank"] == 1 + spec["server"] * meta.gen_tp_size + spec["tp_rank"]
        assert result["group_size"] == meta.group_world_size
        assert result["updated"], result["update_message"]
        assert result["received"] == expected, spec["name"]


@pytest.mark.parametrize(("n_servers", "tp"), [(1, 1), (1, 2), (2, 1), (2, 2)])
def test_sglang_ranks_join_our_trainer_and_receive_bit_exactly(
    sglang: SGLangWorker, tmp_path: Path, n_servers: int, tp: int
):
    master_port, *tp_ports = find_free_ports(1 + n_servers)
    meta = xccl_meta(n_servers, tp, master_port)
    specs = sglang_server_specs(sglang, meta, list(range(n_servers)), tp_ports)
    assert len(specs) == n_servers * tp == meta.group_world_size - 1
    pids = sglang.call("ranks_start", specs=specs, result_dir=str(tmp_path))
    try:
        sent = trainer_broadcast(
            "127.0.0.1", master_port, meta.group_world_size, meta.nccl_group_name, TIMEOUT_S
        )
    finally:
        results = sglang.call(
            "ranks_wait",
            pids=pids,
            result_dir=str(tmp_path),
            names=[s["name"] for s in specs],
            wait_s=TIMEOUT_S,
            timeout_s=TIMEOUT_S + 30,
        )
    assert sent == expected_digests()
    assert_sglang_ranks_received(results, specs, meta)


@pytest.mark.parametrize("trainer", ["sglang", "ours"])
@pytest.mark.parametrize("tp", [1, 2])
def test_embedded_server_joins_beside_an_sglang_server(
    sglang: SGLangWorker, tmp_path: Path, trainer: str, tp: int
):
    """Server 0 is SGLang-built, server 1 is our embedded server; one group, one broadcast."""
    master_port, tp_port = find_free_ports(2)
    meta = xccl_meta(2, tp, master_port)
    specs = sglang_server_specs(sglang, meta, [0], [tp_port])
    worker_specs = list(specs)
    if trainer == "sglang":
        worker_specs.append(
            {
                "role": "sglang_trainer",
                "name": "sglang-trainer",
                "backend": "gloo",
                "master_address": "127.0.0.1",
                "master_port": master_port,
                "world_size": meta.group_world_size,
                "group_name": meta.nccl_group_name,
            }
        )
    init = BACKEND.build_init_weights_group_request(1, meta)
    embedded = parsed_by_sglang(sglang, init.endpoint, init.payload)  # the same fields
    embedded_spec = {key: embedded[key] for key in JOIN_FIELDS} | {
        "backend": embedded["backend"],
        "tp_size": tp,
        "name": "embedded-server1",
        "timeout_s": TIMEOUT_S,
    }
    context = forkserver()
    queue = context.Queue()
    process = context.Process(target=embedded_server, args=(embedded_spec, queue))
    process.start()
    pids = sglang.call("ranks_start", specs=worker_specs, result_dir=str(tmp_path))
    sent = None
    try:
        if trainer == "ours":
            sent = trainer_broadcast(
                "127.0.0.1", master_port, meta.group_world_size, meta.nccl_group_name, TIMEOUT_S
            )
    finally:
        results = sglang.call(
            "ranks_wait",
            pids=pids,
            result_dir=str(tmp_path),
            names=[s["name"] for s in worker_specs],
            wait_s=TIMEOUT_S,
            timeout_s=TIMEOUT_S + 30,
        )
        _, embedded_result = queue.get(timeout=TIMEOUT_S)
        process.join(timeout=30)
    if trainer == "sglang":
        assert results["sglang-trainer"]["ok"], results["sglang-trainer"].get("error")
        sent = results["sglang-trainer"]["sent"]
    assert sent == expected_digests()
    assert_sglang_ranks_received(results, specs, meta)
    assert embedded_result["ok"], embedded_result.get("error")
    assert embedded_result["ranks"] == [1 + tp + r for r in range(tp)]
    assert embedded_result["received"] == expected_digests()
