"""Secret strings, and redaction of the secret parts of URLs (user-info, query, fragment)."""

from __future__ import annotations

import re

import yaml

__all__ = [
    "REDACTED",
    "REDACTED_PART",
    "SecretStr",
    "redact_url",
    "redact_urls",
    "refuse_printed_form",
    "reveal",
]

REDACTED = "<redacted>"
REDACTED_PART = "***"  # stands for the secret part of a URL, so the rest stays readable

# A URL in free text: a scheme, "://", then everything up to whitespace, a quote or a
# bracket that closes a surrounding construct.
_URL_IN_TEXT = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]*")


class SecretStr(str):
    """A ``str`` whose printed forms are redacted.

    ``str()``, ``repr()``, f-strings and ``%s`` formatting (and therefore log records)
    show ``<redacted>``; code that must send the value (an HTTP header, a key compare)
    calls :func:`reveal`. Concatenation, ``encode`` and equality still see the real
    value, so a ``SecretStr`` can stand in wherever a ``str`` is expected.

    Surrounding whitespace is dropped on construction: a key read from a file or an
    environment variable often ends in a newline, which would break an HTTP header and
    slip past redaction of the bare key.
    """

    __slots__ = ()

    def __new__(cls, value: object = "") -> SecretStr:
        plain = value.reveal() if isinstance(value, SecretStr) else str(value)
        return super().__new__(cls, plain.strip())

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


def refuse_printed_form(value: str | None, what: str) -> str:
    """The plain ``value``, or ``ValueError`` when it is a secret's printed form.

    ``<redacted>`` is what a secret looks like in a saved config, a log or a ``repr``; a
    key equal to it is public, so wherever a key is accepted it is refused, naming
    ``what`` (the flag, variable or field the key came from).
    """
    plain = reveal(value)
    if plain.strip() == REDACTED:
        raise ValueError(
            f"{what} is {REDACTED!r}, the printed form of a secret (copied from a saved "
            "config or a log?); set the real value"
        )
    return plain


def _redact_query(query: str) -> str:
    pairs = []
    for pair in query.split("&"):
        name, sep, _ = pair.partition("=")
        pairs.append(f"{name}={REDACTED_PART}" if sep else (REDACTED_PART if pair else ""))
    return "&".join(pairs)


def redact_url(url: str) -> str:
    """``url`` with its user-info, query values and fragment replaced by ``***``.

    Scheme, host, port and path are kept (``https://u:pw@h:8/p?key=s#t`` gives
    ``https://***@h:8/p?key=***#***``). Works on text that is not a valid URL too (a bad
    port, spaces), since it is what error messages about such URLs show.
    """
    text = str(url)
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "", text
    head = len(rest)
    for mark in "/?#":
        index = rest.find(mark)
        if index != -1:
            head = min(head, index)
    authority, tail = rest[:head], rest[head:]
    if "@" in authority:
        authority = f"{REDACTED_PART}@{authority.rpartition('@')[2]}"
    tail, hash_sep, fragment = tail.partition("#")
    path, query_sep, query = tail.partition("?")
    out = f"{scheme}{sep}{authority}{path}"
    if query_sep:
        out += "?" + _redact_query(query)
    if hash_sep:
        out += "#" + (REDACTED_PART if fragment else "")
    return out


def redact_urls(text: str) -> str:
    """``text`` with every ``scheme://...`` URL in it passed through :func:`redact_url`."""
    if "://" not in text:
        return text
    return _URL_IN_TEXT.sub(lambda m: redact_url(m.group(0)), text)


def _represent_secret(dumper: yaml.SafeDumper, value: SecretStr) -> yaml.Node:
    return dumper.represent_str(str(value))


# Any YAML dump of a config that still holds a secret writes the redacted form.
yaml.add_representer(SecretStr, _represent_secret, Dumper=yaml.SafeDumper)
yaml.add_representer(SecretStr, _represent_secret, Dumper=yaml.Dumper)
