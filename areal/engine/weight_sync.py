"""Weight sync from a train engine to the rollout side: disk or NCCL, both halves.

The controller runs the handshake (:func:`connect_weight_sync`, :func:`push_weights`): it
tells the rollout side to receive and the trainer ranks to send, *concurrently*, since an
NCCL collective needs both sides in it at once; the first failure of either side fails
the step at once instead of leaving the other waiting in the collective. Train ranks never
call the rollout side. The trainer brackets the push with the rollout side's
weight-update barrier (``begin_weight_update`` / ``end_weight_update``).

:class:`RolloutWeightSync` is the trainer's half, a mixin for
:class:`~areal.api.engine_api.TrainEngine` implementations. The engine provides
``_weight_group``, ``_cpu_group`` (a gloo group over all ranks), ``_version``, ``device``,
``config.dtype``, ``_save_hf(path)`` (HF export, a collective) and
``_weights_for_inference()``: ``(hf_name, tensor)`` pairs on every rank (a collective;
only rank 0's tensors are sent).

* disk: every rank takes part in the HF save of ``meta.path``; rank 0 then publishes the
  version's name-resolve key, which the rollout side's load waits for.
* xccl: rank 0 picks the group's address (:meth:`~RolloutWeightSync.weight_group_address`)
  and joins one weight-update group with every TP rank of every inference server (NCCL
  on GPUs, gloo on CPU, see :mod:`areal.utils.nccl_group`). The weights travel in
  buckets of at most ``weight_chunked_mem_mb``, planned once when the group is set up
  (:meth:`~RolloutWeightSync.weight_buckets`): for each bucket the servers are told the
  names, shapes and dtypes while rank 0 broadcasts the tensors, in plan order.

An engine given an inference engine in its own process
(:meth:`~RolloutWeightSync.connect_engine`, tests and benchmarks) runs the handshake
itself, bucket by bucket, inside that engine's barrier.
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

__all__ = ["RolloutWeightSync", "connect_weight_sync", "push_weights"]

JOIN_FAILURE = "an inference server failed to join the weight-update group"
BUCKET_FAILURE = (
    "an inference server refused a weight bucket; the weight-update group can no longer be used"
)
LOAD_FAILURE = "the inference servers failed to load the new weights"


# --- the controller's half ---


def connect_weight_sync(trainer: Any, rollout: Any, meta: WeightUpdateMeta) -> Any:
    """Set up weight sync between a train controller and a rollout controller.

    For ``xccl``: trainer rank 0 picks the group's address and backend (written into
    ``meta``), the servers and the trainer join the group concurrently, then the trainer
    plans the buckets. Returns the bucket plan (``None`` for ``disk``).
    """
    if meta.type != "xccl":
        return None
    filled = trainer.weight_group_address(meta)
    for field in ("nccl_master_address", "nccl_master_port", "comm_backend"):
        setattr(meta, field, getattr(filled, field))
    joined = _submit(rollout.init_weights_update_group, meta)
    _alongside(joined, lambda: trainer.join_weight_group(meta), JOIN_FAILURE)
    return trainer.weight_buckets(meta)


def push_weights(
    trainer: Any,
    rollout: Any,
    meta: WeightUpdateMeta,
    buckets: list[list[ParamSpec]] | None,
    timings: dict[str, float] | None = None,
) -> None:
    """One weight update: the rollout side receives while the trainer sends.

    ``buckets`` is :func:`connect_weight_sync`'s plan (``xccl``). The rollout side's
    barrier must be closed (``begin_weight_update``); its servers serve the new weights
    when this returns. ``timings`` (``awex``) gets the seconds of its three parts: ``share``
    (the ranks share their buckets), ``load`` (the servers load them and serve again) and
    ``release`` (the ranks free them).
    """
    if meta.type == "awex":  # handles first, then the loads: nothing runs concurrently
        stamps = [time.perf_counter()]
        payloads = trainer.share_weights(meta)
        stamps.append(time.perf_counter())
        try:
            rollout.receive_weights(meta, payloads=payloads)
            stamps.append(time.perf_counter())
        finally:
            trainer.release_shared_weights()
            stamps.append(time.perf_counter())
        if timings is not None and len(stamps) == 4:
            for name, start, stop in zip(("share", "load", "release"), stamps, stamps[1:]):
                timings[name] = stop - start
        return
    if meta.type == "xccl" and buckets is None:
        raise RuntimeError("connect_weight_sync() before pushing weights over xccl")
    failure = BUCKET_FAILURE if meta.type == "xccl" else LOAD_FAILURE
    received = _submit(rollout.receive_weights, meta, buckets)
    _alongside(received, lambda: trainer.send_weights(meta), failure)


# --- the trainer's half ---


class RolloutWeightSync:
    """Mixin: the train ranks' side of weight sync (see the module docstring)."""

    rollout_engine: InferenceEngine | None
    _weight_group: Any
    _weight_plan: list[list[ParamSpec]] | None = None

    def _weights_for_inference(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every engine using this mixin defines it (see the module docstring)."""
        raise NotImplementedError(f"{type(self).__name__} must define _weights_for_inference")

    def weight_group_address(self, meta: WeightUpdateMeta) -> WeightUpdateMeta:
        """``meta`` with the group's master address, a free port and the backend, chosen
        where rank 0 (the group's rank 0) runs. Not a collective."""
        address = meta.nccl_master_address
        if not address or address == "127.0.0.1":
            address = gethostip()
        return dataclasses.replace(
            meta,
            nccl_master_address=address,
            nccl_master_port=find_free_port(),
            comm_backend="nccl" if self.device.type == "cuda" else "gloo",
        )

    def join_weight_group(self, meta: WeightUpdateMeta) -> None:
        """Rank 0 joins the weight-update group as its rank 0 (it returns once every
        server rank has joined); every rank then meets at a barrier."""
        if dist.get_rank() == 0:
            self._weight_group = _create_group(meta)
        dist.barrier(group=self._cpu_group)

    def weight_buckets(self, meta: WeightUpdateMeta) -> list[list[ParamSpec]] | None:
        """The buckets every ``xccl`` update sends, in order (a collective: the tensors
        are produced once). Rank 0 keeps and returns the plan; other ranks return None."""
        plan = [[spec for spec, _ in bucket] for bucket in self._buckets(meta)]
        if dist.get_rank() != 0:
            return None
        self._weight_plan = plan
        return plan

    def _buckets(
        self, meta: WeightUpdateMeta, materialize: bool = False
    ) -> Iterator[list[tuple[ParamSpec, torch.Tensor | None]]]:
        """Rank 0's buckets of at most ``weight_chunked_mem_mb`` (a tensor larger than that
        alone), with the tensors in the sent dtype on the device when ``materialize``.
        Every rank must run it: producing the tensors is a collective."""
        dtype = _dtype(self.config.dtype)
        dtype_name = str(dtype).removeprefix("torch.")
        budget = meta.weight_chunked_mem_mb * 1024 * 1024
        rank0 = dist.get_rank() == 0
        bucket: list[tuple[ParamSpec, torch.Tensor | None]] = []
        size = 0
        for name, full in self._weights_for_inference():
            if not rank0:
                continue  # every rank takes part in producing the tensors
            nbytes = full.numel() * dtype.itemsize
            if bucket and size + nbytes > budget:
                yield bucket
                bucket, size = [], 0
            tensor = full.to(device=self.device, dtype=dtype).contiguous() if materialize else None
            bucket.append((ParamSpec(name, tuple(full.shape), dtype_name), tensor))
            size += nbytes
        if bucket:
            yield bucket

    def share_weights(self, meta: WeightUpdateMeta) -> list[str]:
        """``awex`` (every rank, a collective): this rank's full weights in the sent dtype,
        in buckets of at most ``weight_chunked_mem_mb`` shared by handle with the colocated
        server (CUDA IPC on GPUs, shared memory on CPU); one serialized payload per
        bucket. Kept alive until :meth:`release_shared_weights`."""
        from areal.engine.tensor_share import SharedBuckets

        self.release_shared_weights()
        shared = self._shared_weights = SharedBuckets()
        dtype = _dtype(self.config.dtype)
        budget = meta.weight_chunked_mem_mb * 1024 * 1024
        payloads: list[str] = []
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, full in self._weights_for_inference():
            nbytes = full.numel() * dtype.itemsize
            if bucket and size + nbytes > budget:
                payloads.append(shared.share(bucket, self.device, dtype))
                bucket, size = [], 0
            # converted to the sent dtype as the bucket copies it in
            bucket.append((name, full.detach().to(device=self.device)))
            size += nbytes
        if bucket:
            payloads.append(shared.share(bucket, self.device, dtype))
        return payloads

    def release_shared_weights(self) -> None:
        """Free the buckets :meth:`share_weights` shared (every server has answered)."""
        shared = getattr(self, "_shared_weights", None)
        if shared is not None:
            shared.release()
            self._shared_weights = None

    def send_weights(self, meta: WeightUpdateMeta) -> None:
        """The trainer's half of one update (every rank; see the module docstring)."""
        if meta.type == "disk":
            self._send_to_disk(meta)
        elif meta.type == "xccl":
            self._broadcast_weights(meta)
        else:
            raise ValueError(f"weight update type {meta.type!r} is not supported; disk or xccl")

    def _send_to_disk(self, meta: WeightUpdateMeta) -> None:
        if meta.path is None:
            raise ValueError("a disk weight update needs WeightUpdateMeta.path")
        version = self._version if meta.version is None else meta.version
        self._save_hf(meta.path)
        exp = getattr(self.config, "experiment_name", "") or ""
        trial = getattr(self.config, "trial_name", "") or ""
        if dist.get_rank() == 0 and exp and trial:
            name_resolve.add(
                names.update_weights_from_disk(exp, trial, version), str(time.time()), replace=True
            )
        dist.barrier(group=self._cpu_group)

    def _broadcast_weights(
        self,
        meta: WeightUpdateMeta,
        receive: Callable[[list[ParamSpec]], concurrent.futures.Future] | None = None,
    ) -> None:
        """Rank 0 broadcasts bucket after bucket. The controller has the servers receive
        the plan (:meth:`weight_buckets`), which each bucket must match; an inference
        engine in this process is told each bucket here (``receive``), alongside."""
        from areal.utils.nccl_group import broadcast

        rank0 = dist.get_rank() == 0
        plan = self._weight_plan if rank0 and receive is None else None
        if rank0 and receive is None and plan is None:
            raise RuntimeError("weight_buckets() before sending weights over xccl")
        sent = 0
        for bucket in self._buckets(meta, materialize=True):
            specs = [spec for spec, _ in bucket]
            tensors = [tensor for _, tensor in bucket]
            if receive is not None:
                _alongside(
                    receive(specs),
                    lambda t=tensors: _broadcast_bucket(broadcast, self._weight_group, t),
                    BUCKET_FAILURE,
                )
            elif sent >= len(plan) or specs != plan[sent]:
                raise RuntimeError(
                    f"weight bucket {sent} is not the planned one: the trainer's weights "
                    "changed since the weight-update group was set up"
                )
            else:
                _broadcast_bucket(broadcast, self._weight_group, tensors)
            sent += 1
        if plan is not None and sent != len(plan):
            raise RuntimeError(f"sent {sent} of {len(plan)} planned weight buckets")
        dist.barrier(group=self._cpu_group)

    # --- an inference engine in this process ---

    def connect_engine(self, rollout_engine: InferenceEngine, meta: WeightUpdateMeta) -> None:
        """Drive ``rollout_engine`` (in this process) from this engine; ``xccl`` joins the
        group now (``meta`` gets its address)."""
        self.rollout_engine = rollout_engine
        if meta.type != "xccl":
            return
        if dist.get_rank() == 0:
            filled = self.weight_group_address(meta)
            for field in ("nccl_master_address", "nccl_master_port", "comm_backend"):
                setattr(meta, field, getattr(filled, field))
            joined = rollout_engine.init_weights_update_group(meta)
            self._weight_group = _join_weight_group(meta, joined)
        dist.barrier(group=self._cpu_group)

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Push the weights to the engine given to :meth:`connect_engine`, inside its
        weight-update barrier (``meta.version``, or this engine's version)."""
        rollout = self.rollout_engine
        if rollout is None:
            raise RuntimeError("connect_engine() the rollout engine before update_weights()")
        if meta.type not in ("disk", "xccl", "awex"):
            raise ValueError(
                f"weight update type {meta.type!r} is not supported; disk, xccl or awex"
            )
        version = self._version if meta.version is None else meta.version
        meta = dataclasses.replace(meta, version=version)
        rank0 = dist.get_rank() == 0
        if rank0:
            rollout.begin_weight_update(version)
        if meta.type == "awex":  # rank 0 hands every rank's buckets to the servers
            mine = self.share_weights(meta)
            payloads: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(payloads, mine, group=self._cpu_group)
            try:
                if rank0:
                    rollout.update_weights_from_tensor(meta, payloads).result()
            finally:
                dist.barrier(group=self._cpu_group)
                self.release_shared_weights()
        elif meta.type == "disk":  # the load reads what the save wrote
            self.send_weights(meta)
            if rank0:
                rollout.update_weights_from_disk(meta).result()
        else:
            receive = (
                (lambda specs: rollout.update_weights_from_distributed(meta, specs))
                if rank0
                else None
            )
            self._broadcast_weights(meta, receive)
        if rank0:
            rollout.end_weight_update(version)


def _broadcast_bucket(broadcast: Callable, group: Any, tensors: list[torch.Tensor]) -> None:
    if tensors and tensors[0].is_cuda:
        torch.cuda.set_device(tensors[0].device)  # the current device is per thread
    for tensor in tensors:
        broadcast(group, tensor, src=0)
    if tensors and tensors[0].is_cuda:
        torch.cuda.synchronize()


def _create_group(meta: WeightUpdateMeta) -> Any:
    from areal.utils.nccl_group import init_weight_update_group

    return init_weight_update_group(
        backend=meta.comm_backend,
        master_address=meta.nccl_master_address,
        master_port=meta.nccl_master_port,
        rank=0,
        world_size=meta.group_world_size,
        group_name=meta.nccl_group_name,
    )


def _join_weight_group(meta: WeightUpdateMeta, joined: concurrent.futures.Future) -> Any:
    """Join the weight-update group as rank 0 while the servers join theirs (``joined``).

    The trainer's rendezvous store waits for every server rank; a server that fails to
    join fails this call at once instead of leaving rank 0 waiting for the rendezvous
    timeout.
    """
    return _alongside(joined, lambda: _create_group(meta), JOIN_FAILURE)


def _submit(fn: Callable[..., Any], *args: Any) -> concurrent.futures.Future:
    """``fn(*args)`` on its own daemon thread; its outcome as a future (a future that
    ``fn`` returns is waited for)."""
    future: concurrent.futures.Future = concurrent.futures.Future()

    def run() -> None:
        try:
            result = fn(*args)
            if isinstance(result, concurrent.futures.Future):
                result = result.result()
            future.set_result(result)
        except BaseException as e:  # reported through the future
            future.set_exception(e)

    threading.Thread(target=run, name="weight-sync", daemon=True).start()
    return future


def _alongside(servers: concurrent.futures.Future, work: Callable[[], Any], failure: str) -> Any:
    """Run the trainer's half (``work``) on a helper thread while the rollout side runs
    its half (``servers``); a rollout-side failure fails it at once, as ``failure``.

    The trainer's half may then still wait in a collective that can no longer complete;
    its thread is a daemon and the run's teardown stops the processes. Returns
    ``work()``'s result once both halves are done.
    """
    done = _submit(work)
    concurrent.futures.wait([servers, done], return_when=concurrent.futures.FIRST_EXCEPTION)
    if servers.done() and servers.exception() is not None:
        raise RuntimeError(f"{failure}: {servers.exception()}")
    result = done.result()
    servers.result()
    return result


def _dtype(name: str) -> torch.dtype:
    from areal.engine.fsdp_engine import to_dtype

    return to_dtype(name)
