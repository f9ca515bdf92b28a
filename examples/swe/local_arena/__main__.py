"""``python -m examples.swe.local_arena serve ...``: run the local Arena.

The API token is read from ``--token-file`` (created with a fresh token, readable by its
owner only, when the file does not exist; default ``<db>.token``). It is never printed:
point the client at it with ``export ARENA_OPENAPI_TOKEN=$(cat <file>)``. The LLM gateway
accepts the same token (so ``ARENA_LLM_API_KEY`` may be set to it) and any key in
``--llm-key-file``. Both files are read stripped of surrounding whitespace.

Limits: ``--max-body-bytes`` (default 16 MiB; larger bodies get 413), ``--body-timeout``
(default 60 s of silence within a body; 408 after), ``--header-timeout`` (default 10 s for
a request's headers), ``--task-timeout`` (at most a day),
``--max-concurrent-tasks`` (1 to 1024); fault settings are bounded too (see ``faults.py``).
On SIGTERM or SIGINT the server stops promptly: running tasks are cancelled (recorded as
interrupted) and their child processes killed at once, requests held by an injected
latency or a slow upstream are answered 503, other in-flight requests get up to
``GRACEFUL_SHUTDOWN_S`` seconds; if the process still runs ``HARD_STOP_S`` seconds after
the signal, it kills the children again and exits with status 128 + the signal number.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

from areal.utils.http_limits import HttpLimits
from areal.utils.serving import GRACEFUL_SHUTDOWN_S
from examples.swe.local_arena.faults import ERROR_KINDS, FaultConfig, FaultError
from examples.swe.local_arena.limits import LIMIT_FLAGS, uvicorn_options

PROG = "python -m examples.swe.local_arena"
MAX_HEADER_TIMEOUT_S = 300.0
HARD_STOP_S = GRACEFUL_SHUTDOWN_S + 5.0


def read_or_create_token(path: Path) -> str:
    from examples.swe.local_arena.server import new_token

    if path.exists():
        token = path.read_text().strip()
        if not token:
            raise ValueError(f"{path} is empty; delete it to get a fresh token")
        return token
    path.parent.mkdir(parents=True, exist_ok=True)
    token = new_token()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def _pairs(values: list[str], flag: str) -> dict[str, str]:
    out = {}
    for value in values:
        key, sep, rest = value.partition("=")
        if not sep or not key or not rest:
            raise FaultError(f"{flag} expects NAME=VALUE, got {value!r}")
        out[key] = rest
    return out


def fault_settings(args: argparse.Namespace, base: dict) -> FaultConfig:
    settings = dict(base)
    rates = dict(settings.get("error_rates") or {})
    for kind, rate in _pairs(args.error_rate, "--error-rate").items():
        try:
            rates[kind] = float(rate)
        except ValueError:
            raise FaultError(f"--error-rate {kind}={rate}: the rate must be a number") from None
    settings["error_rates"] = rates
    forced = dict(settings.get("force_status") or {})
    forced.update(_pairs(args.force_status, "--force-status"))
    settings["force_status"] = forced
    for name in ("latency_ms", "env_latency_ms", "route_ttl_seconds", "seed"):
        value = getattr(args, name)
        if value is not None:
            settings[name] = value
    return FaultConfig.from_mapping(settings, where="faults (catalog and flags)")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="The local Arena server.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="serve the Arena API, the LLM gateway and tasks")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8100)
    s.add_argument("--db", required=True, type=Path, help="SQLite file (created if missing)")
    s.add_argument("--catalog", type=Path, default=None, help="catalog YAML (default: built-in)")
    s.add_argument("--token-file", type=Path, default=None, help="default: <db>.token")
    s.add_argument(
        "--llm-key-file",
        type=Path,
        default=None,
        help="a file with one more key the LLM gateway accepts",
    )
    s.add_argument("--envelope", choices=["plain", "wrapped"], default="plain")
    s.add_argument("--task-timeout", type=float, default=600.0, help="seconds per task")
    s.add_argument("--max-concurrent-tasks", type=int, default=64)
    LIMIT_FLAGS.add_arguments(s)
    s.add_argument(
        "--error-rate",
        action="append",
        default=[],
        metavar="KIND=RATE",
        help=f"inject errors; KIND in {', '.join(ERROR_KINDS)}",
    )
    s.add_argument("--latency-ms", type=float, default=None)
    s.add_argument(
        "--env-latency-ms",
        type=float,
        default=None,
        help="time built-in harnesses spend in their environment after each LLM call",
    )
    s.add_argument(
        "--force-status",
        action="append",
        default=[],
        metavar="ID=STATUS",
        help="data_id or stream_id whose tasks end with STATUS",
    )
    s.add_argument(
        "--route-ttl",
        dest="route_ttl_seconds",
        type=float,
        default=None,
        help="garbage-collect routes not renewed within this many seconds",
    )
    s.add_argument("--fault-seed", dest="seed", type=int, default=None)
    s.add_argument("--log-level", default="info")
    return p


def _check_flags(args: argparse.Namespace) -> None:
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    timeout = args.header_timeout
    if not (math.isfinite(timeout) and 0 < timeout <= MAX_HEADER_TIMEOUT_S):
        raise ValueError(
            f"--header-timeout must be in (0, {MAX_HEADER_TIMEOUT_S:g}] seconds, got {timeout:g}"
        )


def _serve(app: Any, args: argparse.Namespace, limits: HttpLimits) -> None:
    import uvicorn

    class LocalArenaServer(uvicorn.Server):
        """uvicorn's server, plus a prompt stop of the local Arena on the first signal."""

        watchdog: threading.Thread | None = None

        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            app.state.arena.request_stop()
            if self.watchdog is None:
                self.watchdog = threading.Thread(
                    target=_hard_stop, args=(app, sig), name="local-arena-hard-stop", daemon=True
                )
                self.watchdog.start()

    config = uvicorn.Config(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **uvicorn_options(limits),
    )
    LocalArenaServer(config).run()


