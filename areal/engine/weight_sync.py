"""Weight sync from a train engine to the rollout side: disk or NCCL (shared by engines).

:class:`RolloutWeightSync` is a mixin for :class:`~areal.api.engine_api.TrainEngine`
implementations. The engine provides ``rollout_engine`` (set by :meth:`connect_engine`),
``_weight_group``, ``_cpu_group`` (a gloo group over all ranks), ``_version``, ``device``,
``config.dtype``, ``_save_hf(path)`` (HF export, a collective) and
``_weights_for_inference()``: ``(hf_name, tensor)`` pairs on every rank (a collective;
only rank 0's tensors are sent).

* disk: rank 0 pauses generation and asks the rollout side to load ``meta.path``; every rank
  takes part in the HF save; rank 0 publishes the version's name-resolve key (the load
  waits for it), waits for the load and continues generation.
* xccl: rank 0 joins one weight-update group with every TP rank of every inference server
  (:meth:`connect_engine`; NCCL on GPUs, gloo on CPU, see :mod:`areal.utils.nccl_group`),
  then sends the weights in buckets of at most ``weight_chunked_mem_mb``: for each bucket
  the servers are told the names, shapes and dtypes, then the tensors are broadcast.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from areal.api.engine_api import InferenceEngine
from areal.api.io_struct import ParamSpec, WeightUpdateMeta
from areal.utils import name_resolve, names
from areal.utils.network import find_free_port, gethostip

__all__ = ["RolloutWeightSync"]


class RolloutWeightSync:
    """Mixin: ``connect_engine`` and ``update_weights`` of a train engine (see module doc)."""

    rollout_engine: InferenceEngine | None
    _weight_group: Any

    def _weights_for_inference(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every engine using this mixin defines it (see the module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} must define _weights_for_inference")

    def connect_engine(self, rollout_engine: InferenceEngine, meta: WeightUpdateMeta) -> None:
        self.rollout_engine = rollout_engine
        self._weight_meta = meta
        if meta.type == "xccl":
            self._init_weight_group(meta)

    def _init_weight_group(self, meta: WeightUpdateMeta) -> None:
        if dist.get_rank() == 0:
            if not meta.nccl_master_address or meta.nccl_master_address == "127.0.0.1":
                meta.nccl_master_address = gethostip()
            meta.nccl_master_port = find_free_port()
            meta.comm_backend = "nccl" if self.device.type == "cuda" else "gloo"
            joined = self.rollout_engine.init_weights_update_group(meta)
            self._weight_group = _join_weight_group(meta, joined)
        dist.barrier(group=self._cpu_group)

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        if self.rollout_engine is None:
            raise RuntimeError("connect_engine() the rollout engine before update_weights()")
        if meta.type == "disk":
            self._update_weights_from_disk(meta)
        elif meta.type == "xccl":
            self._update_weights_from_distributed(meta)
        else:
            raise ValueError(f"weight update type {meta.type!r} is not supported; disk or xccl")

    def _update_weights_from_disk(self, meta: WeightUpdateMeta) -> None:
        version = self._version if meta.version is None else meta.version
        meta = dataclasses.replace(meta, version=version)
        if meta.path is None:
            raise ValueError("a disk weight update needs WeightUpdateMeta.path")
        rank0 = dist.get_rank() == 0
        loaded = None
        if rank0:
            self.rollout_engine.pause_generation()
            loaded = self.rollout_engine.update_weights_from_disk(meta)
        self._save_hf(meta.path)
        if rank0:
            exp, trial = _experiment(self.rollout_engine)
            if exp and trial:
                name_resolve.add(
                    names.update_weights_from_disk(exp, trial, version),
                    str(time.time()),
                    replace=True,
                )
            loaded.result()
            self.rollout_engine.continue_generation()
        dist.barrier(group=self._cpu_group)

    def _update_weights_from_distributed(self, meta: WeightUpdateMeta) -> None:
        rank0 = dist.get_rank() == 0
        dtype = _dtype(self.config.dtype)
        budget = meta.weight_chunked_mem_mb * 1024 * 1024
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        if rank0:
            self.rollout_engine.pause_generation()

        def flush() -> None:
            nonlocal bucket, size
            if rank0 and bucket:
                specs = [
                    ParamSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch."))
                    for n, t in bucket
                ]
                received = self.rollout_engine.update_weights_from_distributed(meta, specs)
                _send_bucket(self._weight_group, [t for _, t in bucket], received)
            bucket, size = [], 0

        # every rank takes part in producing the tensors; rank 0 sends them
        for name, full in self._weights_for_inference():
            if not rank0:
                continue
            tensor = full.to(device=self.device, dtype=dtype).contiguous()
            if size and size + tensor.numel() * tensor.element_size() > budget:
                flush()
            bucket.append((name, tensor))
            size += tensor.numel() * tensor.element_size()
        flush()
        if rank0:
            self.rollout_engine.continue_generation()
        dist.barrier(group=self._cpu_group)


def _send_bucket(
    group: Any, tensors: list[torch.Tensor], received: concurrent.futures.Future
) -> None:
    """Broadcast one bucket while the servers receive it (their HTTP call is ``received``).

    A server that refuses the bucket never enters the broadcast, so the trainer would
    wait in it until the group's timeout; a refusal fails the update at once.
    """
    from areal.utils.nccl_group import broadcast

    def send() -> None:
        if tensors and tensors[0].is_cuda:
            torch.cuda.set_device(tensors[0].device)  # the current device is per thread
        for tensor in tensors:
            broadcast(group, tensor, src=0)
        if tensors and tensors[0].is_cuda:
            torch.cuda.synchronize()

    _alongside(
        received,
        send,
        "weight-bucket-send",
        "an inference server refused a weight bucket; the weight-update group can no "
        "longer be used",
    )


def _join_weight_group(meta: WeightUpdateMeta, joined: concurrent.futures.Future):
    """Join the weight-update group as rank 0 while the servers join theirs.

    The trainer's rendezvous store waits for every server rank; a server that fails to
    join (its HTTP call errors) fails this call at once instead of leaving rank 0 waiting
    for the rendezvous timeout.
    """
    from areal.utils.nccl_group import init_weight_update_group

    return _alongside(
        joined,
        lambda: init_weight_update_group(
            backend=meta.comm_backend,
            master_address=meta.nccl_master_address,
            master_port=meta.nccl_master_port,
            rank=0,
            world_size=meta.group_world_size,
            group_name=meta.nccl_group_name,
        ),
        "weight-group-join",
        "an inference server failed to join the weight-update group",
    )


def _alongside(
    servers: concurrent.futures.Future, work: Callable[[], Any], name: str, failure: str
) -> Any:
    """Run the trainer's half of a collective (``work``) on a helper thread while the
    servers run theirs (``servers``, their HTTP calls); a server failure fails it at once.

    Returns ``work()``'s result once both halves are done.
    """
    done: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            done.set_result(work())
        except BaseException as e:  # reported through the future
            done.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    concurrent.futures.wait([servers, done], return_when=concurrent.futures.FIRST_EXCEPTION)
    if servers.done() and servers.exception() is not None:
        raise RuntimeError(f"{failure}: {servers.exception()}")
    result = done.result()
    servers.result()
    return result


def _experiment(engine: Any) -> tuple[str, str]:
    config = getattr(engine, "config", None)
    return getattr(config, "experiment_name", "") or "", getattr(config, "trial_name", "") or ""


def _dtype(name: str) -> torch.dtype:
    from areal.engine.fsdp_engine import to_dtype

    return to_dtype(name)
