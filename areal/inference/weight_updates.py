"""The generation engine's weight updates: reloading a checkpoint from disk, and joining the
trainer's weight-update group to receive its broadcasts.

:class:`WeightUpdates` is a mixin of :class:`~areal.inference.engine.GenerationEngine`; its
``_cmd_*`` methods are engine commands, so they run on the engine thread between iterations
and never race a forward pass. Joining a group waits on the network, so only its start and
its end are commands: the join itself runs on its own threads, bounded by
``weight_group_timeout``, and generation goes on meanwhile (:meth:`join_weight_group`).

Both paths take tensors under the served model's own (``state_dict``) names or under its
checkpoint's official names, which differ for Ling 3 (:mod:`areal.models`): a checkpoint
on disk is converted as a whole; a broadcast tensor under an official name is copied into
the part of the model's tensor it is a slice of (a fused expert or convolution tensor may
arrive over several buckets).
"""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

import torch

from areal import models
from areal.inference.errors import RequestError, settle
from areal.inference.tensor_payloads import read_named_tensors
from areal.inference.weight_group import (
    BROADCAST_TIMEOUT_S,
    WeightUpdateRanks,
    start_weight_update_group_join,
)
from areal.utils import logging

__all__ = ["WeightUpdates"]

# the engine's logger: these are its log lines, whichever module holds the code
logger = logging.getLogger("inference.engine")


