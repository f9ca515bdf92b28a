"""Secrets that reach workers through their environment, named (never sent) in RPC bodies.

No secret travels in clear in a request. The scheduler collects every secret of the
experiment config (:func:`config_secrets`), exports each to the workers that use it as an
``AREAL_SECRET_<DOTTED_PATH>`` variable (the same way it passes the RPC token), and the
RPC client encodes a secret as a reference to that variable. The worker rebuilds the
:class:`~areal.utils.secrets.SecretStr` from its own environment (:func:`read_secret`).

Each role gets only the secrets it uses (its :data:`SecretScope`):

* every worker: the RPC token, which signs its requests and answers;
* ``"rollout"`` workers (rollout and evaluation rollout): the config secrets under
  ``rollout.`` and ``econfig.`` (the proxy admin key...), the Arena credentials of the
  controller's environment (:data:`ROLLOUT_CREDENTIAL_VARS`) and the inference API key;
  they pass on to their own children only what each uses (a proxy: the admin key and the
  inference key; a server: its API key);
* ``"none"`` (trainers): nothing else. The logger keys (W&B, SwanLab) stay on the controller.

A secret a role does not get is sent to it redacted (it arrives empty). A worker started
by another one (``/fork``) receives its secrets from a mode-0600 file whose path it is
given (:data:`SECRETS_FILE_ENV`), never through its parent's environment.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shlex
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from areal.utils.logging import SECRET_ENV_VARS
from areal.utils.secrets import SecretStr, reveal

__all__ = [
    "ROLLOUT_CREDENTIAL_VARS",
    "SECRETS_FILE_ENV",
    "SECRET_ENV_PREFIX",
    "SecretScope",
    "config_secrets",
    "is_secret_var",
    "load_secrets_file",
    "public_environ",
    "read_secret",
    "scoped_config_secrets",
    "secret_refs",
    "secrets_file_text",
]

SECRET_ENV_PREFIX = "AREAL_SECRET_"
SECRETS_FILE_ENV = "AREAL_SECRETS_FILE"
"""Path of a mode-0600 file of ``export NAME=value`` lines a starting worker loads."""
SecretScope = Literal["none", "rollout"]
ROLLOUT_CREDENTIAL_VARS = ("ARENA_OPENAPI_TOKEN", "ARENA_LLM_API_KEY")
"""Credentials of the controller's environment that rollout workers (the Arena agent) use."""
_ROLLOUT_CONFIG_PREFIXES = (SECRET_ENV_PREFIX + "ROLLOUT_", SECRET_ENV_PREFIX + "ECONFIG_")
_NOT_NAME = re.compile(r"[^A-Za-z0-9]+")


def is_secret_var(name: str) -> bool:
    """Whether an environment variable holds one of the run's secrets."""
    return name in SECRET_ENV_VARS or name.startswith(SECRET_ENV_PREFIX)


def public_environ(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) without any secret variable: the base environment
    of a child process, to which the caller adds the secrets that child uses."""
    source = os.environ if env is None else env
    return {k: v for k, v in source.items() if not is_secret_var(k) and k != SECRETS_FILE_ENV}


def scoped_config_secrets(
    found: Mapping[str, SecretStr], scope: SecretScope
) -> dict[str, SecretStr]:
    """The config secrets (from :func:`config_secrets`) that roles of ``scope`` use."""
    if scope == "none":
        return {}
    return {
        name: value for name, value in found.items() if name.startswith(_ROLLOUT_CONFIG_PREFIXES)
    }


def secrets_file_text(secrets: Mapping[str, str]) -> str:
    """Shell ``export`` lines (literal values, no expansion): a worker's secrets file."""
    return "".join(f"export {k}={shlex.quote(reveal(v))}\n" for k, v in secrets.items())


def load_secrets_file(path: str | os.PathLike[str]) -> dict[str, str]:
    """Read a secrets file written by :func:`secrets_file_text`; ``{name: value}``.

    Refuses a file others may read or write (it must be a regular file of this user with
    mode 0600 or stricter), and any line that is not one ``export NAME=value``.
    """
    target = Path(path)
    stat = target.lstat()
    if not target.is_file() or target.is_symlink():
        raise ValueError(f"secrets file {target} is not a regular file")
    if stat.st_uid != os.getuid() or stat.st_mode & 0o077:
        raise ValueError(
            f"secrets file {target} must belong to this user with mode 0600 (it has "
            f"{oct(stat.st_mode & 0o777)})"
        )
    words = shlex.split(target.read_text())  # a quoted value may span lines
    found: dict[str, str] = {}
    for i in range(0, len(words), 2):
        pair = words[i : i + 2]
        if len(pair) != 2 or pair[0] != "export" or "=" not in pair[1]:
            raise ValueError(f"secrets file {target}: expected 'export NAME=value' lines")
        name, _, value = pair[1].partition("=")
        found[name] = value
    return found


def config_secrets(config: Any) -> dict[str, SecretStr]:
    """``{variable name: secret}`` for every non-empty secret in ``config``.

    Walks dataclasses, dicts, lists and tuples; a secret at ``rollout.agent.admin_api_key``
    becomes ``AREAL_SECRET_ROLLOUT_AGENT_ADMIN_API_KEY``. A value found at several paths
    (a config copied into another) is exported once, under its first path.
    """
    found: dict[str, SecretStr] = {}
    seen: set[str] = set()
    for path, secret in _walk(config, ""):
        plain = reveal(secret)
        if not plain or plain in seen:
            continue
        seen.add(plain)
        name = SECRET_ENV_PREFIX + _NOT_NAME.sub("_", path).strip("_").upper()
        while name in found:  # two paths that spell the same name
            name += "_"
        found[name] = SecretStr(plain)
    return found


def secret_refs(environment: Mapping[str, str]) -> dict[str, str]:
    """``{secret value: variable name}``: the inverse of :func:`config_secrets`."""
    return {reveal(value): name for name, value in environment.items() if reveal(value)}


def read_secret(name: str) -> SecretStr:
    """The secret this process received as ``$name``; ``KeyError`` when it has none."""
    if not name.startswith(SECRET_ENV_PREFIX):
        raise KeyError(f"{name!r} is not a secret variable (names start with {SECRET_ENV_PREFIX})")
    if name not in os.environ:
        raise KeyError(f"${name} is not set in this worker's environment")
    return SecretStr(os.environ[name])


def _walk(value: Any, path: str):
    if isinstance(value, SecretStr):
        yield path, value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _walk(getattr(value, f.name, None), f"{path}.{f.name}")
    elif isinstance(value, Mapping):
        for key, item in value.items():
            yield from _walk(item, f"{path}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _walk(item, f"{path}.{i}")
