"""Engine interfaces: what the trainer and the rollout side call.

The classes marked :func:`engine_interface` here are also the RPC contract between a
controller and the engines on its workers: a controller calls an engine only through a
:class:`~areal.infra.rpc.remote_engine.RemoteEngine` of one of these interfaces, and a
worker runs only methods an interface of the engine declares
(:func:`interface_methods`). An engine method called remotely must be declared here.
"""

from __future__ import annotations

import abc
import concurrent.futures
import functools
import inspect
from typing import Any, TypeVar

from areal.api.io_struct import (
    LocalInfServerInfo,
    ModelRequest,
    ModelResponse,
    ParamSpec,
    WeightUpdateMeta,
)

__all__ = [
    "InferenceEngine",
    "PPOActorEngine",
    "RolloutWorkerEngine",
    "TrainEngine",
    "engine_interface",
    "interface_methods",
]

_INTERFACE_MARK = "__engine_interface__"
C = TypeVar("C", bound=type)


def engine_interface(cls: C) -> C:
    """Mark ``cls`` as an engine interface: the public methods it defines itself may be
    called on its engines over RPC (a test engine may mark its own class)."""
    setattr(cls, _INTERFACE_MARK, cls)
    return cls


@functools.cache
def interface_methods(cls: type) -> frozenset[str]:
    """The methods callable over RPC on engines of class ``cls``: the public methods
    defined by the engine interfaces among ``cls`` and its bases (properties excluded:
    RPC calls methods)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        if klass.__dict__.get(_INTERFACE_MARK) is not klass:
            continue
        for name, value in klass.__dict__.items():
            if name.startswith("_"):
                continue
            if inspect.isfunction(value) or isinstance(value, (staticmethod, classmethod)):
                names.add(name)
    return frozenset(names)


@engine_interface
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
        self, meta: WeightUpdateMeta, first_server_index: int = 0
    ) -> concurrent.futures.Future:
        """This engine's servers (numbered from ``first_server_index``) join the group."""

    @abc.abstractmethod
    def update_weights_from_distributed(
        self, meta: WeightUpdateMeta, param_specs: list[ParamSpec]
    ) -> concurrent.futures.Future: ...

    @abc.abstractmethod
    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> concurrent.futures.Future: ...

    @abc.abstractmethod
    def update_weights_from_tensor(
        self, meta: WeightUpdateMeta, payloads: list[list[str]]
    ) -> concurrent.futures.Future:
        """``awex``: the servers load tensors their colocated actor ranks hand over by
        handle; ``payloads[k * t + r]``: the serialized buckets of TP rank ``r`` of this
        engine's server ``k``."""

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
    def begin_weight_update(self, version: int) -> None:
        """Close the weight-update barrier: start no rollout, send no generation request,
        abort the requests in flight on the servers (their partial output is kept)."""

    @abc.abstractmethod
    def end_weight_update(self, version: int) -> None:
        """Set ``version`` (this engine, its servers and proxies) and open the barrier."""

    @abc.abstractmethod
    def offload(self, tags: list[str] | None = None) -> None: ...

    @abc.abstractmethod
    def onload(self, tags: list[str] | None = None) -> None: ...

    @abc.abstractmethod
    def export_stats(self) -> dict[str, float]: ...


