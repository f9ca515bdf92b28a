"""Where a worker runs engine work: one dedicated thread, one call at a time, in order.

Engine constructors and methods never run on the RPC server's event loop. They go
through one :class:`EngineThread`, which keeps collective operations (NCCL) in a fixed
order on every rank while ``/health`` stays responsive during a long training step.

With tensor or pipeline parallelism the ranks of one model-parallel group must see the
same batch: only data-parallel heads get data from the controller, and
:func:`broadcast_from_head` copies a head's arguments to the rest of its group before the
call (:func:`invoke`).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
import queue
import sys
import threading
from collections.abc import Callable
from typing import Any

from areal.api.engine_api import TrainEngine
from areal.infra.rpc.serialization import (
    deserialize_value,
    json_dumps,
    json_loads,
    serialize_value,
)

__all__ = ["EngineThread", "broadcast_from_head", "invoke"]


class EngineThread:
    """A daemon thread that runs submitted functions one at a time, in order.

    It owns an event loop for engine methods that are coroutines (:meth:`run_coroutine`).
    Daemon, so a stuck engine call cannot keep the process alive at exit.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    def submit(
        self, fn: Callable[..., Any], *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((future, fn, args, kwargs))
        return future

    def stop(self) -> None:
        self._queue.put(None)

    def run_coroutine(self, coro: Any) -> Any:
        """Run ``coro`` to completion; only from a function running on this thread."""
        return self._loop.run_until_complete(coro)

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            future, fn, args, kwargs = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # delivered to the caller, whatever it is
                future.set_exception(e)
            else:
                future.set_result(result)
        self._loop.close()


def _is_initialized_train_engine(engine: Any) -> bool:
    if not isinstance(engine, TrainEngine):
        return False
    initialized = getattr(engine, "initialized", None)
    if initialized is not None:
        return bool(initialized)
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def _model_parallel_group(engine: Any) -> Any:
    """The group a DP head shares its arguments with (None for data-parallel-only engines)."""
    for attr in ("context_and_model_parallel_group", "model_parallel_group"):
        group = getattr(engine, attr, None)
        if group is not None:
            return group
    return None


def broadcast_from_head(engine: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The DP head's ``args``/``kwargs`` on every rank of its model-parallel group.

    A no-op unless the engine exposes such a group with more than one rank. The
    arguments travel as JSON bytes in a uint8 tensor (never pickled).
    """
    group = _model_parallel_group(engine)
    if group is None:
        return args, kwargs
    import torch
    import torch.distributed as dist

    if dist.get_world_size(group) <= 1:
        return args, kwargs
    if dist.get_backend(group) == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    src = engine.current_data_parallel_head()
    head = engine.is_data_parallel_head()
    if head:
        payload = json_dumps(serialize_value([list(args), kwargs]))
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(device)
        size = torch.tensor([data.numel()], dtype=torch.int64, device=device)
    else:
        size = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(size, src=src, group=group)
    if not head:
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(data, src=src, group=group)
    new_args, new_kwargs = deserialize_value(json_loads(data.cpu().numpy().tobytes()))
    return tuple(new_args), new_kwargs


def invoke(
    thread: EngineThread,
    engine: Any,
    fn: Callable[..., Any],
    args: list,
    kwargs: dict,
    rpc_meta: dict,
) -> tuple[Any, bool]:
    """Runs on ``thread``: the optional DP-head broadcast, then the call. Returns the
    result (a coroutine's, run to completion) and whether this rank's answer counts
    (non-heads of an initialized train engine answer null, unless ``rpc_meta`` asks for
    ``every_rank``'s answer)."""
    train = _is_initialized_train_engine(engine)
    head = not train or engine.is_data_parallel_head()  # asked before: destroy() drops groups
    if train and rpc_meta.get("broadcast", True) is not False:
        args, kwargs = broadcast_from_head(engine, tuple(args), kwargs)
    result = fn(*args, **kwargs)
    if inspect.iscoroutine(result):
        result = thread.run_coroutine(result)
    return result, head or rpc_meta.get("every_rank") is True
