"""Plain-text tables for reports (benchmarks, CLI summaries)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["format_cell", "render_table"]


def format_cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}" if abs(value) < 100 else f"{value:,.0f}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return "-" if value is None else str(value)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def render_table(title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A title line and a table: numeric columns right-aligned, text columns left-aligned."""
    cells = [[format_cell(v) for v in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    numeric = [
        bool(rows) and all(_is_number(r[i]) or r[i] is None for r in rows)
        for i in range(len(columns))
    ]

    def line(values: Sequence[str]) -> str:
        return "  ".join(
            v.rjust(w) if right else v.ljust(w) for v, w, right in zip(values, widths, numeric)
        ).rstrip()

    header = line(columns)
    return "\n".join([title, header, "-" * len(header), *(line(r) for r in cells)])
