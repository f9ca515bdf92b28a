"""Typed engine calls: a controller calls a worker's engine through a proxy of its interface.

``RemoteEngine(scheduler, worker_id, TrainEngine)`` stands for the engine on that worker.
Its attributes are the methods of the interface (:func:`~areal.api.engine_api.
interface_methods`); any other name is an ``AttributeError`` naming the interface, and
a call whose arguments do not bind to the interface method's signature is a
``TypeError``, both before anything is sent. So a renamed or mistyped engine method
fails a controller's unit tests instead of a run's first step, and the worker's ``/call``
accepts exactly these names.

``engine.set_version(3)`` blocks until the worker answers; ``engine.set_version.acall(3)``
is the awaitable form, for fanning one call out to many workers with ``asyncio.gather``
on the RPC loop. How the worker runs a call (``rpc_meta``, timeouts, retries) is set per
proxy with :meth:`RemoteEngine.with_options`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Awaitable
from typing import Any, Generic, TypeVar

from areal.api.engine_api import interface_methods
from areal.api.scheduler_api import Scheduler

__all__ = ["CALL_OPTIONS", "RemoteEngine", "RemoteMethod"]

E = TypeVar("E")

CALL_OPTIONS = frozenset({"rpc_meta", "http_timeout", "max_retries", "retry_delay"})
"""How a call travels (see :meth:`Scheduler.async_call_engine`), not what it passes."""


@functools.cache
def _signature(interface: type, name: str) -> inspect.Signature:
    """The interface method's signature without ``self``."""
    signature = inspect.signature(getattr(interface, name))
    parameters = list(signature.parameters.values())
    if parameters and parameters[0].name == "self":
        parameters = parameters[1:]
    return signature.replace(parameters=parameters)


class RemoteEngine(Generic[E]):
    """The engine ``engine_name`` (default: the worker id) on worker ``worker_id``, seen
    through ``interface``; see the module docstring."""

    def __init__(
        self,
        scheduler: Scheduler,
        worker_id: str,
        interface: type[E],
        *,
        engine_name: str | None = None,
        **options: Any,
    ):
        unknown = set(options) - CALL_OPTIONS
        if unknown:
            raise TypeError(f"unknown RPC options {sorted(unknown)}; known: {sorted(CALL_OPTIONS)}")
        self.scheduler = scheduler
        self.worker_id = worker_id
        self.interface = interface
        self.engine_name = engine_name or worker_id
        self.options = options
        self._methods = interface_methods(interface)
        if not self._methods:
            raise TypeError(f"{interface.__name__} is not an engine interface")

    def with_options(self, **options: Any) -> RemoteEngine[E]:
        """The same engine, its calls made with these ``rpc_meta``, ``http_timeout``,
        ``max_retries`` or ``retry_delay``."""
        return RemoteEngine(
            self.scheduler,
            self.worker_id,
            self.interface,
            engine_name=self.engine_name,
            **{**self.options, **options},
        )

    def __getattr__(self, name: str) -> RemoteMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        if name not in self._methods:
            what = "no method"
            if isinstance(inspect.getattr_static(self.interface, name, None), property):
                what = "a property, not a method, and RPC calls only methods:"
            raise AttributeError(
                f"{self.interface.__name__} has {what} {name!r} (engine {self.engine_name} "
                f"on worker {self.worker_id}); declare engine methods that controllers call "
                "in areal.api.engine_api"
            )
        return RemoteMethod(self, name)

    def __repr__(self) -> str:
        return (
            f"RemoteEngine[{self.interface.__name__}]({self.worker_id!r}, "
            f"engine_name={self.engine_name!r})"
        )


class RemoteMethod:
    """One interface method of a :class:`RemoteEngine`: call it, or ``acall`` it."""

    def __init__(self, engine: RemoteEngine[Any], name: str):
        self.engine = engine
        self.name = name
        self.signature = _signature(engine.interface, name)

    def _check(self, args: tuple, kwargs: dict[str, Any]) -> None:
        clash = sorted((CALL_OPTIONS | {"engine_name"}) & set(kwargs))
        if clash:
            raise TypeError(
                f"{self._qualname()}: {clash} name how a call travels, not an argument; "
                "use RemoteEngine.with_options"
            )
        try:
            self.signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"{self._qualname()}{self.signature}: {e}") from None

    def _qualname(self) -> str:
        return f"{self.engine.interface.__name__}.{self.name}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """Call it on the worker and wait for the result."""
        self._check(args, kwargs)
        e = self.engine
        return e.scheduler.call_engine(
            e.worker_id, self.name, *args, engine_name=e.engine_name, **e.options, **kwargs
        )

    def acall(self, *args: Any, **kwargs: Any) -> Awaitable[Any]:
        """The call as an awaitable (arguments checked now, sent when awaited)."""
        self._check(args, kwargs)
        e = self.engine
        return e.scheduler.async_call_engine(
            e.worker_id, self.name, *args, engine_name=e.engine_name, **e.options, **kwargs
        )

    def follow_head(self) -> Awaitable[Any]:
        """The call on a rank that is not its data-parallel head: nothing is sent, and the
        worker takes the arguments its head broadcasts over their model-parallel group
        (see ``broadcast_from_head`` in :mod:`areal.infra.rpc.engine_thread`)."""
        e = self.engine
        return e.scheduler.async_call_engine(
            e.worker_id, self.name, engine_name=e.engine_name, **e.options
        )
