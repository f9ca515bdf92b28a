"""``python -m examples.swe.local_arena serve ...``: run the local Arena.

The API token is read from ``--token-file`` (created with a fresh token, readable by its
owner only, when the file does not exist; default ``<db>.token``). It is never printed:
point the client at it with ``export ARENA_OPENAPI_TOKEN=$(cat <file>)``. The LLM gateway
accepts the same token (so ``ARENA_LLM_API_KEY`` may be set to it) and any key in
``--llm-key-file``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from examples.swe.local_arena.faults import ERROR_KINDS, FaultConfig, FaultError

PROG = "python -m examples.swe.local_arena"


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
    for name in ("latency_ms", "route_ttl_seconds", "seed"):
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
    s.add_argument(
        "--error-rate",
        action="append",
        default=[],
        metavar="KIND=RATE",
        help=f"inject errors; KIND in {', '.join(ERROR_KINDS)}",
    )
    s.add_argument("--latency-ms", type=float, default=None)
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


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    import uvicorn

    from examples.swe.local_arena.catalog import DEFAULT_CATALOG, load_catalog
    from examples.swe.local_arena.server import LocalArenaConfig, create_app

    try:
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
        )
    except (ValueError, OSError) as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        sys.exit(2)
    print(
        f"local Arena on http://{args.host}:{args.port} (API token in {token_file}; "
        f"LLM gateway at http://{args.host}:{args.port}/api)",
        file=sys.stderr,
    )
    from areal.utils.serving import GRACEFUL_SHUTDOWN_S

    uvicorn.run(
        create_app(config),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
    )


if __name__ == "__main__":
    main()
