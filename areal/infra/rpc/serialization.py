"""JSON-safe encoding of RPC arguments and results, with typed envelopes.

Plain JSON values pass through unchanged. Everything else becomes an *envelope*, a JSON
object whose ``"__areal_type__"`` key names the kind:

=============  ==============================================================
``tensor``     torch tensor: ``dtype``, ``shape``, ``data`` (base64 of the raw bytes);
               always detached and on CPU after decoding
``ndarray``    numpy array: ``dtype`` (numpy type string), ``shape``, ``data``
``ndscalar``   numpy scalar: ``dtype``, ``data``
``torch_dtype``  ``name`` (``"bfloat16"``)
``dataclass``  ``module``, ``qualname``, ``fields`` (encoded); rebuilt by calling the class
``enum``       ``module``, ``qualname``, ``name``
``secret``     a :class:`SecretStr`: ``value`` (``null`` when redacted), or ``env``: the
               variable that holds it on the worker (:mod:`~areal.infra.rpc.secret_env`)
``tuple``, ``set``, ``frozenset``  ``items``
``dict``       ``items`` as ``[key, value]`` pairs (non-string keys, or a key that
               collides with ``"__areal_type__"``)
``bytes``      ``data`` (base64)
``float``      ``value``: ``"nan"``, ``"inf"`` or ``"-inf"`` (JSON has no literal for them)
``int``        ``value``: decimal text of an integer beyond the 64-bit range
``path``       ``value`` (a :class:`pathlib.Path`)
=============  ==============================================================

Decoding imports the class an envelope names, so only classes defined under the module
prefixes in :data:`ALLOWED_MODULE_PREFIXES` are rebuilt; any other path is refused with
:class:`SerializationError` (on both ends, so a sender learns early). Nothing here uses
pickle.

The reference framework kept tensors in a per-worker store and sent references
(``RTensor``). This port sends every tensor *by value* inside the JSON body instead:
Arena's per-step data (a few hundred sequences) is small enough, and a by-value payload
has no cross-worker lifetime to manage.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import importlib
import math
import pathlib
import sys
from collections.abc import Mapping
from typing import Any

import orjson

from areal.infra.rpc.secret_env import read_secret
from areal.utils.secrets import SecretStr

__all__ = [
    "ALLOWED_MODULE_PREFIXES",
    "TYPE_KEY",
    "SerializationError",
    "deserialize_value",
    "json_dumps",
    "json_loads",
    "serialize_value",
]

TYPE_KEY = "__areal_type__"
# how secrets are encoded: in clear, redacted, or as {secret value: worker variable name}
# (a name "" marks a secret of the run that this receiver is not given: sent redacted)
_Secrets = bool | Mapping[str, str]
# JSON parsers (orjson among them) do not keep integers beyond 64 bits exact.
_INT_MIN, _INT_MAX = -(2**63), 2**64 - 1
# Top-level packages whose dataclasses and enums may be rebuilt on the receiving side.
ALLOWED_MODULE_PREFIXES = ("areal", "examples", "tests")


class SerializationError(ValueError):
    """A value cannot be encoded, or an envelope cannot (or may not) be decoded."""


# --- encoding ---


def serialize_value(
    value: Any, *, reveal_secrets: bool = True, secret_env: Mapping[str, str] | None = None
) -> Any:
    """``value`` as a JSON-safe structure (see the module docstring).

    With ``reveal_secrets=False`` every :class:`SecretStr` is sent redacted and arrives
    empty. With ``secret_env`` (secret value -> name of the worker environment variable
    holding it, see :func:`~areal.infra.rpc.secret_env.secret_refs`) none is sent in
    clear either: each goes as that name and is rebuilt from the receiver's environment,
    one mapped to ``""`` (withheld from this receiver) goes redacted, and a non-empty
    secret missing from the mapping raises :class:`SerializationError` (it could not
    reach the receiver).
    """
    secrets: _Secrets = secret_env if secret_env is not None else reveal_secrets
    return _encode(value, "value", secrets)


def _envelope(kind: str, **fields: Any) -> dict[str, Any]:
    return {TYPE_KEY: kind, **fields}


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode("ascii")


def _encode_secret(value: SecretStr, path: str, secrets: _Secrets) -> dict[str, Any]:
    if secrets is True or not value:
        return _envelope("secret", value=value.reveal())
    if secrets is False:
        return _envelope("secret", value=None)
    name = secrets.get(value.reveal())
    if name == "":  # the run's secret, withheld from this receiver (it does not use it)
        return _envelope("secret", value=None)
    if name is None:
        raise SerializationError(
            f"cannot send the secret at {path}: workers receive secrets only through their "
            "environment, and this one is not in the experiment config the scheduler "
            "exported (set it in the config before the workers start)"
        )
    return _envelope("secret", value=None, env=name)


def _encode(value: Any, path: str, reveal: _Secrets) -> Any:
    if value is None or isinstance(value, bool):
        return value
    if isinstance(value, SecretStr):
        return _encode_secret(value, path, reveal)
    if isinstance(value, enum.Enum):
        cls = type(value)
        _check_allowed(cls.__module__, cls.__qualname__, "enum", path)
        return _envelope("enum", module=cls.__module__, qualname=cls.__qualname__, name=value.name)
    if isinstance(value, int):
        if _INT_MIN <= value <= _INT_MAX:
            return int(value)
        return _envelope("int", value=str(int(value)))
    if isinstance(value, float):
        if math.isfinite(value):
            return float(value)
        return _envelope("float", value=repr(float(value)))
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, list):
        return [_encode(v, f"{path}[{i}]", reveal) for i, v in enumerate(value)]
    if isinstance(value, tuple):
        items = [_encode(v, f"{path}[{i}]", reveal) for i, v in enumerate(value)]
        return _envelope("tuple", items=items)
    if isinstance(value, dict):
        return _encode_dict(value, path, reveal)
    if isinstance(value, (set, frozenset)):
        kind = "frozenset" if isinstance(value, frozenset) else "set"
        return _envelope(kind, items=[_encode(v, f"{path}{{}}", reveal) for v in value])
    if isinstance(value, (bytes, bytearray)):
        return _envelope("bytes", data=_b64(bytes(value)))
    if isinstance(value, pathlib.PurePath):
        return _envelope("path", value=str(value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _encode_dataclass(value, path, reveal)
    encoded = _encode_array(value, path)
    if encoded is not None:
        return encoded
    raise SerializationError(
        f"cannot send {type(value).__module__}.{type(value).__qualname__} at {path} over RPC: "
        "supported are JSON values, tuples, sets, bytes, tensors, numpy arrays, torch "
        "dtypes, enums and dataclasses defined under areal., examples. or tests."
    )


def _encode_dict(value: dict, path: str, reveal: _Secrets) -> Any:
    if all(isinstance(k, str) for k in value) and TYPE_KEY not in value:
        return {str.__str__(k): _encode(v, f"{path}[{k!r}]", reveal) for k, v in value.items()}
    items = [
        [_encode(k, f"{path}.<key>", reveal), _encode(v, f"{path}[{k!r}]", reveal)]
        for k, v in value.items()
    ]
    return _envelope("dict", items=items)


def _encode_dataclass(value: Any, path: str, reveal: _Secrets) -> dict[str, Any]:
    cls = type(value)
    _check_allowed(cls.__module__, cls.__qualname__, "dataclass", path)
    fields = {
        f.name: _encode(getattr(value, f.name), f"{path}.{f.name}", reveal)
        for f in dataclasses.fields(value)
    }
    return _envelope("dataclass", module=cls.__module__, qualname=cls.__qualname__, fields=fields)


def _encode_array(value: Any, path: str) -> dict[str, Any] | None:
    """Tensors, torch dtypes and numpy values; ``None`` for anything else.

    torch and numpy are only consulted when already imported: a value of their types
    cannot exist otherwise, and the controller need not pay for importing them.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        if isinstance(value, torch.Tensor):
            return _encode_tensor(torch, value, path)
        if isinstance(value, torch.dtype):
            return _envelope("torch_dtype", name=str(value).removeprefix("torch."))
    np = sys.modules.get("numpy")
    if np is not None:
        if isinstance(value, np.ndarray):
            _check_numpy_dtype(value.dtype, path)
            data = _b64(np.ascontiguousarray(value).tobytes())
            return _envelope("ndarray", dtype=value.dtype.str, shape=list(value.shape), data=data)
        if isinstance(value, np.generic):
            _check_numpy_dtype(value.dtype, path)
            return _envelope("ndscalar", dtype=value.dtype.str, data=_b64(value.tobytes()))
    return None