@engine_interface
class RolloutWorkerEngine(InferenceEngine):
    """The inference engine of a rollout worker, driven by the rollout controller.

    It launches its server and rollout proxy, runs the rollouts the controller dispatches
    under the controller's task ids, and hands their results back on the controller's
    long poll (:meth:`collect_finished`). The controller holds the run's staleness gate.
    """

    @abc.abstractmethod
    def launch_local_server(self, server_args: dict[str, Any]) -> str:
        """:meth:`launch_server`, returning only the server's ``host:port``."""

    @abc.abstractmethod
    def launch_proxy(self, tokenizer_path: str, expected_temperature: float | None = None) -> str:
        """Start a rollout proxy in front of the first server; its ``http://host:port``.

        ``expected_temperature``: the trainer's sampling temperature (requests sampled at
        another one are counted)."""

    @abc.abstractmethod
    def attach_barrier(self, path: str) -> None:
        """Follow another process's weight-update barrier (before :meth:`initialize`)."""

    @abc.abstractmethod
    def resume_serving(self) -> None:
        """The servers hold the new weights: they serve direct requests again; rollouts
        stay held until :meth:`end_weight_update`."""

    @abc.abstractmethod
    def abort_all(self) -> None:
        """Abort every request in flight on the servers."""

    @abc.abstractmethod
    def submit(
        self,
        data: Any,
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        *,
        task_id: int | None = None,
        **kwargs: Any,
    ) -> int:
        """Queue one rollout task under ``task_id`` (the controller's; None: a new one);
        returns the id."""

    @abc.abstractmethod
    def collect_finished(
        self, ack: list[int] | None = None, timeout: float = 1.0
    ) -> concurrent.futures.Future:
        """Finished rollouts, ``[(task_id, trajectory or None if rejected)]``, waiting up
        to ``timeout`` seconds for one. ``ack``: the ids the previous call returned, now
        dropped; a result stays until acknowledged, so one lost on the way comes again."""


