"""Children that stop when their parent dies, even when the parent is SIGKILLed.

A controller killed with SIGKILL runs no exit hook, and its workers (each in its own
session, so a terminal's Ctrl-C does not reach them twice) would live on, holding ports,
GPUs and name records. Every process this project spawns gets ``AREAL_PARENT_PID`` in its
environment (:func:`child_env`); long-running children call :func:`exit_with_parent`,
which polls the parent and, once it is gone, sends this process SIGTERM (so the normal
shutdown runs: engines destroyed, grandchildren stopped) and hard-exits if that takes
longer than ``grace`` seconds.

Polling ``getppid()`` is used instead of ``PR_SET_PDEATHSIG`` because the latter fires
when the *thread* that spawned the child exits, which thread pools do all the time.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping

__all__ = ["PARENT_PID_ENV", "child_env", "exit_with_parent"]

PARENT_PID_ENV = "AREAL_PARENT_PID"


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` plus this process's pid as the child's expected parent."""
    return {**env, PARENT_PID_ENV: str(os.getpid())}


def exit_with_parent(interval: float = 1.0, grace: float = 30.0) -> threading.Thread | None:
    """Start the watch (a daemon thread); ``None`` when no parent pid was handed down."""
    raw = os.environ.get(PARENT_PID_ENV, "")
    if not raw.isdigit():
        return None
    parent = int(raw)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(interval)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace)
        os._exit(1)  # the graceful shutdown hung

    thread = threading.Thread(target=watch, name="lifeline", daemon=True)
    thread.start()
    return thread