def _encode_tensor(torch: Any, value: Any, path: str) -> dict[str, Any]:
    if value.layout != torch.strided:
        raise SerializationError(f"cannot send a {value.layout} tensor at {path}; densify it first")
    try:
        t = value.detach().resolve_conj().resolve_neg().to("cpu").contiguous()
        raw = t.reshape(-1).view(torch.uint8).numpy().tobytes()
    except (RuntimeError, TypeError) as e:
        raise SerializationError(f"cannot send the {value.dtype} tensor at {path}: {e}") from e
    dtype = str(t.dtype).removeprefix("torch.")
    return _envelope("tensor", dtype=dtype, shape=list(t.shape), data=_b64(raw))


def _check_numpy_dtype(dtype: Any, path: str) -> None:
    if dtype.hasobject or dtype.fields is not None:
        raise SerializationError(f"cannot send a numpy array of dtype {dtype} at {path}")


# --- decoding ---


def deserialize_value(data: Any) -> Any:
    """The value :func:`serialize_value` encoded into ``data``."""
    return _decode(data)


def _decode(data: Any) -> Any:
    if isinstance(data, list):
        return [_decode(v) for v in data]
    if not isinstance(data, dict):
        return data
    kind = data.get(TYPE_KEY)
    if kind is None:
        return {k: _decode(v) for k, v in data.items()}
    decoder = _DECODERS.get(kind)
    if decoder is None:
        raise SerializationError(f"unknown envelope type {kind!r}")
    try:
        return decoder(data)
    except SerializationError:
        raise
    except (KeyError, TypeError, ValueError) as e:
        raise SerializationError(f"malformed {kind!r} envelope: {type(e).__name__}: {e}") from e