def _hard_stop(app: Any, sig: int) -> None:
    """The last resort of a stop that did not finish: kill the children, exit at once."""
    time.sleep(HARD_STOP_S)
    killed = app.state.arena.runner.kill_children()
    print(
        f"{PROG}: still running {HARD_STOP_S:g}s after signal {sig}; killed {killed} child "
        "process group(s) and exiting",
        file=sys.stderr,
        flush=True,
    )
    os._exit(128 + sig)


def main(argv: list[str] | None = None) -> None:
    command_line = parser()
    args = command_line.parse_args(argv)

    from examples.swe.local_arena.catalog import DEFAULT_CATALOG, load_catalog
    from examples.swe.local_arena.server import LocalArenaConfig, create_app

    try:
        _check_flags(args)
        limits = LIMIT_FLAGS.parse(command_line, args)
        catalog = load_catalog(args.catalog or DEFAULT_CATALOG)
        faults = fault_settings(args, catalog.faults)
        token_file = args.token_file or args.db.with_name(args.db.name + ".token")
        token = read_or_create_token(token_file)
        llm_keys = ()
        if args.llm_key_file is not None:
            llm_keys = (args.llm_key_file.read_text().strip(),)
        config = LocalArenaConfig(
            db=args.db,
            catalog=catalog,
            token=token,
            llm_api_keys=llm_keys,
            task_timeout=args.task_timeout,
            max_concurrent_tasks=args.max_concurrent_tasks,
            faults=faults,
            envelope=args.envelope,
            max_body_bytes=limits.max_body_bytes,
            body_timeout=limits.body_timeout,
        )
    except (ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(
        f"local Arena on http://{args.host}:{args.port} (API token in {token_file}; "
        f"LLM gateway at http://{args.host}:{args.port}/api)",
        file=sys.stderr,
    )
    _serve(create_app(config), args, limits)


if __name__ == "__main__":
    main()
