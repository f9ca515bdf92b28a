"""Errors raised by schedulers and the worker RPC client."""

from __future__ import annotations

__all__ = [
    "EngineCallError",
    "EngineCreationError",
    "EngineImportError",
    "GPUAllocationError",
    "PortAllocationError",
    "RPCAuthenticationError",
    "RPCConnectionError",
    "SchedulerError",
    "WorkerConfigurationError",
    "WorkerCreationError",
    "WorkerFailedError",
    "WorkerNotFoundError",
    "WorkerTimeoutError",
]


class SchedulerError(Exception):
    """Base of every scheduler error."""


class WorkerCreationError(SchedulerError):
    """A worker (or a whole role) could not be started."""


class WorkerNotFoundError(SchedulerError):
    """No worker or role with that id."""


class WorkerFailedError(SchedulerError):
    """A worker process exited (``exit_code``) or died with no code to tell (None: e.g.
    its Ray actor died); ``logs`` holds the tail of its output."""

    def __init__(self, worker_id: str, exit_code: int | None, logs: str = ""):
        self.worker_id = worker_id
        self.exit_code = exit_code
        self.logs = logs
        if exit_code is None:
            message = f"worker {worker_id} died"
        else:
            message = f"worker {worker_id} exited with code {exit_code}"
        if logs:
            message += f"; last log lines:\n{logs}"
        super().__init__(message)


class WorkerTimeoutError(SchedulerError):
    """Workers were not up, healthy and configured in time."""


class WorkerConfigurationError(SchedulerError):
    """A worker spec is invalid or ``/configure`` / ``/set_env`` failed."""


class RPCConnectionError(SchedulerError):
    """A worker's RPC server could not be reached."""


class RPCAuthenticationError(SchedulerError):
    """A peer refused our signed request, or answered without proving it holds the token.

    Not an :class:`RPCConnectionError`: waiting does not fix it, so discovery and
    retries stop at once.
    """


class EngineCreationError(SchedulerError):
    """``/create_engine`` failed (the constructor raised, or the name is taken)."""


class EngineImportError(EngineCreationError):
    """The engine class could not be imported or is not an engine."""


class EngineCallError(SchedulerError):
    """An engine method call failed; ``detail`` is the worker's error text."""

    def __init__(self, worker_id: str, method: str, detail: str, attempt: int = 1):
        self.worker_id = worker_id
        self.method = method
        self.detail = detail
        self.attempt = attempt
        super().__init__(f"{method} on {worker_id} failed (attempt {attempt}): {detail}")


class GPUAllocationError(SchedulerError):
    """A worker asks for more GPUs than this host has."""


class PortAllocationError(SchedulerError):
    """A worker could not reserve the ports it needs."""
