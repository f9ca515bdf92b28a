#!/usr/bin/env python3
"""Stand-in for ``apptainer exec``: record the call, then run the command on the host.

Apptainer cannot be installed on the test machines (docs/design.md#slurm-tested-for-real),
so tests point ``AREAL_CONTAINER_BIN`` at this script. Nothing is isolated: the "container"
is the host, so every path must already exist here, exactly as the real runtime needs
identical paths inside and outside the container.

Use: ``AREAL_CONTAINER_BIN=<repo>/tests/fakes/container_standin.py`` (it must stay
executable; its ``#!/usr/bin/env python3`` needs only the standard library, Python 3.8+).

Interface (mimics ``apptainer exec [flags] IMAGE CMD [ARGS...]``):

* argv: ``container_standin.py exec [flags] IMAGE CMD [ARGS...]``. Flags end at the first
  argument that does not start with ``-`` (or after ``--``); that argument is IMAGE and
  everything after it is the command, passed through untouched. Flags take ``--flag VALUE``
  or ``--flag=VALUE``; the value-taking flags are those in ``VALUE_FLAGS`` (apptainer's
  spelling, short forms included), every other flag is a switch.
* IMAGE must be an existing file or directory, else exit 255 (apptainer's FATAL status).
  A missing subcommand, a subcommand other than ``exec`` or a missing command also exit
  255. ``--version`` prints a version line and exits 0.
* Environment of the command: the stand-in's own environment, with apptainer's rules
  applied: ``APPTAINERENV_X=v`` / ``SINGULARITYENV_X=v`` become ``X=v`` (the prefixed
  names are dropped), then ``--env`` values are applied, split at commas as apptainer's
  CSV flag parsing does (``--env A=1,B=2`` sets two variables; ``--env '"A=1,2"'`` keeps
  the comma; an item without ``=`` is an error), then ``--env-file FILE`` lines ``X=v``
  (blank lines and ``#`` comments skipped). ``--cleanenv``/``-e`` starts from ``PATH
  HOME USER LOGNAME LANG TERM`` only. Values are never shell-evaluated, whether or not
  ``--no-eval`` is given.
* ``--pwd DIR`` runs the command in DIR; otherwise the current directory is kept.
  ``--bind``, ``--pid``, ``--nv``, ``--writable-tmpfs``, ``--no-home`` and the rest are
  only recorded.
* The command replaces this process (``execvpe``), so its exit status and signals are the
  caller's; a command that cannot be found exits 127.

Log: when ``CONTAINER_STANDIN_LOG`` is set, one JSON object per call is appended to that
file (a single ``write`` in append mode, so concurrent workers do not interleave lines)
before the command starts:

    {"argv": [...all arguments...], "subcommand": "exec", "flags": [[name, value|null], ...],
     "binds": ["src:dst", ...], "env_binds": {"APPTAINER_BIND": ..., "SINGULARITY_BIND": ...},
     "image": "...", "command": [...], "cwd": "...", "pid": 123,
     "env": {...}}   # "env" only when CONTAINER_STANDIN_RECORD_ENV=1

``binds`` lists every ``--bind``/``-B`` value in order, each split at commas as apptainer
does (``-B a:a,b:b`` gives two entries). ``env_binds`` holds ``APPTAINER_BIND`` and
``SINGULARITY_BIND`` from the environment when set. ``env`` is the environment the
command receives; it is opt-in because it may hold credentials.
"""

from __future__ import annotations

import csv
import json
import os
import sys

VERSION = "container-standin 1.0 (apptainer exec stand-in)"
FATAL = 255

# apptainer exec flags that take a value (long and short spellings).
VALUE_FLAGS = frozenset(
    {
        "--add-caps",
        "--app",
        "--apply-cgroups",
        "--bind",
        "-B",
        "--blkio-weight",
        "--blkio-weight-device",
        "--cpu-shares",
        "--cpus",
        "--cpuset-cpus",
        "--cpuset-mems",
        "--dns",
        "--drop-caps",
        "--env",
        "--env-file",
        "--fusemount",
        "--home",
        "-H",
        "--hostname",
        "--memory",
        "--memory-reservation",
        "--memory-swap",
        "--mount",
        "--network",
        "--network-args",
        "--overlay",
        "-o",
        "--pem-path",
        "--pids-limit",
        "--pwd",
        "--scratch",
        "-S",
        "--security",
        "--workdir",
        "-W",
    }
)
CLEANENV_KEEP = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "TERM")
ENV_PREFIXES = ("APPTAINERENV_", "SINGULARITYENV_")


