"""Reading the tensor payloads of ``/update_weights_from_tensor``, as SGLang reads them.

Each entry of ``serialized_named_tensors`` is a base64 ``ForkingPickler`` dump for one TP
rank; each rank decodes only its own entry (SGLang: decoding another rank's copy would
break the sender's CUDA IPC reference counts). A dump is unpickled by a restricted
unpickler that resolves only the globals a tensor payload needs: plain containers, torch
dtypes and sizes, torch's tensor and storage rebuild functions (CUDA IPC handles and CPU
shared memory) and ``types.SimpleNamespace`` for a flattened bucket's records. Anything
else is refused before it is called, so a request cannot run code through a pickle.

Payload shapes (``load_format``):

* ``None`` or ``"direct"``: a list of ``(name, tensor)`` pairs;
* ``"flattened_bucket"``: ``{"flattened_tensor": uint8 tensor, "metadata": [record]}``,
  each record with ``name``, ``shape``, ``dtype``, ``start_idx``, ``end_idx`` (byte
  offsets into the flat tensor) and ``numel``; a tensor is the record's byte range viewed
  as its dtype and shape.

A CUDA tensor's device may arrive as an index or as the device's UUID (SGLang's senders
patch torch's reductions to send UUIDs, since the processes number GPUs differently); a
UUID is mapped to this process's index of that GPU.
"""

from __future__ import annotations

import base64
import binascii
import io
import pickle
import types
from typing import Any

import torch
from torch.multiprocessing import reductions

from areal.inference.errors import RequestError

__all__ = ["LOAD_FORMATS", "read_named_tensors"]

LOAD_FORMATS = (None, "direct", "flattened_bucket")
_DEVICE_ARG = 6  # the device's place in rebuild_cuda_tensor's arguments


def _rebuild_cuda_tensor(*args: Any) -> torch.Tensor:
    device = args[_DEVICE_ARG]
    if isinstance(device, str):
        args = (*args[:_DEVICE_ARG], _device_index(device), *args[_DEVICE_ARG + 1 :])
    return reductions.rebuild_cuda_tensor(*args)


def _device_index(uuid: str) -> int:
    for index in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(index).uuid) == uuid:
            return index
    raise RequestError(f"a tensor lives on GPU {uuid}, which this server cannot see")


def _allowed() -> dict[tuple[str, str], Any]:
    import builtins
    import collections

    allowed: dict[tuple[str, str], Any] = {
        ("builtins", name): getattr(builtins, name)
        for name in (
            "bool",
            "bytes",
            "bytearray",
            "dict",
            "float",
            "frozenset",
            "int",
            "list",
            "set",
            "slice",
            "str",
            "tuple",
        )
    }
    allowed[("collections", "OrderedDict")] = collections.OrderedDict
    allowed[("copyreg", "__newobj__")] = __import__("copyreg").__newobj__
    allowed[("types", "SimpleNamespace")] = types.SimpleNamespace
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch", "Tensor")] = torch.Tensor
    allowed[("torch", "device")] = torch.device
    allowed[("torch.nn.parameter", "Parameter")] = torch.nn.Parameter
    allowed[("torch.storage", "UntypedStorage")] = torch.UntypedStorage
    allowed[("torch.storage", "TypedStorage")] = torch.TypedStorage  # a CUDA tensor's storage
    allowed[("torch", "UntypedStorage")] = torch.UntypedStorage
    for name in dir(torch):
        value = getattr(torch, name, None)
        if isinstance(value, torch.dtype):
            allowed[("torch", name)] = value
    for name in (
        "rebuild_tensor",
        "rebuild_typed_storage",
        "rebuild_storage_filename",
        "rebuild_storage_empty",
        "rebuild_meta_tensor",
        "rebuild_nested_tensor",
    ):
        if hasattr(reductions, name):
            allowed[("torch.multiprocessing.reductions", name)] = getattr(reductions, name)
    allowed[("torch.multiprocessing.reductions", "rebuild_cuda_tensor")] = _rebuild_cuda_tensor
    allowed[("torch._utils", "_rebuild_tensor_v2")] = torch._utils._rebuild_tensor_v2
    return allowed


