"""Paging a Stream's dataset: the page plan and the checks every page must pass.

Arena pages are offset/limit windows of at most 1000 ids. A one-row probe gives the
total; then every page must repeat that total, echo the planned offset and limit, count
its ids, never repeat an id, and (when it lists ``items``) describe exactly its ids.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from examples.swe.arena_results import ArenaAPIError, _arena_task_type_from_tags

__all__ = ["DatasetPages", "dataset_total", "plan_pages"]


def _int_field(page: Mapping[str, Any], key: str) -> int | None:
    value = page.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def dataset_total(probe: Any, stream_id: str) -> int:
    """The ``total`` of a probe page; an error when it is invalid or zero."""
    total = _int_field(probe, "total") if isinstance(probe, Mapping) else None
    if total is None or total < 0:
        raise ArenaAPIError(f"Arena dataset of {stream_id!r} has an invalid total")
    if total == 0:
        raise ArenaAPIError(f"Arena Stream {stream_id!r} contains no dataset rows")
    return total


def plan_pages(total: int, max_limit: int) -> list[tuple[int, int]]:
    """``(limit, offset)`` of every page: offsets 0, max_limit, ... below ``total``."""
    return [(min(max_limit, total - offset), offset) for offset in range(0, total, max_limit)]


class DatasetPages:
    """Collects validated pages in order and turns them into dataset rows."""

    def __init__(self, stream_id: str, total: int):
        self.stream_id = stream_id
        self.total = total
        self.ids: list[str] = []
        self._seen: set[str] = set()
        self._seen_items: set[str] = set()
        self._tags: dict[str, Any] = {}

    def add(self, page: Any, limit: int, offset: int) -> None:
        if not isinstance(page, Mapping):
            raise ArenaAPIError("Arena dataset response must be a JSON object")
        if _int_field(page, "total") != self.total:
            raise ArenaAPIError("Arena dataset total changed during pagination")
        for key, expected in (("offset", offset), ("limit", limit)):
            if _int_field(page, key) != expected:
                raise ArenaAPIError(
                    f"Arena dataset pagination returned {key} {page.get(key)!r}, "
                    f"expected {expected}"
                )
        data_ids = page.get("data_ids")
        if not isinstance(data_ids, list) or not all(isinstance(i, str) and i for i in data_ids):
            raise ArenaAPIError("Arena dataset page has an invalid data_ids array")
        if _int_field(page, "count") != len(data_ids):
            raise ArenaAPIError(
                f"Arena dataset pagination returned count {page.get('count')!r} for "
                f"{len(data_ids)} ids"
            )
        page_ids = set(data_ids)
        if len(page_ids) != len(data_ids) or not page_ids.isdisjoint(self._seen):
            raise ArenaAPIError("Arena dataset pagination returned duplicate ids")
        self._seen.update(page_ids)
        self.ids.extend(data_ids)
        if page.get("items") is not None:
            self._add_items(page["items"], page_ids)

    def _add_items(self, items: Any, page_ids: set[str]) -> None:
        if not isinstance(items, list) or len(items) != len(page_ids):
            raise ArenaAPIError("Arena dataset page items do not match its data_ids")
        item_ids = []
        for item in items:
            item_id = item.get("data_id") if isinstance(item, Mapping) else None
            if not isinstance(item_id, str) or not item_id:
                raise ArenaAPIError("Arena dataset page has an item without a data_id")
            item_ids.append(item_id)
            self._tags[item_id] = item.get("tags")
        unique = set(item_ids)
        if len(unique) != len(item_ids) or not unique.isdisjoint(self._seen_items):
            raise ArenaAPIError("Arena dataset items contain duplicate ids")
        self._seen_items.update(unique)
        if unique != page_ids:
            raise ArenaAPIError("Arena dataset page items do not match its data_ids")

    def rows(self, llm_protocol: str) -> list[dict[str, str]]:
        """One row per id, in Arena's order; task types come from the items' tags."""
        if len(self.ids) != self.total:
            raise ArenaAPIError(
                f"Arena dataset of {self.stream_id!r} returned {len(self.ids)} ids for total "
                f"{self.total}"
            )
        return [
            {
                "data_id": data_id,
                "stream_id": self.stream_id,
                "llm_protocol": llm_protocol,
                "arena_task_type": _arena_task_type_from_tags(self._tags[data_id])
                if data_id in self._tags
                else "unknown",
            }
            for data_id in self.ids
        ]
