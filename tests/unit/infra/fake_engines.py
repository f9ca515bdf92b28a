"""Small engines that RPC-server and scheduler tests create on real worker processes.

Each marks its own class an engine interface, so every public method of it may be called
over RPC (real engines declare theirs in ``areal.api.engine_api``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal.api.engine_api import InferenceEngine, TrainEngine, engine_interface


class NotAnExceptionError(BaseException):
    """A ``BaseException`` that is no ``Exception`` (torch's ``CheckpointException`` is one)."""


@dataclass
class Point:
    """A dataclass under ``tests.`` (allowed to travel by value)."""

    x: int
    y: float = 0.0
    tags: list[str] = field(default_factory=list)


class _TrivialInference(InferenceEngine):
    """Every abstract method of InferenceEngine, doing nothing."""

    def initialize(self, engine_id=None, addr=None, train_data_parallel_size=None) -> None:
        self._initialized = True

    def destroy(self) -> None:
        pass

    @property
    def initialized(self) -> bool:
        return getattr(self, "_initialized", False)

    def launch_server(self, server_args):
        raise NotImplementedError

    def teardown_server(self) -> None:
        pass

    async def agenerate(self, req):
        raise NotImplementedError

    def init_weights_update_group(self, meta, xccl_group_ranks=None):
        raise NotImplementedError

    def update_weights_from_distributed(self, meta, param_specs):
        raise NotImplementedError

    def update_weights_from_disk(self, meta):
        raise NotImplementedError

    def update_weights_from_tensor(self, meta, payloads):
        raise NotImplementedError

    def set_version(self, version: int) -> None:
        self._version = version

    def get_version(self) -> int:
        return getattr(self, "_version", 0)

    def submit(self, data, workflow, workflow_kwargs=None, **kwargs) -> int:
        return 0

    def wait(self, count, timeout=None, raise_timeout=True):
        return []

    def wait_for_task(self, task_id, timeout=None, raise_timeout=True):
        return None

    def rollout_batch(self, data, workflow, workflow_kwargs=None, **kwargs):
        return []

    def prepare_batch(self, dataloader, workflow, workflow_kwargs=None, **kwargs):
        return []

    def begin_weight_update(self, version: int) -> None:
        pass

    def end_weight_update(self, version: int) -> None:
        self._version = version

    def offload(self, tags=None) -> None:
        pass

    def onload(self, tags=None) -> None:
        pass

    def export_stats(self) -> dict[str, float]:
        return {}


@engine_interface
class EchoEngine(_TrivialInference):
    """Methods that exercise the RPC paths: plain, future, coroutine, failing, env, children.

    ``destroy_marker``: a file written when ``destroy()`` runs (to observe shutdown).
    """

    def __init__(self, name: str = "echo", destroy_marker: str | None = None):
        self.name = name
        self.destroy_marker = destroy_marker
        self.thread_names: set[str] = set()

    def destroy(self) -> None:
        if self.destroy_marker:
            Path(self.destroy_marker).write_text(f"destroyed {self.name}")

    def echo(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.thread_names.add(threading.current_thread().name)
        return {"args": args, "kwargs": kwargs, "name": self.name}

    def add(self, a, b):
        return a + b

    def future_square(self, x: int) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        threading.Timer(0.05, lambda: future.set_result(x * x)).start()
        return future

    async def async_double(self, x: int) -> int:
        await asyncio.sleep(0.01)
        return 2 * x

    def fail(self, message: str) -> None:
        raise RuntimeError(message)

    def fail_beyond_exception(self, message: str) -> None:
        """Raise what is no ``Exception``, as torch's ``CheckpointException`` is."""
        raise NotAnExceptionError(message)

    def engine_threads(self) -> list[str]:
        return sorted(self.thread_names)

    def get_env(self, name: str) -> str | None:
        return os.environ.get(name)

    def say(self, text: str) -> None:
        print(text, flush=True)

    def pid(self) -> int:
        return os.getpid()

    def spawn_sleeper(self) -> int:
        """A grandchild in its own session (as inference servers are started)."""
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True
        )
        return child.pid

    def _private(self) -> None:
        pass


class UndeclaredMethodEngine(_TrivialInference):
    """An inference engine with a public method no engine interface declares."""

    def undeclared(self) -> str:
        return "ran"


class BrokenEngine(_TrivialInference):
    def __init__(self, *args: Any, **kwargs: Any):
        raise ValueError("constructor exploded")


class NotAnEngine:
    def __init__(self, *args: Any, **kwargs: Any):
        pass


@engine_interface
class FakeTrainEngine(TrainEngine):
    """An initialized train engine that is (or is not) its data-parallel head."""

    def __init__(self, head: bool = True):
        self.head = head
        self.initialized = True

    def is_data_parallel_head(self) -> bool:
        return self.head

    def step(self, x: int) -> int:
        return x + 1

    def create_process_group(self, parallel_strategy=None) -> None:
        pass

    def initialize(self, addr=None, ft_spec=None, **kwargs) -> None:
        pass

    def destroy(self) -> None:
        pass

    @property
    def data_parallel_group(self):
        return None

    @property
    def data_parallel_rank(self) -> int:
        return 0

    @property
    def data_parallel_world_size(self) -> int:
        return 1

    def train(self, mode: bool = True):
        return self

    def connect_engine(self, rollout_engine, meta) -> None:
        pass

    def update_weights(self, meta) -> None:
        pass

    def set_version(self, version: int) -> None:
        pass

    def get_version(self) -> int:
        return 0

    def save(self, meta) -> None:
        pass

    def load(self, meta) -> None:
        pass

    def optimizer_zero_grad(self) -> None:
        pass

    def optimizer_step(self) -> dict[str, float]:
        return {}

    def lr_scheduler_step(self) -> None:
        pass

    def train_batch(self, input_, loss_fn, loss_weight_fn) -> dict:
        return {}

    def eval_batch(self, input_, loss_fn, loss_weight_fn):
        return None

    def forward_batch(self, input_, **kwargs):
        return None
