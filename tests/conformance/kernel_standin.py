"""Stand-in for SGLang's GPU kernel package: importable, holds no kernels, fails when called.

The conformance installer writes this file as ``<cache>/<version>/sgl_kernel/__init__.py``.
SGLang imports kernel names at module level (``from sgl_kernel.kvcacheio import ...``), so
every attribute and submodule resolves to a placeholder; calling one raises, so a check that
reached a GPU kernel would fail loudly instead of passing on a fake result.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from typing import Any

STANDIN = True  # lets the tier assert that this, not a real kernel package, was imported


class KernelPlaceholder:
    """Any kernel name: attributes chain, calls raise."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, item: str) -> KernelPlaceholder:
        if item.startswith("__"):
            raise AttributeError(item)
        return KernelPlaceholder(f"{self._name}.{item}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name} is a GPU kernel; this is the conformance stand-in")

    def __repr__(self) -> str:
        return f"<kernel stand-in {self._name}>"


class _StandinModule(types.ModuleType):
    def __getattr__(self, item: str) -> KernelPlaceholder:
        if item.startswith("__"):
            raise AttributeError(item)
        return KernelPlaceholder(f"{self.__name__}.{item}")


class _SubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``<package>.<anything>`` as another placeholder module."""

    def __init__(self, package: str):
        self.package = package

    def find_spec(self, fullname: str, path: Any = None, target: Any = None):
        if fullname.startswith(self.package + "."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _StandinModule(spec.name)
        module.__path__ = []
        module.STANDIN = True
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


sys.modules[__name__].__class__ = _StandinModule
sys.meta_path.insert(0, _SubmoduleFinder(__name__))
