"""A rollout worker's side of weight updates: its barrier, its version, loading new weights."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable

from areal.api.cli_args import InferenceEngineConfig
from areal.api.io_struct import HttpRequest, ParamSpec, WeightUpdateMeta
from areal.engine.remote.server_client import InferenceServerClient
from areal.engine.sglang_backend import SGLangBackend
from areal.infra.weight_barrier import BarrierState
from areal.utils import name_resolve, names

__all__ = ["JOIN_ANSWER_SLACK_S", "WeightReceiver"]

# how much longer than rollout.weight_update_group_timeout a join's answer may take
JOIN_ANSWER_SLACK_S = 10.0


class WeightReceiver:
    """The weight-update barrier of one rollout worker (the one pause path) and the loading
    of new weights into its servers.

    ``barrier`` is read by the worker's rollouts, its generation requests and its proxies
    (through the barrier's state file). ``on_version`` runs after each version change (the
    workflow runner re-checks its queue). Weight loads return futures run on ``pool``.
    """

    def __init__(
        self,
        config: InferenceEngineConfig,
        backend: SGLangBackend,
        client: InferenceServerClient,
        pool: concurrent.futures.ThreadPoolExecutor,
        on_version: Callable[[], None],
    ):
        self.config = config
        self.backend = backend
        self.client = client
        self.barrier = BarrierState()
        self._pool = pool
        self._on_version = on_version
        self._servers_held = False  # paused by this worker's begin_weight_update
        # the servers' weight-update session: opened by the first load of an update
        # (a broadcast or a shared bucket), closed by resume_serving once all are in
        self._session_open = False

    def attach_barrier(self, path: str) -> None:
        """Follow another process's barrier (a proxy follows its rollout worker's)."""
        self.barrier.close()
        self.barrier = BarrierState.attach(path)

    def close(self) -> None:
        self.barrier.close()

    # --- the barrier and the version ---

    def begin_weight_update(self, version: int) -> None:
        """Close the barrier: no rollout starts and no generation request is sent here or
        by this worker's proxies; then the servers pause, aborting what is in flight (an
        interrupted generation keeps its partial output and goes on after
        :meth:`end_weight_update`). Closing again is a no-op."""
        if self.barrier.closed:
            return
        self.barrier.begin()
        self._servers_held = True
        self.client.pause_servers()

    def resume_serving(self) -> None:
        """The servers hold the new weights: they serve direct requests again (probes,
        the weight-sync check). Rollouts stay held until :meth:`end_weight_update`."""
        if self._session_open:  # every bucket is in
            self._session_open = False
            self.client.open_weight_session(begin=False)
        if self._servers_held:
            self.client.continue_servers()
            self._servers_held = False

    def end_weight_update(self, version: int) -> None:
        """Set ``version`` on the servers (their weight version) and here (read by the
        rollouts, generation and the proxies), let the servers serve, open the barrier.

        Servers this worker did not pause (shared with another rollout controller) only
        get the version."""
        self.client.set_weight_version(version)
        self.resume_serving()
        self.barrier.end(version)
        self._on_version()

    def set_version(self, version: int) -> None:
        """Set the version without opening or closing the barrier."""
        self.barrier.set_version(version)
        self._on_version()

    def get_version(self) -> int:
        return self.barrier.version

    # --- loading weights ---

    def update_weights_from_disk(self, meta: WeightUpdateMeta) -> concurrent.futures.Future:
        """Load ``meta.path`` on every server once the trainer has published it."""

        def run() -> None:
            exp, trial = self.config.experiment_name, self.config.trial_name
            if exp and trial and meta.version is not None:
                # first polls every few milliseconds: a small model's save takes tens of
                # them, and the gap between the save and the look is paid every update
                name_resolve.wait(
                    names.update_weights_from_disk(exp, trial, meta.version),
                    timeout=120,
                    first_interval=0.005,
                )
            self.client.fan_out(
                self.backend.build_disk_weight_update_requests(meta).requests,
                self.config.request_retries,
            )

        return self._pool.submit(run)

    def init_weights_update_group(
        self, meta: WeightUpdateMeta, first_server_index: int = 0
    ) -> concurrent.futures.Future:
        """Every server joins the trainer's weight-update group (one try each, concurrently).

        This worker's servers are numbered ``first_server_index, first_server_index + 1,
        ...`` among all ``meta.gen_n_servers`` rollout servers (a controller with several
        rollout workers gives each worker its own start), which fixes their group ranks.
        """

        def run() -> None:
            requests: dict[str, HttpRequest] = {
                address: self.backend.build_init_weights_group_request(first_server_index + i, meta)
                for i, address in enumerate(self.client.addresses)
            }
            # an embedded server answers by its own bound (the same setting); SGLang has none
            self.client.send_once(
                requests, timeout=self.config.weight_update_group_timeout + JOIN_ANSWER_SLACK_S
            )

        return self._pool.submit(run)

    def update_weights_from_distributed(
        self, meta: WeightUpdateMeta, param_specs: list[ParamSpec]
    ) -> concurrent.futures.Future:
        """Every server receives one bucket of broadcast tensors (one try)."""

        def run() -> None:
            self._open_session()
            request = self.backend.build_distributed_weight_update_requests(
                meta, param_specs
            ).requests[0]
            self.client.send_once({address: request for address in self.client.addresses})

        return self._pool.submit(run)

    def update_weights_from_tensor(
        self, meta: WeightUpdateMeta, payloads: list[list[str]]
    ) -> concurrent.futures.Future:
        """Every server loads tensors handed over by handle by its colocated actor ranks
        (``awex``): ``payloads[k * t + r]`` are the buckets of TP rank ``r`` of this
        worker's server ``k`` (``t = meta.gen_tp_size``), bucket ``b`` of every rank sent
        in one request. Inside the servers' weight-update session, which
        :meth:`resume_serving` closes; one try each (the trainer frees the shared tensors
        once this returns)."""
        t = meta.gen_tp_size
        addresses = self.client.addresses
        if len(payloads) != len(addresses) * t or len({len(p) for p in payloads}) > 1:
            raise ValueError(
                f"awex: {len(payloads)} actor rank payload(s) of unequal or wrong count for "
                f"{len(addresses)} server(s) of TP {t}"
            )

        def run() -> None:
            self._open_session()
            n = len(payloads[0]) if payloads else 0
            for b in range(n):
                last = b == n - 1
                version = str(meta.version) if last and meta.version is not None else None
                requests = {
                    address: self.backend.build_tensor_weight_update_request(
                        [payloads[k * t + r][b] for r in range(t)],
                        flush_cache=last,
                        weight_version=version,
                    )
                    for k, address in enumerate(addresses)
                }
                self.client.send_once(requests)

        return self._pool.submit(run)

    def _open_session(self) -> None:
        """Open the servers' weight-update session unless this update already did."""
        if not self._session_open:
            self.client.open_weight_session(begin=True)
            self._session_open = True
