"""Client of inference servers that speak SGLang's native HTTP API.

``RemoteSGLangEngine`` drives SGLang servers (backend ``sglang``) and this port's embedded
server (backend ``hf``) with the same requests: ``/generate`` with token ids and
log-probs, pause and continue, abort, weight updates from disk or over NCCL, memory
release. ``agenerate`` is *interruptible*: when a weight update aborts a request, the
partial output is kept and generation continues from it on the new weights, each token
tagged with the version that produced it.

Every call to a server carries ``Authorization: Bearer <key>`` (SGLang's ``--api-key``
check; the embedded server applies the same). The key is ``AREAL_INFERENCE_API_KEY`` when
that is set (one key per run, for servers this process did not start); otherwise the
engine makes one when it first launches a server, so each rollout worker's servers have
their own. It reaches servers and proxies through their environment, never their argv.

``RemoteInfEngine`` is a composition of the parts in :mod:`areal.engine.remote`: the
server client (HTTP, auth, generation), the launcher (servers, proxies, teardown), the
weight receiver (barrier, version, weight loads), the workflow runner (rollouts) and the
stats merger. On a rollout worker it keeps no staleness gate: the rollout controller
holds the run's one gate and sends only the rollouts it allows.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

from areal.api.cli_args import InferenceEngineConfig
from areal.api.engine_api import RolloutWorkerEngine
from areal.api.io_struct import (
    LocalInfServerInfo,
    ModelRequest,
    ModelResponse,
    ParamSpec,
    WeightUpdateMeta,
)
from areal.engine.remote.launcher import ServerLauncher
from areal.engine.remote.server_client import InferenceServerClient, discover_servers
from areal.engine.remote.stats import combine_mergeable, worker_stats
from areal.engine.remote.weight_receiver import WeightReceiver
from areal.engine.remote.workflow_runner import WorkflowRunner
from areal.engine.sglang_backend import HFBackend, SGLangBackend
from areal.infra.staleness_manager import StalenessManager
from areal.infra.weight_barrier import BarrierState
from areal.infra.workflow_executor import WorkflowExecutor
from areal.utils import logging
from areal.utils.secrets import SecretStr, reveal

__all__ = [
    "HFBackend",
    "RemoteInfEngine",
    "RemoteSGLangEngine",
    "SGLangBackend",
    "combine_mergeable",
]

logger = logging.getLogger("engine.remote")


class RemoteInfEngine(RolloutWorkerEngine):
    """An inference engine over HTTP servers (see the module docstring).

    ``staleness`` gates the start of rollouts submitted here; leave it ``None`` on a
    rollout worker (its controller gates) and pass one to run rollouts in-process.
    """

    def __init__(
        self,
        config: InferenceEngineConfig,
        backend: SGLangBackend,
        staleness: StalenessManager | None = None,
    ):
        self.config = config
        self.backend = backend
        # fan-out requests, weight loads and the controller's long polls run here
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=8, thread_name_prefix="infer-ops"
        )
        self.client = InferenceServerClient(config, backend, lambda: self.barrier, self._pool)
        self.launcher = ServerLauncher(config, backend, self.client)
        self.runner = WorkflowRunner(config, self._pool, staleness)
        self.weights = WeightReceiver(config, backend, self.client, self._pool, self.runner.notify)
        self._initialized = False

    # --- the parts' state, as the engine's ---

    @property
    def api_key(self) -> SecretStr:
        """The key sent to every server (empty until one is set or generated)."""
        return self.client.api_key

    @property
    def addresses(self) -> list[str]:
        """The servers this engine sends to (``host:port``)."""
        return self.client.addresses

    @addresses.setter
    def addresses(self, value: list[str]) -> None:
        self.client.addresses = list(value)

    @property
    def local_servers(self) -> list[LocalInfServerInfo]:
        return self.launcher.local_servers

    @local_servers.setter
    def local_servers(self, value: list[LocalInfServerInfo]) -> None:
        self.launcher.local_servers = list(value)

    @property
    def local_proxies(self) -> list[LocalInfServerInfo]:
        return self.launcher.local_proxies

    @local_proxies.setter
    def local_proxies(self, value: list[LocalInfServerInfo]) -> None:
        self.launcher.local_proxies = list(value)

    @property
    def barrier(self) -> BarrierState:
        """The one pause and version source of this worker, read by its proxies too."""
        return self.weights.barrier

    @property
    def workflow_executor(self) -> WorkflowExecutor | None:
        return self.runner.executor

    # --- lifecycle ---

    def initialize(
        self,
        engine_id: str | None = None,
        addr: str | list[str] | None = None,
        train_data_parallel_size: int | None = None,
    ) -> None:
        launched = [s.address for s in self.launcher.local_servers]
        self.client.connect(discover_servers(self.config, addr, launched))
        self.runner.start(self)
        self._initialized = True
        logger.info(
            "inference engine ready on %d server(s): %s", len(self.addresses), self.addresses
        )

    def register_destroy_callback(self, key: str, fn: Callable[[], Any]) -> bool:
        """Run ``fn`` at :meth:`destroy` (agents release per-worker resources with it).

        The first callback per ``key`` wins; returns whether this one was registered.
        """
        return self.launcher.register_destroy_callback(key, fn)

    def destroy(self) -> None:
        # rollouts first: cancelled ones release what they hold (Arena routes) before the
        # callbacks delete it
        self.runner.stop()
        self.launcher.run_destroy_callbacks()
        self.launcher.teardown()
        self.weights.close()  # its proxies are gone
        self.client.close()
        self._pool.shutdown(wait=False)
        self._initialized = False

    @property
    def initialized(self) -> bool:
        return self._initialized

    def launch_server(self, server_args: dict[str, Any]) -> LocalInfServerInfo:
        """Start one local server; ``host``/``port`` are filled in when absent."""
        return self.launcher.launch_server(server_args)

    def launch_local_server(self, server_args: dict[str, Any]) -> str:
        """:meth:`launch_server`, returning only the ``host:port`` (for remote callers)."""
        return self.launch_server(server_args).address

    def launch_proxy(self, tokenizer_path: str, expected_temperature: float | None = None) -> str:
        """Start a rollout proxy in front of this engine's first server; ``http://host:port``.

        The proxy gets the admin key of ``config.agent`` in its environment (never on
        argv) and follows this engine's weight-update barrier. ``expected_temperature`` is
        ``actor.temperature``: requests sampled at another one are counted.
        """
        return self.launcher.launch_proxy(tokenizer_path, expected_temperature, self.barrier.path)

    def attach_barrier(self, path: str) -> None:
        """Follow another process's barrier (a proxy follows its rollout worker's); call
        before :meth:`initialize`."""
        if self.runner.executor is not None:
            raise RuntimeError("attach_barrier() before initialize()")
        self.weights.attach_barrier(path)

    def teardown_server(self) -> None:
        self.launcher.teardown()

    # --- the weight-update barrier (the one pause path) and versions ---

    def begin_weight_update(self, version: int) -> None:
        """Close the barrier and pause the servers (see :class:`WeightReceiver`)."""
        self.weights.begin_weight_update(version)

    def resume_serving(self) -> None:
        """The servers serve direct requests again; rollouts stay held until
        :meth:`end_weight_update`."""
        self.weights.resume_serving()

    def end_weight_update(self, version: int) -> None:
        """Set ``version`` on the servers and here, let the servers serve, open the barrier."""
        self.weights.end_weight_update(version)

    def set_version(self, version: int) -> None:
        """Set the version without opening or closing the barrier."""
        self.weights.set_version(version)

    def get_version(self) -> int:
        return self.weights.get_version()

    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> concurrent.futures.Future:
        """Load ``meta.path`` on every server once the trainer has published it."""
        return self.weights.update_weights_from_disk(meta)

    def update_weights_from_tensor(
        self, meta: WeightUpdateMeta, payloads: list[list[str]]
    ) -> concurrent.futures.Future:
        """``awex``: every server loads the buckets its colocated actor ranks share."""
        return self.weights.update_weights_from_tensor(meta, payloads)

    def init_weights_update_group(
        self, meta: WeightUpdateMeta, first_server_index: int = 0
    ) -> concurrent.futures.Future:
        """Every server joins the trainer's weight-update group; this engine's servers are
        numbered from ``first_server_index`` among all ``meta.gen_n_servers``."""
        return self.weights.init_weights_update_group(meta, first_server_index)

    def update_weights_from_distributed(
        self, meta: WeightUpdateMeta, param_specs: list[ParamSpec]
    ) -> concurrent.futures.Future:
        """Every server receives one bucket of broadcast tensors (one try)."""
        return self.weights.update_weights_from_distributed(meta, param_specs)

    # --- generation and operations on every server ---

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """Generate for one request, surviving aborts caused by weight updates."""
        return await self.client.agenerate(req)

    def abort_all(self) -> None:
        self.client.abort_all()

    def offload(self, tags: list[str] | None = None) -> None:
        self.client.offload(tags)

    def onload(self, tags: list[str] | None = None) -> None:
        self.client.onload(tags)

    # --- rollouts ---

    def submit(
        self, data: Any, workflow: Any, workflow_kwargs: dict[str, Any] | None = None, **kwargs: Any
    ) -> int:
        return self.runner.submit(data, workflow, workflow_kwargs, **kwargs)

    def wait(
        self, count: int, timeout: float | None = None, raise_timeout: bool = True
    ) -> list[Any]:
        return self.runner.wait(count, timeout=timeout, raise_timeout=raise_timeout)

    def wait_for_task(
        self, task_id: int, timeout: float | None = None, raise_timeout: bool = True
    ) -> Any:
        return self.runner.wait_for_task(task_id, timeout=timeout, raise_timeout=raise_timeout)

    def collect_finished(
        self, ack: list[int] | None = None, timeout: float = 1.0
    ) -> concurrent.futures.Future:
        """Finished rollouts, long-polled by the rollout controller (a future: the RPC
        server waits for it off its engine thread)."""
        return self.runner.collect_finished(ack, timeout)

    def rollout_batch(
        self,
        data: list[Any],
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        return self.runner.rollout_batch(data, workflow, workflow_kwargs, **kwargs)

    def prepare_batch(
        self,
        dataloader: Any,
        workflow: Any,
        workflow_kwargs: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> list[Any]:
        return self.runner.prepare_batch(dataloader, workflow, workflow_kwargs, **kwargs)

    def export_stats(self) -> dict[str, float]:
        """This worker's ``rollout`` stats and its proxies' (``proxy/*``), mergeable."""
        admin = reveal(getattr(self.config.agent, "admin_api_key", "") or "")
        return worker_stats(self.client.http(), self.launcher.local_proxies, admin)


class RemoteSGLangEngine(RemoteInfEngine):
    """The engine the YAMLs name: SGLang servers, or the embedded server for ``hf``."""

    def __init__(
        self,
        config: InferenceEngineConfig,
        backend: SGLangBackend | None = None,
        staleness: StalenessManager | None = None,
    ):
        if backend is None:
            backend = HFBackend() if _backend_kind(config.backend) == "hf" else SGLangBackend()
        super().__init__(config, backend, staleness)


def _backend_kind(backend: str) -> str:
    """``hf`` or ``sglang`` from an allocation string (``sglang`` when it is not set)."""
    from areal.api.alloc_mode import ModelAllocation

    if not isinstance(backend, str) or ":" not in backend:
        return "sglang"
    return ModelAllocation.from_str(backend).backend