class UsageError(Exception):
    """Bad stand-in invocation; reported like an apptainer FATAL error."""


def parse(args: list[str]) -> tuple[list[tuple[str, str | None]], str, list[str]]:
    """Split ``[flags] IMAGE CMD...`` into (flags, image, command)."""
    flags: list[tuple[str, str | None]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--":
            i += 1
            break
        if not arg.startswith("-") or arg == "-":
            break
        name, eq, inline = arg.partition("=")
        if name in VALUE_FLAGS:
            if eq:
                flags.append((name, inline))
            elif i + 1 < len(args):
                i += 1
                flags.append((name, args[i]))
            else:
                raise UsageError(f"flag {name} needs a value")
        else:
            flags.append((arg, None))
        i += 1
    if i >= len(args):
        raise UsageError("missing IMAGE")
    image, command = args[i], args[i + 1 :]
    if not command:
        raise UsageError("missing command after IMAGE")
    return flags, image, command


def values(flags: list[tuple[str, str | None]], *names: str) -> list[str]:
    return [value for name, value in flags if name in names and value is not None]


def container_env(flags: list[tuple[str, str | None]], host: dict[str, str]) -> dict[str, str]:
    """The environment apptainer would give the command (without shell evaluation)."""
    cleanenv = any(name in ("--cleanenv", "-e") for name, _ in flags)
    env = {k: v for k, v in host.items() if k in CLEANENV_KEEP} if cleanenv else dict(host)
    for key, value in host.items():
        for prefix in ENV_PREFIXES:
            if key.startswith(prefix):
                env.pop(key, None)
                if key[len(prefix) :]:
                    env[key[len(prefix) :]] = value
    assignments = [item for value in values(flags, "--env") for item in next(csv.reader([value]))]
    for path in values(flags, "--env-file"):
        with open(path, encoding="utf-8") as f:
            lines = [line.strip() for line in f]
        assignments += [line for line in lines if line and not line.startswith("#")]
    for assignment in assignments:
        key, eq, value = assignment.partition("=")
        if not eq or not key:
            raise UsageError(f"environment assignment must be KEY=VALUE, got {assignment!r}")
        env[key] = value
    return env


def record(argv: list[str], flags, image: str, command: list[str], env: dict[str, str]) -> None:
    log = os.environ.get("CONTAINER_STANDIN_LOG")
    if not log:
        return
    binds = [b for value in values(flags, "--bind", "-B") for b in value.split(",") if b]
    entry = {
        "argv": argv,
        "subcommand": "exec",
        "flags": [[name, value] for name, value in flags],
        "binds": binds,
        "env_binds": {
            k: os.environ[k] for k in ("APPTAINER_BIND", "SINGULARITY_BIND") if k in os.environ
        },
        "image": image,
        "command": command,
        "cwd": os.getcwd(),
        "pid": os.getpid(),
    }
    if os.environ.get("CONTAINER_STANDIN_RECORD_ENV") == "1":
        entry["env"] = env
    line = (json.dumps(entry) + "\n").encode()
    fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--version"]:
        print(VERSION)
        return 0
    try:
        if not argv or argv[0] != "exec":
            raise UsageError("only 'exec [flags] IMAGE CMD...' is supported")
        flags, image, command = parse(argv[1:])
        if not os.path.exists(image):
            raise UsageError(f"could not open image {image}: no such file or directory")
        env = container_env(flags, dict(os.environ))
    except (UsageError, OSError) as e:
        print(f"FATAL:   {e}", file=sys.stderr)
        return FATAL
    record(argv, flags, image, command, env)
    for workdir in values(flags, "--pwd")[-1:]:
        os.chdir(workdir)
    sys.stdout.flush()
    try:
        os.execvpe(command[0], command, env)
    except OSError as e:
        print(f"FATAL:   {command[0]}: {e.strerror}", file=sys.stderr)
        return 127
    return 0  # not reached: execvpe replaced this process


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