def _decode_tensor(data: dict[str, Any]) -> Any:
    import torch

    dtype = _decode_torch_dtype({"name": data["dtype"]})
    shape = [int(n) for n in data["shape"]]
    raw = base64.b64decode(data["data"])
    if not raw:
        return torch.empty(shape, dtype=dtype)
    flat = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return flat.view(dtype).reshape(shape)


def _decode_torch_dtype(data: dict[str, Any]) -> Any:
    import torch

    dtype = getattr(torch, str(data["name"]), None)
    if not isinstance(dtype, torch.dtype):
        raise SerializationError(f"unknown torch dtype {data['name']!r}")
    return dtype


def _decode_ndarray(data: dict[str, Any]) -> Any:
    import numpy as np

    dtype = np.dtype(data["dtype"])
    _check_numpy_dtype(dtype, "envelope")
    shape = [int(n) for n in data["shape"]]
    return np.frombuffer(base64.b64decode(data["data"]), dtype=dtype).reshape(shape).copy()


def _decode_ndscalar(data: dict[str, Any]) -> Any:
    import numpy as np

    dtype = np.dtype(data["dtype"])
    _check_numpy_dtype(dtype, "envelope")
    return np.frombuffer(base64.b64decode(data["data"]), dtype=dtype)[0]


def _decode_dataclass(data: dict[str, Any]) -> Any:
    cls = _import_allowed(data["module"], data["qualname"], "dataclass")
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise SerializationError(f"{data['module']}.{data['qualname']} is not a dataclass")
    known = {f.name: f for f in dataclasses.fields(cls)}
    fields = {name: _decode(v) for name, v in data["fields"].items()}
    unknown = sorted(set(fields) - set(known))
    if unknown:
        raise SerializationError(f"{cls.__qualname__} has no fields {unknown}")
    try:
        instance = cls(**{k: v for k, v in fields.items() if known[k].init})
    except (ValueError, AssertionError) as e:
        # Field validation that the sender already passed can fail on this side when
        # secrets arrive redacted (an empty API key): rebuild the fields as sent.
        missing = sorted(k for k, f in known.items() if f.init and k not in fields)
        if missing:
            raise SerializationError(f"{cls.__qualname__}: {e} (missing fields {missing})") from e
        instance = cls.__new__(cls)
    for name, value in fields.items():
        if not known[name].init or name not in instance.__dict__:
            object.__setattr__(instance, name, value)
    return instance


