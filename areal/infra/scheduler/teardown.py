"""Process-wide exit hooks of the schedulers: whatever a controller started stops with it.

An ``atexit`` hook and SIGINT/SIGTERM handlers (chained to the ones they replace) stop
every live scheduler's workers at once (``_emergency_stop``: no RPCs, no threads) and
remove its secrets files.
"""

from __future__ import annotations

import atexit
import os
import signal
import threading
from typing import Any

__all__ = ["Teardown", "teardown"]


class Teardown:
    """Process-wide exit hooks: ``atexit`` plus SIGINT/SIGTERM handlers that chain on."""

    def __init__(self) -> None:
        self._live: set[Any] = set()
        self._lock = threading.Lock()
        self._previous: dict[int, Any] = {}
        self._atexit_registered = False

    def register(self, scheduler: Any) -> None:
        with self._lock:
            self._live.add(scheduler)
            if not self._atexit_registered:
                atexit.register(self.stop_all)
                self._atexit_registered = True
            if not self._previous and threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGINT, signal.SIGTERM):
                    self._previous[sig] = signal.signal(sig, self._on_signal)

    def unregister(self, scheduler: Any) -> None:
        with self._lock:
            self._live.discard(scheduler)
            in_main = threading.current_thread() is threading.main_thread()
            if not self._live and self._previous and in_main:
                for sig, handler in self._previous.items():
                    signal.signal(sig, handler)
                self._previous.clear()

    def stop_all(self) -> None:
        with self._lock:
            live = list(self._live)
            self._live.clear()
        for scheduler in live:
            scheduler._emergency_stop()
            scheduler._remove_secrets()

    def _on_signal(self, signum: int, frame: Any) -> None:
        self.stop_all()
        previous = self._previous.get(signum)
        with self._lock:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            self._previous.clear()
        if callable(previous):
            previous(signum, frame)
        elif previous in (signal.SIG_DFL, None):
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)


teardown = Teardown()
