"""Engine interfaces: what the trainer and the rollout side call."""

from __future__ import annotations

import abc
import concurrent.futures
from typing import Any

from areal.api.io_struct import (
    LocalInfServerInfo,
    ModelRequest,
    ModelResponse,
    ParamSpec,
    WeightUpdateMeta,
)

__all__ = ["InferenceEngine"]


class InferenceEngine(abc.ABC):
    """Generation on inference servers plus asynchronous rollout execution."""

    @abc.abstractmethod
    def initialize(
        self,
        engine_id: str | None = None,
        addr: str | list[str] | None = None,
        train_data_parallel_size: int | None = None,
    ) -> None:
        """Connect to the server(s) and start the rollout executor."""

    @abc.abstractmethod
    def destroy(self) -> None:
        """Stop the executor and tear down locally launched servers."""

    @property
    @abc.abstractmethod
    def initialized(self) -> bool: ...

    @abc.abstractmethod
    def launch_server(self, server_args: dict[str, Any]) -> LocalInfServerInfo:
        """Start a local inference server process."""

    @abc.abstractmethod
    def teardown_server(self) -> None: ...

    @abc.abstractmethod
    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """One generation (``n_samples`` must be 1)."""

    @abc.abstractmethod
    def init_weights_update_group(
        self, meta: WeightUpdateMeta, xccl_group_ranks: list[int] | None = None
    ) -> concurrent.futures.Future: ...

    @abc.abstractmethod
    def update_weights_from_distributed(
        self, meta: WeightUpdateMeta, param_specs: list[ParamSpec]
    ) -> concurrent.futures.Future: ...

    @abc.abstractmethod
    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> concurrent.futures.Future: ...

    @abc.abstractmethod
    def set_version(self, version: int) -> None: ...

    @abc.abstractmethod
    def get_version(self) -> int: ...

    @abc.abstractmethod
    def submit(
        self, data: Any, workflow: Any, workflow_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> int:
        """Queue one rollout task; returns its id."""

    @abc.abstractmethod
    def wait(
        self, count: int, timeout: float | None = None, raise_timeout: bool = True
    ) -> list[Any]: ...

    @abc.abstractmethod
    def wait_for_task(
        self, task_id: int, timeout: float | None = None, raise_timeout: bool = True
    ) -> Any: ...

    @abc.abstractmethod
    def rollout_batch(
        self,
        data: list[Any],
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[Any]: ...

    @abc.abstractmethod
    def prepare_batch(
        self,
        dataloader: Any,
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[Any]: ...

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop starting rollouts; running generations wait at their next request."""

    @abc.abstractmethod
    def resume(self) -> None: ...

    @abc.abstractmethod
    def pause_generation(self) -> None:
        """Server-level pause: abort in-flight requests, hold new ones."""

    @abc.abstractmethod
    def continue_generation(self) -> None: ...

    @abc.abstractmethod
    def offload(self, tags: list[str] | None = None) -> None: ...

    @abc.abstractmethod
    def onload(self, tags: list[str] | None = None) -> None: ...

    @abc.abstractmethod
    def export_stats(self) -> dict[str, float]: ...
