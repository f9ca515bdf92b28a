"""Import an object from a dotted path (``examples.swe.reward_transforms.identity_reward``)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["import_from_string"]


def import_from_string(path: str) -> Any:
    """The object named by ``package.module.attribute`` (nested attributes allowed).

    The longest importable module prefix is imported, then the remaining parts are read
    as attributes. Errors name the path and say which part was not found.
    """
    if not isinstance(path, str) or not path.strip():
        raise ValueError(f"expected a dotted path 'package.module.attribute', got {path!r}")
    path = path.strip()
    parts = path.split(".")
    if len(parts) < 2 or not all(p.isidentifier() for p in parts):
        raise ValueError(f"expected a dotted path 'package.module.attribute', got {path!r}")
    module = None
    error: ImportError | None = None
    for split in range(len(parts) - 1, 0, -1):
        module_name = ".".join(parts[:split])
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            # Only swallow "this prefix is not a module"; a missing dependency inside a
            # real module must surface as itself.
            if e.name is not None and module_name.startswith(e.name):
                error = e
                continue
            raise
        obj: Any = module
        for i, attr in enumerate(parts[split:], start=split):
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                owner = ".".join(parts[:i])
                raise ImportError(
                    f"cannot import {path!r}: {owner!r} has no attribute {attr!r}"
                ) from None
        return obj
    raise ImportError(f"cannot import {path!r}: no module {parts[0]!r} found") from error
