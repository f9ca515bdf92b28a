"""SGLang's rank rule for the weight-update group, in unit form (no SGLang needed).

SGLang joins TP rank ``r`` of a server with ``rank = rank_offset + r``, and the trainer is
rank 0. So for ``N`` servers of TP size ``t`` the requests must give ``world_size = 1 + N*t``
and server ``i`` ``rank_offset = 1 + i*t``: the servers' ranks are then exactly ``1..N*t``,
each once. The second test forms that group for real over gloo: the trainer side in this
process, each embedded server (its own join code) in its own process, one broadcast.
"""

from __future__ import annotations

import pytest

from areal.api.io_struct import WeightUpdateMeta
from areal.engine.sglang_backend import SGLangBackend
from areal.utils.network import find_free_port
from tests.conformance.group_ranks import (
    embedded_server,
    expected_digests,
    forkserver,
    trainer_broadcast,
)

SHAPES = [(n, t) for n in (1, 2, 4) for t in (1, 2)]
TIMEOUT_S = 60.0


def meta_for(n_servers: int, tp: int, port: int = 29500, group: str = "wu") -> WeightUpdateMeta:
    return WeightUpdateMeta(
        type="xccl",
        nccl_master_address="127.0.0.1",
        nccl_master_port=port,
        nccl_group_name=group,
        comm_backend="gloo",
        gen_tp_size=tp,
        gen_n_servers=n_servers,
    )


@pytest.mark.parametrize(("n_servers", "tp"), SHAPES)
def test_group_requests_follow_sglangs_rank_rule(n_servers: int, tp: int):
    meta = meta_for(n_servers, tp)
    payloads = [
        SGLangBackend().build_init_weights_group_request(i, meta).payload for i in range(n_servers)
    ]
    assert [p["world_size"] for p in payloads] == [1 + n_servers * tp] * n_servers
    assert [p["rank_offset"] for p in payloads] == [1 + i * tp for i in range(n_servers)]
    ranks = [p["rank_offset"] + tp_rank for p in payloads for tp_rank in range(tp)]
    assert sorted(ranks) == list(range(1, n_servers * tp + 1))  # each of 1..N*t exactly once


@pytest.mark.parametrize(("n_servers", "tp"), SHAPES)
def test_group_of_that_shape_forms_and_every_server_receives(n_servers: int, tp: int):
    port = find_free_port()
    meta = meta_for(n_servers, tp, port=port, group=f"wu-unit-{n_servers}x{tp}")
    context = forkserver()
    results = context.Queue()
    servers = []
    for i in range(n_servers):
        payload = SGLangBackend().build_init_weights_group_request(i, meta).payload
        spec = payload | {"tp_size": tp, "name": f"server{i}", "timeout_s": TIMEOUT_S}
        servers.append(context.Process(target=embedded_server, args=(spec, results)))
    for process in servers:
        process.start()
    try:
        sent = trainer_broadcast(
            "127.0.0.1", port, meta.group_world_size, meta.nccl_group_name, TIMEOUT_S
        )
    finally:
        received = dict(results.get(timeout=TIMEOUT_S) for _ in servers)
        for process in servers:
            process.join(timeout=30)
    assert sent == expected_digests()
    for i in range(n_servers):
        result = received[f"server{i}"]
        assert result["ok"], result.get("error")
        assert result["ranks"] == [1 + i * tp + r for r in range(tp)]
        # receive() returns once every TP rank's broadcast completed; rank 0's bytes checked
        assert result["received"] == expected_digests()
