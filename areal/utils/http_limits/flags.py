"""A server's limit flags on its command line, and limit defaults from the environment."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from areal.utils.http_limits.limits import HttpLimits

__all__ = ["LimitFlags", "limit_from_env"]


@dataclass(frozen=True)
class _Flag:
    field: str
    type: type
    help: str
    zero_disables: bool = False


_FLAGS = {
    "--max-body-bytes": _Flag("max_body_bytes", int, "largest request body in bytes; 413 above"),
    "--body-timeout": _Flag(
        "body_timeout", float, "seconds a request body may stall between two parts; 408 after"
    ),
    "--header-timeout": _Flag(
        "header_timeout", float, "seconds a request's line and headers may take to arrive"
    ),
    "--max-header-bytes": _Flag(
        "max_header_bytes", int, "largest request line plus headers in bytes; 431 above"
    ),
    "--idle-timeout": _Flag(
        "keep_alive_timeout", int, "seconds a kept-alive connection may idle between requests"
    ),
    "--keep-alive-timeout": _Flag(
        "keep_alive_timeout", float, "seconds an idle kept-alive connection stays open"
    ),
    "--request-deadline": _Flag(
        "request_deadline",
        float,
        "seconds until an unanswered request gets 504 and is cancelled; 0 disables",
        zero_disables=True,
    ),
}


def limit_from_env(name: str, default: Any, kind: type = float) -> Any:
    """A positive number from ``$name``, else ``default``; a clear error if malformed."""
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"${name}={raw!r} is not {what}") from None
    if not value > 0:
        raise ValueError(f"${name} must be positive (got {raw!r})")
    return value


@dataclass(frozen=True)
class LimitFlags:
    """The limit flags of one server's command line, with that server's defaults.

    ``flags`` are spelled as on the command line (see ``_FLAGS``); ``env`` maps a flag to
    the environment variable that gives its default.
    """

    defaults: HttpLimits
    flags: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = [flag for flag in self.flags if flag not in _FLAGS]
        if unknown:
            raise ValueError(f"no such limit flags: {unknown} (known: {sorted(_FLAGS)})")

    def add_arguments(
        self, parser: argparse.ArgumentParser, description: str | None = None
    ) -> argparse._ArgumentGroup:
        """Add the flags to ``parser`` in a ``limits`` group (returned, for more flags)."""
        group = parser.add_argument_group("limits", description)
        for flag in self.flags:
            spec = _FLAGS[flag]
            default = getattr(self.defaults, spec.field)
            if spec.zero_disables and default is None:
                default = 0
            if flag in self.env:  # None here: parse() reads the variable, then the default
                shown, default = f"${self.env[flag]}, else {default}", None
            else:
                shown = "%(default)s"
            group.add_argument(
                flag, type=spec.type, default=default, help=f"{spec.help} (default {shown})"
            )
        return group

    def parse(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> HttpLimits:
        """The limits ``args`` give; ``parser.error`` naming the flag for a bad value."""
        values: dict[str, Any] = {}
        for flag in self.flags:
            spec = _FLAGS[flag]
            value = getattr(args, flag[2:].replace("-", "_"))
            if value is None and flag in self.env:
                try:
                    value = limit_from_env(
                        self.env[flag], getattr(self.defaults, spec.field), spec.type
                    )
                except ValueError as e:
                    parser.error(str(e))
            if spec.zero_disables and value == 0:
                value = None
            elif not (math.isfinite(value) and value > 0):
                zero = " (or 0 for none)" if spec.zero_disables else ""
                parser.error(f"{flag} must be positive{zero}, got {value}")
            values[spec.field] = value
        return dataclasses.replace(self.defaults, **values)