def _decode_enum(data: dict[str, Any]) -> Any:
    cls = _import_allowed(data["module"], data["qualname"], "enum")
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
        raise SerializationError(f"{data['module']}.{data['qualname']} is not an enum")
    return cls[data["name"]]


def _decode_float(data: dict[str, Any]) -> float:
    value = data["value"]
    if value not in ("nan", "inf", "-inf"):
        raise SerializationError(f"unexpected non-finite float {value!r}")
    return float(value)


def _decode_secret(data: dict[str, Any]) -> SecretStr:
    name = data.get("env")
    if name is None:
        return SecretStr(data["value"] or "")
    try:
        return read_secret(str(name))
    except KeyError as e:
        raise SerializationError(f"secret not available: {e.args[0]}") from None


def _decode_dict(data: dict[str, Any]) -> dict:
    return {_decode(k): _decode(v) for k, v in data["items"]}


_DECODERS = {
    "tensor": _decode_tensor,
    "torch_dtype": _decode_torch_dtype,
    "ndarray": _decode_ndarray,
    "ndscalar": _decode_ndscalar,
    "dataclass": _decode_dataclass,
    "enum": _decode_enum,
    "secret": _decode_secret,
    "tuple": lambda d: tuple(_decode(v) for v in d["items"]),
    "set": lambda d: {_decode(v) for v in d["items"]},
    "frozenset": lambda d: frozenset(_decode(v) for v in d["items"]),
    "dict": _decode_dict,
    "bytes": lambda d: base64.b64decode(d["data"]),
    "float": _decode_float,
    "int": lambda d: int(d["value"]),
    "path": lambda d: pathlib.Path(d["value"]),
}


# --- class allowlist ---


def _is_allowed_module(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in ALLOWED_MODULE_PREFIXES)


def _check_allowed(module: str, qualname: str, what: str, path: str) -> None:
    if not _is_allowed_module(module):
        raise SerializationError(
            f"the {what} {module}.{qualname} at {path} cannot travel over RPC: only classes "
            f"defined under {', '.join(p + '.' for p in ALLOWED_MODULE_PREFIXES)} are rebuilt "
            "by workers; convert it to a dict or move it into one of those packages"
        )
    if "<locals>" in qualname:
        raise SerializationError(
            f"the {what} {module}.{qualname} at {path} is defined inside a function and cannot "
            "be imported by a worker; define it at module level"
        )


def _import_allowed(module: str, qualname: str, what: str) -> Any:
    if not isinstance(module, str) or not isinstance(qualname, str):
        raise SerializationError(f"malformed {what} envelope: module and qualname must be strings")
    _check_allowed(module, qualname, what, "envelope")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise SerializationError(f"cannot import {what} {module}.{qualname}: {e}") from e
    return obj


# --- JSON text ---


def json_dumps(data: Any) -> bytes:
    """JSON bytes of a structure :func:`serialize_value` produced."""
    return orjson.dumps(data)


def json_loads(raw: bytes | str) -> Any:
    """Parse JSON text; raises ``ValueError`` when it is not JSON."""
    return orjson.loads(raw)
