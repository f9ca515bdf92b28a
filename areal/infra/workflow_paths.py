"""Checking a workflow or agent import path in the process that starts a run.

Rollout workers import the path they are given. A path that does not import, or that
names neither a workflow nor an agent, would otherwise surface only once every worker is
up (and, taken for an agent, after the rollout proxies too). Entry points resolve it here
first, so the run is refused before any worker starts, with the reason.
"""

from __future__ import annotations

import importlib
import inspect
import types
from typing import Any, Literal

from areal.api.workflow_api import RolloutWorkflow

__all__ = ["PATH_FORMS", "WorkflowKind", "WorkflowPathError", "import_path", "workflow_kind"]

WorkflowKind = Literal["workflow", "agent"]

PATH_FORMS = (
    "a workflow path is 'package.module.Name' naming a RolloutWorkflow subclass or instance; "
    "an agent path names a class or object with 'async def run(data, **kwargs)'; either must "
    "import in the process that starts the run, as it will on the rollout workers"
)


class WorkflowPathError(ImportError):
    """A workflow or agent path that cannot be used; the message says why and what it must be."""

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"workflow/agent path {path!r}: {reason}; {PATH_FORMS}")


def _missing(owner: Any, owner_name: str, name: str, part: str) -> str:
    """Why ``part`` of ``owner`` was found neither as an attribute nor as a submodule."""
    if isinstance(owner, types.ModuleType) and hasattr(owner, "__path__"):
        return f"does not import (ModuleNotFoundError: no module named {name!r})"
    kind = "module" if isinstance(owner, types.ModuleType) else "object"
    return f"does not import (AttributeError: {kind} {owner_name!r} has no attribute {part!r})"


def import_path(path: str) -> Any:
    """The object ``path`` names; :class:`WorkflowPathError` says which part did not import.

    Each dotted part is read as an attribute of what precedes it, or else imported as a
    submodule. A module that exists but fails to import (a missing dependency, a syntax
    error) is reported with the error it raised.
    """
    parts = path.strip().split(".") if isinstance(path, str) else []
    if len(parts) < 2 or not all(part.isidentifier() for part in parts):
        raise WorkflowPathError(str(path), "is not a dotted 'package.module.Name' path")
    obj: Any = None
    for i, part in enumerate(parts):
        name = ".".join(parts[: i + 1])
        if i > 0 and hasattr(obj, part):
            obj = getattr(obj, part)
            continue
        if i == 0 or isinstance(obj, types.ModuleType):
            try:
                obj = importlib.import_module(name)
                continue
            except ModuleNotFoundError as e:
                if e.name != name:  # the module exists; something it imports does not
                    raise WorkflowPathError(
                        path,
                        f"does not import: importing module {name!r} raised "
                        f"ModuleNotFoundError: no module named {e.name!r}",
                    ) from e
                if i == 0:
                    raise WorkflowPathError(
                        path, f"does not import (ModuleNotFoundError: no module named {name!r})"
                    ) from e
            except Exception as e:  # the module's own code failed
                raise WorkflowPathError(
                    path,
                    f"does not import: importing module {name!r} raised {type(e).__name__}: {e}",
                ) from e
        raise WorkflowPathError(path, _missing(obj, ".".join(parts[:i]), name, part))
    return obj


def workflow_kind(workflow: Any) -> WorkflowKind:
    """``"workflow"`` for a :class:`RolloutWorkflow` (instance, class or path to one),
    ``"agent"`` for a class or object with ``async def run``; raises otherwise.

    A path is imported here (:func:`import_path`); a path that does not import, or names
    something else, raises :class:`WorkflowPathError`, any other object ``TypeError``.
    """
    target = import_path(workflow) if isinstance(workflow, str) else workflow
    if isinstance(target, RolloutWorkflow) or (
        isinstance(target, type) and issubclass(target, RolloutWorkflow)
    ):
        return "workflow"
    if inspect.iscoroutinefunction(getattr(target, "run", None)):
        return "agent"
    if isinstance(workflow, str):
        raise WorkflowPathError(
            workflow,
            f"imports, but names {target!r}, neither a RolloutWorkflow nor an agent with "
            "'async def run'",
        )
    raise TypeError(f"{workflow!r} is neither a RolloutWorkflow nor an agent; {PATH_FORMS}")
