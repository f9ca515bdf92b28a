"""Names a package exports without importing the modules behind them until first use."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any

__all__ = ["lazy_exports"]


def lazy_exports(
    package: str, exports: Mapping[str, str], names: list[str]
) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """A package's module-level ``__getattr__`` and ``__dir__`` for ``exports``.

    ``exports`` maps each name to the module that defines it; a name mapped to
    ``"module:"`` is that module itself. ``names`` is the package's ``__all__``.
    """

    def getattr_(name: str) -> Any:
        target = exports.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        if target.endswith(":"):
            return importlib.import_module(target[:-1])
        return getattr(importlib.import_module(target), name)

    def dir_() -> list[str]:
        return sorted({*importlib.import_module(package).__dict__, *names})

    return getattr_, dir_