class WeightUpdates:
    """Weight-update commands of :class:`~areal.inference.engine.GenerationEngine`.

    Owns the engine's weight-update groups (set up by :meth:`_init_weight_groups`). Relies on
    the engine's ``model`` (the served ``torch.nn.Module``), ``device``, ``tp_devices`` (one
    device per TP rank), ``model_path``, ``_running`` (the running requests),
    ``_abort_all(message, include_waiting)`` and ``command(name, **kwargs)``.
    """

    model: torch.nn.Module
    device: torch.device
    tp_devices: list[torch.device]
    model_path: str
    _running: list

    def _init_weight_groups(self, weight_group_timeout: float) -> None:
        """Set up the weight-group state (called once, from the engine's ``__init__``)."""
        # ranks of weight-update groups, by group name (see areal.inference.weight_group),
        # and the joins still under way; both only touched on the engine thread
        self._weight_groups: dict[str, WeightUpdateRanks] = {}
        self._joining: dict[str, concurrent.futures.Future] = {}
        if weight_group_timeout <= 0:
            raise ValueError(f"weight_group_timeout must be > 0, got {weight_group_timeout}")
        self.weight_group_timeout = float(weight_group_timeout)
        self._weight_session = False  # between /begin_weight_update and /end_weight_update

    def join_weight_group(
        self,
        *,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> concurrent.futures.Future:
        """Join the trainer's weight-update group while generation goes on.

        The future resolves to the answer once the group is ready for
        ``update_weights_distributed``. It fails with :class:`RequestError` for a spec
        this server refuses, or with the join's error (``TimeoutError`` after
        :attr:`weight_group_timeout` when the trainer is unreachable). Cancel it to
        abandon the join.
        """
        answer: concurrent.futures.Future = concurrent.futures.Future()
        spec = dict(
            master_address=master_address,
            master_port=int(master_port),
            rank_offset=int(rank_offset),
            world_size=int(world_size),
            group_name=group_name,
            backend=backend,
        )
        started = self.command("start_weight_group_join", answer=answer, **spec)
        started.add_done_callback(lambda f: _settle_on_error(f, answer))
        return answer

    # --- commands (run on the engine thread) ---

    def _cmd_update_weights(
        self, model_path: str, abort_all_requests: bool = True
    ) -> dict[str, Any]:
        state = _read_state_dict(Path(model_path), self.device)
        try:
            state = models.hf_state_dict(self.model.config, state)
        except ValueError as e:  # an official checkpoint with a part of a tensor missing
            raise RequestError(f"checkpoint in model_path is incomplete: {e}", "model_path") from e
        current = self.model.state_dict()
        missing = sorted(k for k in set(current) - set(state) if not _is_tied(self.model, k))
        if missing:
            raise RequestError(f"checkpoint lacks tensors of the served model: {missing[:5]}")
        self._load_tensors(state, abort_all_requests)
        self.model_path = str(model_path)
        return {"success": True, "message": "Succeeded to update model weights."}

    def _weight_targets(self) -> dict[str, torch.Tensor]:
        """Every tensor a weight update may write, by name: the model's ``state_dict``
        names, and its checkpoint's official names (slices of the same storage).

        Built once and kept (a ``state_dict`` walk costs milliseconds per update): updates
        copy into these tensors in place. Whatever moves the model's tensors elsewhere
        (releasing and resuming memory) calls :meth:`_forget_weight_targets`."""
        cached = getattr(self, "_weight_targets_cache", None)
        if cached is None:
            current = self.model.state_dict()
            targets = dict(models.checkpoint_weights(self.model.config, current.items()))
            cached = self._weight_targets_cache = {**targets, **current}
        return cached

    def _forget_weight_targets(self) -> None:
        """The model's tensors moved (``model.to``): :meth:`_weight_targets` looks again."""
        self._weight_targets_cache = None

    def _load_tensors(self, state: dict[str, torch.Tensor], abort_all_requests: bool) -> None:
        """Copy ``state`` (all or part of the model's tensors, under either kind of name)
        into the served model."""
        targets = self._weight_targets()
        unknown = sorted(set(state) - set(targets))
        if unknown:
            raise RequestError(f"checkpoint has tensors the served model lacks: {unknown[:5]}")
        for name, tensor in state.items():
            if targets[name].shape != tensor.shape:
                raise RequestError(f"shape mismatch for {name}: {tuple(tensor.shape)}")
        if abort_all_requests:
            self._abort_all("Abort in-flight requests (weight update)", include_waiting=False)
        with torch.no_grad():  # one multi-tensor copy (per device and dtype pair)
            torch._foreach_copy_([targets[name] for name in state], list(state.values()))
        if self._running:  # cached keys/values come from the old weights
            logger.info("weights updated with %d requests still running", len(self._running))

    def _cmd_begin_weight_update(self) -> dict[str, Any]:
        """Open a weight-update session (SGLang 0.5.23 loads tensors only inside one)."""
        if self._weight_session:
            raise RequestError(
                "a weight-update session is already open; call end_weight_update() first"
            )
        self._weight_session = True
        return {"success": True, "message": "Success"}

    def _cmd_end_weight_update(self) -> dict[str, Any]:
        if not self._weight_session:
            raise RequestError("no weight-update session is open; call begin_weight_update() first")
        self._weight_session = False
        return {"success": True, "message": "Success"}

    def _cmd_update_weights_from_tensor(
        self,
        serialized_named_tensors: list[str],
        load_format: str | None,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """Load tensors handed over by handle (CUDA IPC, shared memory), as SGLang does:
        TP rank ``r`` reads entry ``r`` only. This server runs the model on one device:
        every rank's tensors are read and checked, rank 0's are loaded."""
        if not self._weight_session:
            raise RequestError(
                "update_weights_from_tensor must run between begin_weight_update() and "
                "end_weight_update()"
            )
        if len(serialized_named_tensors) != len(self.tp_devices):
            raise RequestError(
                f"serialized_named_tensors has {len(serialized_named_tensors)} entries for "
                f"a server of {len(self.tp_devices)} TP rank(s): send one per TP rank",
                "serialized_named_tensors",
            )
        ranks = [read_named_tensors(p, load_format) for p in serialized_named_tensors]
        first = [(name, tuple(t.shape)) for name, t in ranks[0]]
        for tp_rank, named in enumerate(ranks[1:], start=1):
            if [(name, tuple(t.shape)) for name, t in named] != first:
                raise RequestError(
                    f"TP rank {tp_rank}'s tensors differ from TP rank 0's in names or shapes",
                    "serialized_named_tensors",
                )
        state = dict(ranks[0])
        if len(state) != len(ranks[0]):
            raise RequestError("a tensor name appears twice", "serialized_named_tensors")
        self._load_tensors(state, abort_all_requests)
        logger.info(
            "loaded %d tensors handed over by handle for %d TP rank(s)", len(state), len(ranks)
        )
        return {"success": True, "message": "Success"}

    def _cmd_start_weight_group_join(
        self, answer: concurrent.futures.Future, group_name: str, backend: str, **spec: Any
    ) -> None:
        """Start joining with ranks ``rank_offset + tp_rank``; a rejoin replaces the group."""
        if backend == "nccl" and self.device.type != "cuda":
            raise RequestError("an NCCL weight-update group needs a CUDA server", "backend")
        if group_name in self._joining:
            raise RequestError(
                f"weight-update group {group_name!r} is already being joined; wait for that "
                "join to end",
                "group_name",
            )
        previous = self._weight_groups.pop(group_name, None)
        if previous is not None:
            previous.destroy()
        try:
            joining = start_weight_update_group_join(
                group_name=group_name,
                backend=backend,
                devices=self.tp_devices,
                timeout_s=self.weight_group_timeout,
                **spec,
            )
        except ValueError as e:
            raise RequestError(str(e), "rank_offset") from e
        self._joining[group_name] = joining
        joining.add_done_callback(
            lambda f: self.command(
                "finish_weight_group_join", group_name=group_name, joining=f, answer=answer
            )
        )

    def _cmd_finish_weight_group_join(
        self,
        group_name: str,
        joining: concurrent.futures.Future,
        answer: concurrent.futures.Future,
    ) -> None:
        """Register a finished join's ranks, unless its caller gave up on it meanwhile."""
        self._joining.pop(group_name, None)
        error = joining.exception()
        if error is not None:
            settle(answer, error=error)
            return
        ranks = joining.result()
        if not answer.set_running_or_notify_cancel():  # abandoned: nobody will use it
            ranks.destroy()
            return
        self._weight_groups[group_name] = ranks
        answer.set_result(
            {"success": True, "message": f"joined {group_name} as ranks {ranks.ranks}"}
        )

    def _cmd_update_weights_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str,
        abort_all_requests: bool = False,
    ) -> dict[str, Any]:
        """Receive one bucket broadcast from the trainer (rank 0) and load it."""
        group = self._weight_groups.get(group_name)
        if group is None and group_name in self._joining:
            raise RequestError(f"weight-update group {group_name!r} is still being joined")
        if group is None:
            raise RequestError(f"no weight-update group {group_name!r}; init it first")
        if not len(names) == len(dtypes) == len(shapes):
            raise RequestError("names, dtypes and shapes must have the same length", "names")
        targets = self._weight_targets()
        for name, shape in zip(names, shapes, strict=True):
            if name not in targets or tuple(targets[name].shape) != tuple(shape):
                # a wrong spec would leave the trainer blocked in its broadcast: refuse
                # before receiving, so the trainer's HTTP call fails instead
                raise RequestError(f"tensor {name!r} of shape {shape} is not in the model")
        torch_dtypes = []
        for dtype in dtypes:
            value = getattr(torch, dtype, None)
            if not isinstance(value, torch.dtype):
                raise RequestError(f"unknown dtype {dtype!r}", "dtypes")
            torch_dtypes.append(value)
        tensors = group.receive(shapes, torch_dtypes, timeout_s=BROADCAST_TIMEOUT_S)
        self._load_tensors(dict(zip(names, tensors, strict=True)), abort_all_requests)
        return {"success": True, "message": f"updated {len(names)} tensors"}


def _settle_on_error(
    future: concurrent.futures.Future, dependent: concurrent.futures.Future
) -> None:
    """Fail ``dependent`` with ``future``'s error, if it has one."""
    error = future.exception()
    if error is not None:
        settle(dependent, error=error)


def _is_tied(model: torch.nn.Module, name: str) -> bool:
    return name == "lm_head.weight" and bool(getattr(model.config, "tie_word_embeddings", False))


def _read_state_dict(path: Path, device: torch.device) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint at ``path``, read straight onto ``device`` (no host
    copy of the whole model first, then a pageable copy per tensor).

    A path that cannot be a checkpoint (missing, not a directory, too long for the OS,
    unreadable, no or broken ``*.safetensors``) is the request's fault: a
    :class:`RequestError` naming ``model_path``.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    shown = _shown(str(path))
    try:
        files = sorted(p for p in path.iterdir() if p.suffix == ".safetensors" and p.is_file())
    except FileNotFoundError:
        raise RequestError(f"model_path {shown} does not exist", "model_path") from None
    except NotADirectoryError:
        raise RequestError(f"model_path {shown} is not a directory", "model_path") from None
    except (OSError, ValueError) as e:  # ENAMETOOLONG, EACCES, ELOOP, an embedded NUL, ...
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise RequestError(f"model_path {shown} cannot be read: {reason}", "model_path") from None
    if not files:
        raise RequestError(f"no *.safetensors checkpoint in {shown}", "model_path")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(str(file), device=str(device)))
        except (OSError, SafetensorError) as e:
            raise RequestError(
                f"{_shown(file.name)} in model_path is not a readable safetensors file: {e}",
                "model_path",
            ) from None
    return state


def _shown(text: str, limit: int = 120) -> str:
    """``text`` quoted for an error message, cut to ``limit`` characters."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"
