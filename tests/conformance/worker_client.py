"""The test side of one SGLang worker process: start it on a version's paths, send requests."""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from tests.conformance.install_sglang import REPO_ROOT, SGLangSite

__all__ = ["SGLangWorker", "WorkerError", "type_tree", "type_tree_of", "unwrap"]


class WorkerError(RuntimeError):
    """The worker died, timed out, or raised while answering (its traceback included)."""


class SGLangWorker:
    """``python -P -m tests.conformance.sglang_worker`` with one version's dirs first on
    ``sys.path`` (``-P``: not even the working directory goes before them)."""

    def __init__(self, site: SGLangSite, log_dir: Path):
        self.version = site.version
        self.log_path = log_dir / f"sglang-worker-{site.version}.log"
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*map(str, site.paths), str(REPO_ROOT)])
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
        self._log = self.log_path.open("w")
        self._process = subprocess.Popen(
            [sys.executable, "-P", "-m", "tests.conformance.sglang_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            cwd=REPO_ROOT,
            env=env,
            text=True,
        )
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()
        self._ready = False
        self._lock = threading.Lock()
        self.started_at = time.monotonic()
        self.ready_s: float | None = None

    def _read(self) -> None:
        assert self._process.stdout is not None
        for line in self._process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _next_line(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout_s)
        except queue.Empty:
            raise WorkerError(f"sglang {self.version} worker: no answer in {timeout_s} s") from None
        if line is None:
            raise WorkerError(
                f"sglang {self.version} worker exited ({self._process.poll()}):\n{self.log_tail()}"
            )
        return json.loads(line)

    def wait_ready(self, timeout_s: float = 240.0) -> None:
        """SGLang's imports take ~20 s on two cores; both workers import concurrently."""
        with self._lock:
            if not self._ready:
                self._next_line(timeout_s)
                self._ready = True
                self.ready_s = time.monotonic() - self.started_at

    def call(self, op: str, timeout_s: float = 120.0, **args: Any) -> Any:
        self.wait_ready()
        with self._lock:
            assert self._process.stdin is not None
            self._process.stdin.write(json.dumps({"op": op, "args": args}) + "\n")
            self._process.stdin.flush()
            reply = self._next_line(timeout_s)
        if not reply["ok"]:
            raise WorkerError(f"sglang {self.version} {op} failed:\n{reply['error']}")
        return reply["result"]

    def log_tail(self, chars: int = 4000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-chars:]

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()


def unwrap(node: dict[str, Any]) -> Any:
    """The Python value of a worker's typed JSON node (``{"value", "type"}``)."""
    value = node["value"]
    if node["type"] in ("list", "tuple", "set"):
        return [unwrap(v) for v in value]
    if node["type"] == "dict":
        return {k: unwrap(v) for k, v in value.items()}
    return value


def type_tree(node: dict[str, Any]) -> Any:
    """The Python type names inside a typed JSON node, nested as the value is."""
    if node["type"] in ("list", "tuple", "set"):
        return [node["type"], [type_tree(v) for v in node["value"]]]
    if node["type"] == "dict":
        return ["dict", {k: type_tree(v) for k, v in node["value"].items()}]
    return node["type"]


def type_tree_of(value: Any) -> Any:
    """:func:`type_tree` of a value built on this side (what the client sends)."""
    if isinstance(value, (list, tuple, set)):
        return [type(value).__name__, [type_tree_of(v) for v in value]]
    if isinstance(value, dict):
        return ["dict", {k: type_tree_of(v) for k, v in value.items()}]
    return type(value).__name__