class _Unpickler(pickle.Unpickler):
    allowed = _allowed()

    def find_class(self, module: str, name: str) -> Any:
        value = self.allowed.get((module, name))
        if value is None:
            raise RequestError(
                f"serialized_named_tensors may hold tensors only; it refers to {module}.{name}",
                "serialized_named_tensors",
            )
        return value


def read_named_tensors(payload: str, load_format: str | None) -> list[tuple[str, torch.Tensor]]:
    """The ``(name, tensor)`` pairs of one TP rank's payload (tensors map the sender's
    memory: copy them before the sender is told the update is done)."""
    if load_format not in LOAD_FORMATS:
        raise RequestError(
            f"load_format {load_format!r} is not one this server loads; use one of "
            f"{', '.join(repr(f) for f in LOAD_FORMATS)}",
            "load_format",
        )
    try:
        raw = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise RequestError(
            "serialized_named_tensors entries must be base64 strings",
            "serialized_named_tensors",
        ) from None
    try:
        data = _Unpickler(io.BytesIO(raw)).load()
    except RequestError:
        raise
    except Exception as e:  # a truncated or foreign dump, or a handle that cannot be opened
        raise RequestError(
            f"a serialized_named_tensors entry cannot be read: {type(e).__name__}: {e}",
            "serialized_named_tensors",
        ) from None
    if load_format == "flattened_bucket":
        return _flattened(data)
    return _pairs(data)


def _pairs(data: Any) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(data, (list, tuple)) or not all(
        isinstance(p, (list, tuple))
        and len(p) == 2
        and isinstance(p[0], str)
        and isinstance(p[1], torch.Tensor)
        for p in data
    ):
        raise RequestError(
            "a direct payload must be a list of (name, tensor) pairs; send load_format: "
            "flattened_bucket for a flattened bucket",
            "serialized_named_tensors",
        )
    return [(name, tensor) for name, tensor in data]


def _flattened(data: Any) -> list[tuple[str, torch.Tensor]]:
    if not isinstance(data, dict) or set(data) != {"flattened_tensor", "metadata"}:
        raise RequestError(
            "a flattened_bucket payload is a dict of flattened_tensor and metadata",
            "serialized_named_tensors",
        )
    flat, metadata = data["flattened_tensor"], data["metadata"]
    if not isinstance(flat, torch.Tensor) or flat.dim() != 1 or flat.dtype != torch.uint8:
        raise RequestError(
            "flattened_tensor must be a one-dimensional uint8 tensor", "serialized_named_tensors"
        )
    out = []
    for record in metadata if isinstance(metadata, (list, tuple)) else [None]:
        try:
            name, shape, dtype = str(record.name), torch.Size(record.shape), record.dtype
            start, end = int(record.start_idx), int(record.end_idx)
        except (AttributeError, TypeError, ValueError):
            raise RequestError(
                "each flattened_bucket metadata record needs name, shape, dtype, start_idx "
                "and end_idx",
                "serialized_named_tensors",
            ) from None
        if not isinstance(dtype, torch.dtype) or not 0 <= start <= end <= flat.numel():
            raise RequestError(
                f"metadata of {name!r} does not fit the flattened tensor",
                "serialized_named_tensors",
            )
        if end - start != shape.numel() * dtype.itemsize:
            raise RequestError(
                f"{name!r}: bytes {start}..{end} do not hold a {dtype} tensor of shape "
                f"{tuple(shape)}",
                "serialized_named_tensors",
            )
        try:
            out.append((name, flat[start:end].view(dtype).reshape(shape)))
        except RuntimeError as e:  # e.g. a start not aligned to the dtype's size
            raise RequestError(f"{name!r}: {e}", "serialized_named_tensors") from None
    return out
