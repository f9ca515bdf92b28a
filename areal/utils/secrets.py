"""Secret strings: values that print as ``<redacted>`` everywhere unless revealed."""

from __future__ import annotations

import yaml

__all__ = ["REDACTED", "SecretStr", "reveal"]

REDACTED = "<redacted>"


class SecretStr(str):
    """A ``str`` whose printed forms are redacted.

    ``str()``, ``repr()``, f-strings and ``%s`` formatting (and therefore log records)
    show ``<redacted>``; code that must send the value (an HTTP header, a key compare)
    calls :func:`reveal`. Concatenation, ``encode`` and equality still see the real
    value, so a ``SecretStr`` can stand in wherever a ``str`` is expected.
    """

    __slots__ = ()

    def __str__(self) -> str:
        return REDACTED if len(self) else ""

    def __format__(self, format_spec: str) -> str:
        return format(str(self), format_spec)

    def __repr__(self) -> str:
        return f"SecretStr({REDACTED!r})" if len(self) else "SecretStr('')"

    def reveal(self) -> str:
        """The secret value as a plain ``str``."""
        return str.__str__(self)


def reveal(value: str | None) -> str:
    """The plain value of a secret or ordinary string (``None`` gives ``""``)."""
    if value is None:
        return ""
    if isinstance(value, SecretStr):
        return value.reveal()
    return str(value)


def _represent_secret(dumper: yaml.SafeDumper, value: SecretStr) -> yaml.Node:
    return dumper.represent_str(str(value))


# Any YAML dump of a config that still holds a secret writes the redacted form.
yaml.add_representer(SecretStr, _represent_secret, Dumper=yaml.SafeDumper)
yaml.add_representer(SecretStr, _represent_secret, Dumper=yaml.Dumper)
