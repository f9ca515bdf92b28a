"""Tensors handed to a colocated inference server by handle (``awex`` weight updates).

SGLang's ``/update_weights_from_tensor`` takes, for each TP rank of a server, one base64
string: a ``multiprocessing`` ``ForkingPickler`` dump of what that rank loads. Pickled
that way a CUDA tensor travels as a CUDA IPC handle and a CPU tensor in shared memory
is named by its file, so the server maps the sender's memory instead of receiving a copy.
With ``load_format: flattened_bucket`` the dump is a dict: ``flattened_tensor``, every
tensor's bytes one after the other in one ``uint8`` tensor, and ``metadata``, one record
per tensor (``name``, ``shape``, ``dtype``, ``start_idx``, ``end_idx``, ``numel``, byte
offsets into the flat tensor). The records are ``types.SimpleNamespace`` objects: SGLang
reads only their attributes, and its restricted unpickler admits that class in every
supported version without this package being installed next to the server.

Two details follow what SGLang's own senders do:

* a CUDA tensor names its device by UUID, not index: the server's process numbers its
  GPUs after its own ``CUDA_VISIBLE_DEVICES``, which differs from the trainer rank's when
  a TP server spans several actor ranks' GPUs (SGLang's patched torch reductions map the
  UUID back to a local index; so does the embedded server);
* a CPU tensor goes through torch's ``file_system`` sharing strategy: the default
  ``file_descriptor`` strategy passes descriptors over a socket to a child process, which
  an unrelated server process does not have.

The sender must keep every shared tensor alive until each server has answered, then drop
it (and on GPUs call ``torch.cuda.ipc_collect``): :class:`SharedBuckets`.
"""

from __future__ import annotations

import base64
import io
import types
from collections.abc import Iterable
from multiprocessing.reduction import ForkingPickler

import torch
import torch.multiprocessing as torch_mp  # registers torch's reductions with ForkingPickler
from torch.multiprocessing import reductions

__all__ = ["FLATTENED_BUCKET", "SharedBuckets", "flatten_bucket", "serialize"]

FLATTENED_BUCKET = "flattened_bucket"
_ALIGN = 16  # each tensor starts at a multiple of this many bytes of the flat tensor
_DEVICE_ARG = 6  # the device's place in rebuild_cuda_tensor's arguments (torch >= 2.0)


def flatten_bucket(
    named: Iterable[tuple[str, torch.Tensor]],
    device: torch.device,
    dtype: torch.dtype | None = None,
) -> dict:
    """The ``flattened_bucket`` payload of ``named`` (copied once into a new flat tensor on
    ``device``, in shared memory on CPU). With ``dtype`` every tensor is sent in that dtype,
    converted as it is copied in (no intermediate copy); otherwise each keeps its own."""
    named = list(named)
    if not named:
        raise ValueError("a weight bucket needs at least one tensor")
    dtypes = [dtype or tensor.dtype for _, tensor in named]
    sizes = [t.numel() * d.itemsize for (_, t), d in zip(named, dtypes, strict=True)]
    spans = [_aligned(n) for n in sizes]
    total = sum(spans)
    if device.type == "cpu":
        torch_mp.set_sharing_strategy("file_system")  # before the memory is shared
        flat = torch.empty(total, dtype=torch.uint8).share_memory_()
    else:
        flat = torch.empty(total, dtype=torch.uint8, device=device)
    # one dtype, one device: one split of the flat tensor, one multi-tensor copy
    at_once = len(set(dtypes)) == 1 and all(t.device == flat.device for _, t in named)
    if at_once:
        itemsize = dtypes[0].itemsize
        chunks = flat.view(dtypes[0]).split([span // itemsize for span in spans])
        targets = [c[: t.numel()].view(t.shape) for c, (_, t) in zip(chunks, named, strict=True)]
        with torch.no_grad():
            torch._foreach_copy_(targets, [tensor for _, tensor in named])
    starts = [0]
    for span in spans[:-1]:
        starts.append(starts[-1] + span)
    metadata = []
    for (name, tensor), d, start, nbytes in zip(named, dtypes, starts, sizes, strict=True):
        if not at_once:
            flat[start : start + nbytes].view(d).view(tensor.shape).copy_(tensor)
        metadata.append(
            types.SimpleNamespace(
                name=name,
                shape=torch.Size(tensor.shape),
                dtype=d,
                start_idx=start,
                end_idx=start + nbytes,
                numel=nbytes,
            )
        )
    return {"flattened_tensor": flat, "metadata": metadata}


def serialize(obj: object) -> str:
    """``obj`` as one entry of ``serialized_named_tensors``: a base64 ``ForkingPickler``
    dump whose tensors travel by handle."""
    if any(t.device.type == "cpu" for t in _tensors(obj)):
        torch_mp.set_sharing_strategy("file_system")
    buffer = io.BytesIO()
    pickler = ForkingPickler(buffer)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor
    pickler.dump(obj)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class SharedBuckets:
    """The tensors of the payloads handed out for one update, alive until :meth:`release`."""

    def __init__(self) -> None:
        self._alive: list[torch.Tensor] = []

    def share(
        self,
        named: Iterable[tuple[str, torch.Tensor]],
        device: torch.device,
        dtype: torch.dtype | None = None,
    ) -> str:
        """One ``flattened_bucket`` payload of ``named`` (sent in ``dtype``, when given);
        its flat tensor is kept alive."""
        bucket = flatten_bucket(named, device, dtype)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # the server reads it at once
        self._alive.append(bucket["flattened_tensor"])
        return serialize(bucket)

    def __len__(self) -> int:
        return len(self._alive)

    def release(self) -> None:
        """Drop every shared tensor (each server has answered); on GPUs, let CUDA free the
        memory the servers mapped."""
        on_gpu = any(t.is_cuda for t in self._alive)
        self._alive.clear()
        if on_gpu:
            torch.cuda.ipc_collect()


def _reduce_tensor(tensor: torch.Tensor):
    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        uuid = str(torch.cuda.get_device_properties(args[_DEVICE_ARG]).uuid)
        args = (*args[:_DEVICE_ARG], uuid, *args[_DEVICE_ARG + 1 :])
    return rebuild, args


def _tensors(obj: object) -> Iterable[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN
