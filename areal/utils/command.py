"""Turning option dicts into command lines."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["get_py_cmd", "to_cli_flags"]


def to_cli_flags(args: Mapping[str, Any]) -> list[str]:
    """``{"tp_size": 2, "trust_remote_code": True}`` -> ``["--tp-size", "2", ...]``.

    Keys go from snake_case to ``--kebab-case``. ``None``, ``False``, ``""`` and ``[]``
    are left out; ``True`` gives a bare flag; a list gives the flag followed by each
    element.
    """
    tokens: list[str] = []
    for key, value in args.items():
        if value is None or value is False or value == "" or value == []:
            continue
        flag = "--" + key.replace("_", "-")
        if value is True:
            tokens.append(flag)
        elif isinstance(value, (list, tuple)):
            tokens.append(flag)
            tokens.extend(str(v) for v in value)
        else:
            tokens.extend([flag, str(value)])
    return tokens


def get_py_cmd(module: str, args: Mapping[str, Any], python: str = "python3") -> list[str]:
    """``python3 -m <module> <flags>`` as an argv list (see :func:`to_cli_flags`)."""
    return [python, "-m", module, *to_cli_flags(args)]
