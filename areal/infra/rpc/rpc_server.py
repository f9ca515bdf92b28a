"""Worker process: an HTTP RPC server that hosts engines.

Run as ``python -m areal.infra.rpc.rpc_server --role actor --worker-index 0 ...``. The
server registers ``"<ip>:<port>"`` under :func:`areal.utils.names.worker` so the
controller can find it, then serves:

* ``GET /health``: to an unsigned request only ``{"status": "healthy"}``; to a signed
  one the full body (forked children, engines), signed,
* ``POST /alloc_ports``, ``/fork``, ``/kill_forked_worker``, ``/set_env``, ``/configure``,
* ``POST /create_engine`` and ``POST /call`` (engine construction and method calls).

Every request but that unsigned ``/health`` must be signed with the experiment's token
(:mod:`areal.infra.rpc.auth`: HMAC-SHA256 over method, host, path, timestamp, nonce and
body digest; ±60 s replay window, each nonce once) and every answer to it is signed
back; the token itself never travels. It comes from ``AREAL_RPC_TOKEN`` in the
environment (never from argv), and the server refuses to start without it. Limits
(:mod:`areal.infra.rpc.guard`): request bodies up to ``--max-body-bytes`` (default
1 GiB, ``$AREAL_RPC_MAX_BODY_BYTES``; 413 beyond), request line and headers within
``--header-timeout`` seconds (15) and 64 KiB, at most ``--body-timeout`` seconds (60)
between body chunks (408), idle keep-alive connections closed after
``--idle-timeout`` seconds (30). Bodies are JSON; arguments and results use the typed
envelopes of :mod:`areal.infra.rpc.serialization`; errors are ``{"error": ...}``.

Engine work never runs on the event loop: every construction and call goes through one
dedicated engine thread (:mod:`areal.infra.rpc.engine_thread`). ``/call`` runs only the
methods the engine's interfaces declare (:func:`~areal.api.engine_api.interface_methods`),
the same names a controller's :class:`~areal.infra.rpc.remote_engine.RemoteEngine`
accepts; any other name is refused with a 400 that names it.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import os
import signal
import socket
import sys
import threading
from types import SimpleNamespace
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from areal.api.engine_api import InferenceEngine, TrainEngine, interface_methods
from areal.api.scheduler_api import RPC_TOKEN_ENV
from areal.infra.rpc.auth import max_clock_skew
from areal.infra.rpc.engine_thread import EngineThread, broadcast_from_head, invoke
from areal.infra.rpc.guard import (
    AUTH_SCOPE_KEY,
    LIMIT_FLAGS,
    LIMITS,
    SignedRequestGuard,
    uvicorn_options,
)
from areal.infra.rpc.processes import LoggedProcess
from areal.infra.rpc.secret_env import SECRETS_FILE_ENV, load_secrets_file, public_environ
from areal.infra.rpc.serialization import (
    SerializationError,
    deserialize_value,
    json_dumps,
    json_loads,
    serialize_value,
)
from areal.utils import logging, name_resolve, names
from areal.utils.dynamic_import import import_from_string
from areal.utils.lifeline import exit_with_parent
from areal.utils.network import find_free_ports, gethostip
from areal.utils.paths import get_log_path
from areal.utils.secrets import refuse_printed_form
from areal.utils.seeding import set_random_seed

__all__ = ["EngineThread", "WorkerServer", "broadcast_from_head", "main", "parse_args"]

logger = logging.getLogger("rpc.server")

DESTROY_TIMEOUT = 20.0  # seconds for all engines' destroy() at shutdown
FORK_KILL_GRACE = 5.0


class _BadRequestError(Exception):
    """Turned into a 400 response."""


def _json(data: Any, status: int = 200) -> Response:
    return Response(json_dumps(data), status_code=status, media_type="application/json")


def _error(status: int, message: str) -> Response:
    return _json({"error": message}, status)


async def _body(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        data = json_loads(raw) if raw else {}
    except ValueError as e:
        raise _BadRequestError(f"body is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise _BadRequestError("body must be a JSON object")
    return data


class WorkerServer:
    """The state of one worker (engines, forked children, ports) and its HTTP app."""

    def __init__(
        self,
        experiment_name: str,
        trial_name: str,
        role: str,
        worker_index: int,
        token: str,
        host_ip: str,
        fileroot: str,
        *,
        max_body_bytes: int = LIMITS.max_body_bytes,
        body_timeout: float = LIMITS.body_timeout,
    ):
        self.experiment_name = experiment_name
        self.trial_name = trial_name
        self.role = role
        self.worker_index = worker_index
        self.host_ip = host_ip
        self.fileroot = fileroot
        self._token = token  # handed to forked children, which sign with it too
        self.engines: dict[str, Any] = {}
        self.forked: dict[tuple[str, int], LoggedProcess] = {}
        self.config: Any = None
        self.engine_thread = EngineThread()
        self._given_ports: set[int] = set()
        self._lock = threading.Lock()
        self._shut_down = False
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/alloc_ports", self.alloc_ports, methods=["POST"]),
            Route("/fork", self.fork, methods=["POST"]),
            Route("/kill_forked_worker", self.kill_forked_worker, methods=["POST"]),
            Route("/set_env", self.set_env, methods=["POST"]),
            Route("/configure", self.configure, methods=["POST"]),
            Route("/create_engine", self.create_engine, methods=["POST"]),
            Route("/call", self.call, methods=["POST"]),
        ]
        app = Starlette(routes=routes, lifespan=self._lifespan)
        self.app = SignedRequestGuard(
            app,
            token,
            open_paths={"/health"},
            max_body_bytes=max_body_bytes,
            body_timeout=body_timeout,
        )

    @contextlib.asynccontextmanager
    async def _lifespan(self, app: Any):
        yield
        await asyncio.to_thread(self.shutdown)

    # --- endpoints ---

    async def health(self, request: Request) -> Response:
        if not request.scope.get(AUTH_SCOPE_KEY):
            return _json({"status": "healthy"})  # a liveness probe learns nothing more
        alive = sum(1 for p in self.forked.values() if p.poll() is None)
        engines = sorted(self.engines)
        return _json(
            {
                "status": "healthy",
                "forked_children": alive,
                "engine_count": len(engines),
                "engines": engines,
                # the GPUs this worker sees: a TP server forked beside several workers sees
                # all of theirs (areal.infra.scheduler.rpc_workers)
                "visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            }
        )

    async def alloc_ports(self, request: Request) -> Response:
        try:
            body = await _body(request)
        except _BadRequestError as e:
            return _error(400, str(e))
        count = body.get("count")
        if not isinstance(count, int) or isinstance(count, bool) or count <= 0:
            return _error(400, "'count' must be a positive integer")
        ports = self._fresh_ports(count)
        return _json({"status": "success", "ports": ports, "host": self.host_ip})

    def _fresh_ports(self, count: int) -> list[int]:
        """Free ports never handed out before by this worker."""
        chosen: list[int] = []
        with self._lock:
            while len(chosen) < count:
                for port in find_free_ports(count - len(chosen)):
                    if port not in self._given_ports:
                        self._given_ports.add(port)
                        chosen.append(port)
        return chosen

    async def fork(self, request: Request) -> Response:
        try:
            body = await _body(request)
            role, index = _role_and_index(body)
            raw_cmd = body.get("raw_cmd")
            if not (
                isinstance(raw_cmd, list) and raw_cmd and all(isinstance(a, str) for a in raw_cmd)
            ):
                raise _BadRequestError("'raw_cmd' must be a non-empty list of strings")
            env_overrides = _str_dict(body.get("env") or {}, "env")
        except _BadRequestError as e:
            return _error(400, str(e))
        with self._lock:
            existing = self.forked.get((role, index))
            if existing is not None and existing.poll() is None:
                return _error(400, f"forked worker {role}/{index} is already running")
            # the child inherits no secret of this worker but the RPC token; its own come
            # from the secrets file the scheduler names in env_overrides
            env = {**public_environ(), RPC_TOKEN_ENV: self._token, **env_overrides}
            log_dir = get_log_path(self.fileroot, self.experiment_name, self.trial_name)
            try:
                child = LoggedProcess(raw_cmd, env, log_dir, role, label=f"{role}/{index}")
            except OSError as e:
                return _error(500, f"cannot start {raw_cmd[0]!r}: {e}")
            self.forked[(role, index)] = child
        logger.info("Forked %s/%d as pid %d", role, index, child.pid)
        return _json({"status": "success", "host": self.host_ip, "pid": child.pid})

    async def kill_forked_worker(self, request: Request) -> Response:
        try:
            role, index = _role_and_index(await _body(request))
        except _BadRequestError as e:
            return _error(400, str(e))
        with self._lock:
            child = self.forked.pop((role, index), None)
        if child is None:
            return _error(404, f"no forked worker {role}/{index}")
        await asyncio.to_thread(child.kill_tree, FORK_KILL_GRACE)
        return _json({"status": "success", "exit_code": child.poll()})

    async def set_env(self, request: Request) -> Response:
        try:
            body = await _body(request)
            if "env" not in body:
                raise _BadRequestError("missing 'env'")
            env = _str_dict(body["env"], "env")
        except _BadRequestError as e:
            return _error(400, str(e))
        os.environ.update(env)
        return _json({"status": "success"})

    async def configure(self, request: Request) -> Response:
        try:
            body = await _body(request)
            if body.get("config") is None:
                raise _BadRequestError("missing 'config'")
            rank = body.get("rank")
            if not isinstance(rank, int) or isinstance(rank, bool):
                raise _BadRequestError("'rank' must be an integer")
            config = deserialize_value(body["config"])
        except (_BadRequestError, SerializationError) as e:
            return _error(400, str(e))
        seed_base = config.get("seed") if isinstance(config, dict) else getattr(config, "seed", 1)
        seed = set_random_seed(int(seed_base if seed_base is not None else 1), f"{self.role}{rank}")
        self.config = config
        return _json({"status": "success", "seed": seed})

    async def create_engine(self, request: Request) -> Response:
        try:
            body = await _body(request)
            path = body.get("engine")
            name = body.get("engine_name")
            if not isinstance(path, str) or not path:
                raise _BadRequestError("'engine' must be a '<module>.<Class>' string")
            if not isinstance(name, str) or not name:
                raise _BadRequestError("'engine_name' must be a non-empty string")
            args = deserialize_value(body.get("init_args") or [])
            kwargs = deserialize_value(body.get("init_kwargs") or {})
            if not isinstance(args, list) or not isinstance(kwargs, dict):
                raise _BadRequestError("'init_args' must be a list and 'init_kwargs' an object")
        except (_BadRequestError, SerializationError) as e:
            return _error(400, str(e))
        with self._lock:
            if name in self.engines:
                return _error(400, f"engine {name!r} already exists on this worker")
            self.engines[name] = None  # reserved while it is being built
        try:
            try:
                cls = await asyncio.wrap_future(self.engine_thread.submit(import_from_string, path))
            except Exception as e:
                return _error(400, f"cannot import engine {path!r}: {type(e).__name__}: {e}")
            if not (isinstance(cls, type) and issubclass(cls, (TrainEngine, InferenceEngine))):
                return _error(400, f"{path!r} is not a TrainEngine or InferenceEngine subclass")
            try:
                engine = await asyncio.wrap_future(self.engine_thread.submit(cls, *args, **kwargs))
            except asyncio.CancelledError:
                raise
            except BaseException as e:  # whatever it raised; see call()
                logger.exception("Constructing engine %s (%s) failed", name, path)
                return _error(500, f"engine {path!r} constructor failed: {type(e).__name__}: {e}")
            with self._lock:
                self.engines[name] = engine
            logger.info("Created engine %s (%s)", name, path)
            return _json({"status": "success", "engine_name": name})
        finally:
            with self._lock:
                if self.engines.get(name) is None:
                    self.engines.pop(name, None)

    async def call(self, request: Request) -> Response:
        try:
            body = await _body(request)
            method = body.get("method")
            if not isinstance(method, str) or not method:
                raise _BadRequestError("'method' must be a non-empty string")
            name = body.get("engine_name")
            engine = self.engines.get(name) if isinstance(name, str) else None
            if engine is None:
                return _error(404, f"no engine named {name!r} on this worker")
            if method not in interface_methods(type(engine)):
                raise _BadRequestError(
                    f"engine {name!r} ({type(engine).__name__}) has no method {method!r} "
                    "in its engine interfaces; only those are called over RPC"
                )
            fn = getattr(engine, method, None)
            if not callable(fn):
                raise _BadRequestError(f"engine {name!r} has no method {method!r}")
            args = deserialize_value(body.get("args") or [])
            kwargs = deserialize_value(body.get("kwargs") or {})
            if not isinstance(args, list) or not isinstance(kwargs, dict):
                raise _BadRequestError("'args' must be a list and 'kwargs' an object")
            rpc_meta = body.get("rpc_meta") or {}
            if not isinstance(rpc_meta, dict):
                raise _BadRequestError("'rpc_meta' must be an object")
        except (_BadRequestError, SerializationError) as e:
            return _error(400, str(e))
        try:
            result, is_head = await asyncio.wrap_future(
                self.engine_thread.submit(
                    invoke, self.engine_thread, engine, fn, args, kwargs, rpc_meta
                )
            )
            # waited here, not on the engine thread, so work the future depends on can run
            if isinstance(result, concurrent.futures.Future):
                result = await asyncio.wrap_future(result)
            payload = serialize_value(result) if is_head else None
        except asyncio.CancelledError:
            raise  # this request was cancelled (the server stops), not failed by the engine
        except BaseException as e:
            # not only Exception: torch's CheckpointException (a failed DCP save, e.g. a full
            # disk) is a BaseException, and one escaping here would reach the client as
            # uvicorn's unsigned 500, which it must take for an impostor's answer
            logger.exception("Engine method %s on %s failed", method, name)
            return _error(500, f"Engine method '{method}' failed: {type(e).__name__}: {e}")
        if method == "destroy":
            with self._lock:
                self.engines.pop(name, None)  # destroyed once; shutdown must not repeat it
        return _json({"status": "success", "result": payload})

    # --- shutdown ---

    def shutdown(self) -> None:
        """Destroy engines (bounded wait), stop the engine thread, kill forked children."""
        with self._lock:
            if self._shut_down:
                return
            self._shut_down = True
            engines = [(n, e) for n, e in self.engines.items() if e is not None]
            self.engines.clear()
            forked = list(self.forked.items())
            self.forked.clear()
        if engines:
            done = self.engine_thread.submit(_destroy_all, engines)
            try:
                done.result(timeout=DESTROY_TIMEOUT)
            except concurrent.futures.TimeoutError:
                logger.warning("Engines did not finish destroy() in %.0fs", DESTROY_TIMEOUT)
        self.engine_thread.stop()
        for (role, index), child in forked:
            logger.info("Stopping forked worker %s/%d (pid %d)", role, index, child.pid)
            child.kill_tree(FORK_KILL_GRACE)


def _destroy_all(engines: list[tuple[str, Any]]) -> None:
    for name, engine in engines:
        try:
            engine.destroy()
        except Exception:
            logger.exception("destroy() of engine %s failed", name)


def _role_and_index(body: dict[str, Any]) -> tuple[str, int]:
    role, index = body.get("role"), body.get("worker_index")
    if not isinstance(role, str) or not role:
        raise _BadRequestError("'role' must be a non-empty string")
    if not isinstance(index, int) or isinstance(index, bool) or index < 0:
        raise _BadRequestError("'worker_index' must be a non-negative integer")
    return role, index


def _str_dict(value: Any, what: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise _BadRequestError(f"'{what}' must map strings to strings")
    return value


# --- command line ---


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m areal.infra.rpc.rpc_server",
        description="Worker RPC server; reads its token from $" + RPC_TOKEN_ENV,
    )
    parser.add_argument("--host", default="0.0.0.0", help="Bind address (0.0.0.0: all).")
    parser.add_argument("--port", type=int, default=0, help="Port (0: any free port).")
    parser.add_argument("--experiment-name", required=True)
    parser.add_argument("--trial-name", required=True)
    parser.add_argument("--role", required=True)
    parser.add_argument(
        "--worker-index", type=int, default=-1, help="Index in the role ($SLURM_PROCID wins)."
    )
    parser.add_argument("--name-resolve-type", default="nfs")
    parser.add_argument("--nfs-record-root", default="/tmp/areal/name_resolve")
    parser.add_argument("--etcd3-addr", default="localhost:2379", help="Unused (nfs only).")
    parser.add_argument("--fileroot", default="/tmp/areal", help="Logs of forked workers.")
    parser.add_argument("--log-level", "--werkzeug-log-level", dest="log_level", default="WARNING")
    LIMIT_FLAGS.add_arguments(parser)
    args = parser.parse_args(argv)
    args.limits = LIMIT_FLAGS.parse(parser, args)
    if os.environ.get("SLURM_PROCID"):
        args.worker_index = int(os.environ["SLURM_PROCID"])
    if args.worker_index < 0:
        parser.error("--worker-index is required (or $SLURM_PROCID)")
    return args


def _bind(host: str, port: int) -> tuple[socket.socket, str]:
    """A bound socket and the address other hosts should use to reach it."""
    wildcard = host in ("", "0.0.0.0", "::")
    advertised = gethostip() if wildcard else host
    bind_host = ("::" if ":" in advertised else "0.0.0.0") if wildcard else host
    family = socket.AF_INET6 if ":" in bind_host else socket.AF_INET
    # IPPROTO_TCP named, not 0: asyncio turns Nagle's algorithm off only on accepted
    # sockets whose protocol is TCP, and a reply's head and body go out in two writes
    # (with Nagle on, the body waits for a delayed ACK: ~40 ms per RPC)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((bind_host, port))
    return sock, advertised


def _load_secrets_file() -> None:
    """Take this worker's secrets from ``$AREAL_SECRETS_FILE`` (a forked worker's), and
    remove the file: nothing on disk holds them while the worker runs."""
    path = os.environ.pop(SECRETS_FILE_ENV, "")
    if path:
        os.environ.update(load_secrets_file(path))
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    try:
        _load_secrets_file()
    except (OSError, ValueError) as e:
        sys.exit(f"rpc_server: {e}")
    token = os.environ.get(RPC_TOKEN_ENV, "")
    if not token:
        sys.exit(f"rpc_server: ${RPC_TOKEN_ENV} is empty; the scheduler must set the token")
    try:
        refuse_printed_form(token, f"${RPC_TOKEN_ENV}")
    except ValueError as e:
        sys.exit(f"rpc_server: {e}")
    logging.register_secret(token)
    try:
        max_clock_skew()
    except ValueError as e:
        sys.exit(f"rpc_server: {e}")
    name_resolve.reconfigure(
        SimpleNamespace(type=args.name_resolve_type, nfs_record_root=args.nfs_record_root)
    )
    sock, ip = _bind(args.host, args.port)
    port = sock.getsockname()[1]
    server_state = WorkerServer(
        args.experiment_name,
        args.trial_name,
        args.role,
        args.worker_index,
        token,
        ip,
        args.fileroot,
        max_body_bytes=args.limits.max_body_bytes,
        body_timeout=args.limits.body_timeout,
    )
    config = uvicorn.Config(
        server_state.app,
        log_level=args.log_level.lower(),
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=5,
        **uvicorn_options(args.limits),
    )
    server = uvicorn.Server(config)
    # uvicorn re-raises SIGTERM/SIGINT to the previous handlers after shutting down; a
    # no-op handler lets this function finish (name-resolve cleanup, atexit hooks).
    signal.signal(signal.SIGTERM, lambda *_: None)
    signal.signal(signal.SIGINT, lambda *_: None)
    exit_with_parent()  # SIGTERM to self when the controller (or forking worker) is gone
    key = names.worker(args.experiment_name, args.trial_name, args.role, args.worker_index)
    address = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                break
            await asyncio.sleep(0.02)
        else:
            name_resolve.add(key, address, replace=True)
            logger.info("Worker %s/%d serving on %s", args.role, args.worker_index, address)
        await task

    try:
        asyncio.run(serve())
    except name_resolve.UnsafeNameRecordError as e:
        logger.error("Not registering worker %s/%d: %s", args.role, args.worker_index, e)
        sys.exit(1)
    finally:
        server_state.shutdown()  # no-op when the lifespan already ran it
        name_resolve.reset()


if __name__ == "__main__":
    main()
