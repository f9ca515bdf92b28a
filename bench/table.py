"""Plain-text tables for benchmark reports."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def format_cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "-" if value is None else str(value)


def render_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A title line and a right-aligned table (first column left-aligned)."""
    cells = [[format_cell(v) for v in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]

    def line(values: Sequence[str]) -> str:
        first, *rest = values
        return "  ".join([first.ljust(widths[0]), *(v.rjust(w) for v, w in zip(rest, widths[1:]))])

    rule = "-" * len(line(columns))
    return "\n".join([title, line(columns), rule, *(line(r) for r in cells)])
