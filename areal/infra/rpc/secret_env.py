"""Secrets that reach workers through their environment, named (never sent) in RPC bodies.

DESIGN 15: no secret travels in clear in a request. The scheduler collects every secret
of the experiment config (:func:`config_secrets`), exports each to its workers as an
``AREAL_SECRET_<DOTTED_PATH>`` variable (the same way it passes the RPC token), and the
RPC client encodes a secret as a reference to that variable. The worker rebuilds the
:class:`~areal.utils.secrets.SecretStr` from its own environment (:func:`read_secret`).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from typing import Any

from areal.utils.secrets import SecretStr, reveal

__all__ = ["SECRET_ENV_PREFIX", "config_secrets", "read_secret", "secret_refs"]

SECRET_ENV_PREFIX = "AREAL_SECRET_"
_NOT_NAME = re.compile(r"[^A-Za-z0-9]+")


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