@engine_interface
class TrainEngine(abc.ABC):
    """A model being trained: process groups, micro-batched steps, checkpoints, weight sync.

    Batches are padded dicts (``input_ids [B, L]``, ``attention_mask [B, L]`` bool,
    per-token and per-row keys); engines split them into token-balanced packed
    micro-batches themselves. ``loss_fn(logprobs, entropy, mb)`` gets the per-token
    log-probs of a packed micro-batch (position ``t`` scores token ``t + 1``) and returns
    that micro-batch's mean loss; ``loss_weight_fn(mb)`` gives its weight (the actor
    counts trainable tokens), and the step optimizes the weighted mean over all
    micro-batches and data-parallel ranks.
    """

    @abc.abstractmethod
    def create_process_group(self, parallel_strategy: Any = None) -> None:
        """Initialize ``torch.distributed`` (if needed) and the engine's groups."""

    @abc.abstractmethod
    def initialize(self, addr: str | None = None, ft_spec: Any = None, **kwargs: Any) -> None:
        """Load the model, wrap it for training and build the optimizer and LR schedule."""

    @abc.abstractmethod
    def destroy(self) -> None: ...

    @property
    @abc.abstractmethod
    def data_parallel_group(self) -> Any: ...

    @property
    @abc.abstractmethod
    def data_parallel_rank(self) -> int: ...

    @property
    @abc.abstractmethod
    def data_parallel_world_size(self) -> int: ...

    def current_data_parallel_head(self) -> int:
        """The lowest global rank of this rank's model-parallel group."""
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    def is_data_parallel_head(self) -> bool:
        import torch.distributed as dist

        rank = dist.get_rank() if dist.is_initialized() else 0
        return self.current_data_parallel_head() == rank

    def data_parallel_layout(self) -> dict[str, Any]:
        """This rank's place in the data-parallel view, as a plain call (RPC cannot read
        properties): ``{"dp_rank": int, "dp_size": int, "is_head": bool}``.

        Over RPC only DP heads' answers arrive; a non-head's result is null.
        """
        return {
            "dp_rank": int(self.data_parallel_rank),
            "dp_size": int(self.data_parallel_world_size),
            "is_head": bool(self.is_data_parallel_head()),
        }

    @abc.abstractmethod
    def train(self, mode: bool = True) -> TrainEngine: ...

    def eval(self) -> TrainEngine:
        return self.train(False)

    @abc.abstractmethod
    def connect_engine(self, rollout_engine: InferenceEngine, meta: WeightUpdateMeta) -> None:
        """Remember the rollout side (and set up the NCCL weight group for ``xccl``)."""

    @abc.abstractmethod
    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Push the current weights to the inference servers."""

    # weight sync driven by the controller (areal.engine.weight_sync): engines without it
    # refuse

    def weight_group_address(self, meta: WeightUpdateMeta) -> WeightUpdateMeta:
        """``meta`` with the ``xccl`` group's master address, a free port and the backend,
        chosen where rank 0 runs. Not a collective."""
        raise NotImplementedError(f"{type(self).__name__} does not sync weights over xccl")

    def join_weight_group(self, meta: WeightUpdateMeta) -> None:
        """Every rank: rank 0 joins the weight-update group, then all meet at a barrier."""
        raise NotImplementedError(f"{type(self).__name__} does not sync weights over xccl")

    def weight_buckets(self, meta: WeightUpdateMeta) -> list[list[ParamSpec]] | None:
        """The buckets every ``xccl`` update sends, in order (a collective); rank 0
        returns the plan, other ranks None."""
        raise NotImplementedError(f"{type(self).__name__} does not sync weights over xccl")

    def send_weights(self, meta: WeightUpdateMeta) -> None:
        """Every rank's half of one update (``disk``: save and publish the version;
        ``xccl``: broadcast the planned buckets)."""
        raise NotImplementedError(f"{type(self).__name__} does not sync weights")

    def share_weights(self, meta: WeightUpdateMeta) -> list[str]:
        """``awex``, every rank (a collective): this rank's full weights in buckets it
        shares by handle with its colocated server rank, one serialized payload per
        bucket; they stay alive until :meth:`release_shared_weights`."""
        raise NotImplementedError(f"{type(self).__name__} does not share weights in place")

    def release_shared_weights(self) -> None:
        """Free what :meth:`share_weights` shared (every server has answered)."""
        raise NotImplementedError(f"{type(self).__name__} does not share weights in place")

    @abc.abstractmethod
    def set_version(self, version: int) -> None: ...

    @abc.abstractmethod
    def get_version(self) -> int: ...

    @abc.abstractmethod
    def save(self, meta: Any) -> None:
        """``meta.weight_format``: ``hf`` (safetensors + tokenizer) or ``dcp``."""

    @abc.abstractmethod
    def load(self, meta: Any) -> None: ...

    @abc.abstractmethod
    def optimizer_zero_grad(self) -> None: ...

    @abc.abstractmethod
    def optimizer_step(self) -> dict[str, float]:
        """Clip, then step unless the gradient norm is not finite:
        ``{update_successful, grad_norm, lr}``."""

    @abc.abstractmethod
    def lr_scheduler_step(self) -> None: ...

    @abc.abstractmethod
    def train_batch(self, input_: dict[str, Any], loss_fn: Any, loss_weight_fn: Any) -> dict:
        """One optimizer step over a batch (token-mean over the global batch)."""

    @abc.abstractmethod
    def eval_batch(self, input_: dict[str, Any], loss_fn: Any, loss_weight_fn: Any) -> Any:
        """The same weighted loss without gradients."""

    @abc.abstractmethod
    def forward_batch(self, input_: dict[str, Any], **kwargs: Any) -> Any:
        """Gradient-free per-token log-probs, ``[B, L]`` aligned with the input."""

    def export_stats(self) -> dict[str, float]:
        return {}

    def offload(self) -> None:
        """Release accelerator memory between uses (engines without support refuse)."""
        raise NotImplementedError(f"{type(self).__name__} cannot offload")

    def onload(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} cannot offload")

    def get_device_stats(self) -> dict[str, float]:
        return {}


@engine_interface
class PPOActorEngine(TrainEngine):
    """A train engine that is also the PPO actor (:mod:`areal.trainer.ppo.actor`): the
    data methods the train controller splits batches over. Each gets one data-parallel
    head's share, a padded batch (``input_ids [B, L]``...)."""

    @abc.abstractmethod
    def compute_logp(self, data: dict[str, Any]) -> Any:
        """Gradient-free log-probs of the current weights, ``[B, L]``."""

    @abc.abstractmethod
    def compute_advantages(
        self, data: dict[str, Any], group_sizes: list[int] | None = None
    ) -> dict[str, Any]:
        """``data`` with per-token ``advantages`` etc.; ``group_sizes``: the rows of each
        rollout group of the share, in order."""

    @abc.abstractmethod
    def ppo_update(self, data: dict[str, Any]) -> list[dict[str, float]]:
        """The PPO minibatch steps over ``data``: one stats dict per optimizer step."""
