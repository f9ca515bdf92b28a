"""Redaction of secrets in anything derived from a config before it is saved or logged."""

from __future__ import annotations

import dataclasses
from typing import Any

from areal.utils.secrets import REDACTED, SecretStr, redact_urls

__all__ = ["is_sensitive_key", "redact_sensitive_config"]

_EXACT_KEYS = frozenset({"authorization", "password", "secret", "token"})
_CONTAINED = ("api_key", "private_key")
_SUFFIXES = ("_password", "_secret", "_token", "_credential")
# Payloads that carry whole stream documents (and possibly task env secrets).
_EXTRA_KEYS = frozenset({"arena_streams_yaml_b64"})


def is_sensitive_key(key: object) -> bool:
    """Whether a mapping key names a secret (``api_key``-like, ``*_token``, ...)."""
    if not isinstance(key, str):
        return False
    k = key.lower()
    return (
        k in _EXACT_KEYS
        or k in _EXTRA_KEYS
        or any(part in k for part in _CONTAINED)
        or k.endswith(_SUFFIXES)
    )


def redact_sensitive_config(value: Any) -> Any:
    """A copy of ``value`` with every secret replaced by ``"<redacted>"``.

    Walks dicts, lists, tuples and dataclasses (dataclasses become dicts). A value is
    replaced whole when its key is sensitive (see :func:`is_sensitive_key`), and so is
    any non-empty :class:`SecretStr` wherever it sits; ``None`` and ``""`` are kept so
    that a reader can still see that a secret was not set. In every other string, URLs
    keep scheme, host, port and path but lose user-info, query values and fragment
    (``https://u:pw@h/p?key=s`` is saved as ``https://***@h/p?key=***``).
    """
    return _redact(value)


def _redact(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _redact_entry(k, v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_redact(v) for v in value)
    if isinstance(value, SecretStr) and value:
        return REDACTED
    if isinstance(value, str):
        return redact_urls(value)
    return value


def _redact_entry(key: object, value: Any) -> Any:
    if is_sensitive_key(key) and value is not None and value != "":
        return REDACTED
    return _redact(value)
