"""This port's ranks of a weight-update group, for tests that form real gloo groups.

No SGLang here: the trainer side (:func:`areal.utils.nccl_group.init_weight_update_group`,
rank 0, in the test process) and the embedded server's side
(:func:`areal.inference.weight_group.join_weight_update_group`, one process per server,
started from a forkserver so each costs a fork, not a fresh ``import torch``). The tensors
every test broadcasts, and the digest that compares them bit for bit, live here too; the
SGLang worker imports them so both sides build the same bytes.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import multiprocessing.context
import traceback
from typing import Any

import torch

__all__ = [
    "TENSORS",
    "digest",
    "embedded_server",
    "expected_digests",
    "forkserver",
    "make_tensor",
    "trainer_broadcast",
]

# (name, dtype, shape): several dtypes and ranks, as a weight bucket has
TENSORS: tuple[tuple[str, str, list[int]], ...] = (
    ("model.embed_tokens.weight", "bfloat16", [8, 4]),
    ("model.norm.weight", "float32", [16]),
    ("lm_head.weight", "float16", [3, 5]),
    ("model.layers.0.mlp.gate_proj.weight", "float32", [2, 3, 4]),
    ("rotary.inv_freq_steps", "int64", [6]),
)


def make_tensor(name: str, dtype: str, shape: list[int]) -> torch.Tensor:
    """The tensor sent for ``name``: a pattern seeded by the name, equal in every process."""
    seed = int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 3
    return values.to(getattr(torch, dtype))


def digest(tensor: torch.Tensor) -> str:
    """SHA-256 of dtype, shape and raw bytes: equal digests mean bit-identical tensors."""
    raw = tensor.detach().contiguous().view(torch.uint8).numpy().tobytes()
    head = f"{tensor.dtype}|{tuple(tensor.shape)}|".encode()
    return hashlib.sha256(head + raw).hexdigest()


def expected_digests() -> dict[str, str]:
    return {name: digest(make_tensor(name, dtype, shape)) for name, dtype, shape in TENSORS}


def trainer_broadcast(
    master_address: str, master_port: int, world_size: int, group_name: str, timeout_s: float
) -> dict[str, str]:
    """The trainer: host the group as rank 0, broadcast :data:`TENSORS`, leave the group."""
    from areal.utils.nccl_group import broadcast, destroy_group, init_weight_update_group

    group = init_weight_update_group(
        backend="gloo",
        master_address=master_address,
        master_port=master_port,
        rank=0,
        world_size=world_size,
        group_name=group_name,
        timeout_s=timeout_s,
    )
    try:
        sent = {}
        for name, dtype, shape in TENSORS:
            tensor = make_tensor(name, dtype, shape)
            broadcast(group, tensor, src=0)
            sent[name] = digest(tensor)
        return sent
    finally:
        destroy_group(group)


def embedded_server(spec: dict[str, Any], results: Any) -> None:
    """One embedded server (a forkserver child): join with ``tp_size`` ranks, receive.

    ``spec`` holds the fields of its ``/init_weights_update_group`` request plus ``tp_size``
    and ``name``; puts ``(name, result)`` on ``results``.
    """
    from areal.inference.weight_group import join_weight_update_group

    try:
        ranks = join_weight_update_group(
            master_address=spec["master_address"],
            master_port=spec["master_port"],
            rank_offset=spec["rank_offset"],
            world_size=spec["world_size"],
            group_name=spec["group_name"],
            backend=spec["backend"],
            devices=[torch.device("cpu")] * spec["tp_size"],
            timeout_s=spec["timeout_s"],
        )
        try:
            shapes = [shape for _, _, shape in TENSORS]
            dtypes = [getattr(torch, dtype) for _, dtype, _ in TENSORS]
            got = ranks.receive(shapes, dtypes, timeout_s=spec["timeout_s"])
            received = {name: digest(t) for (name, _, _), t in zip(TENSORS, got, strict=True)}
            results.put((spec["name"], {"ok": True, "ranks": ranks.ranks, "received": received}))
        finally:
            ranks.destroy()
    except BaseException:
        results.put((spec["name"], {"ok": False, "error": traceback.format_exc()[-4000:]}))


def forkserver() -> multiprocessing.context.ForkServerContext:
    """A forkserver context that has torch and the join code imported before it forks."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "areal.inference.weight_group", __name__])
    return context
