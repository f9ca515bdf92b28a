"""Start a local Arena in-process (tests, notebooks, the demo driver).

with running_local_arena(tmp_path) as arena:
    client = ArenaOpenAPIClient(base_url=arena.base_url, api_token=arena.token)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from areal.utils.serving import serve_in_thread
from examples.swe.local_arena.faults import FaultConfig
from examples.swe.local_arena.server import LocalArena, LocalArenaConfig, create_app, new_token
from examples.swe.local_arena.types import Catalog

__all__ = ["LocalArenaHandle", "running_local_arena"]


@dataclass
class LocalArenaHandle:
    base_url: str
    token: str
    arena: LocalArena

    @property
    def gateway_url(self) -> str:
        return f"{self.base_url}/api"

    def set_faults(self, **settings: Any) -> FaultConfig:
        """Replace the fault settings (keys as in :class:`FaultConfig`)."""
        self.arena.faults = FaultConfig.from_mapping(settings)
        return self.arena.faults


@contextmanager
def running_local_arena(
    directory: str | Path,
    catalog: Catalog | str | Path | None = None,
    *,
    token: str | None = None,
    envelope: str = "plain",
    faults: dict[str, Any] | None = None,
    task_timeout: float = 120.0,
    max_concurrent_tasks: int = 16,
    host: str = "127.0.0.1",
    port: int | None = None,
    db_name: str = "arena.db",
    max_body_bytes: int | None = None,
    body_timeout: float | None = None,
) -> Iterator[LocalArenaHandle]:
    """Serve a local Arena whose database lives in ``directory``; yields its handle.

    Reusing ``directory`` (and ``db_name``) reopens the same state, as a restart does.
    """
    from examples.swe.local_arena.catalog import DEFAULT_CATALOG, load_catalog

    if not isinstance(catalog, Catalog):
        catalog = load_catalog(catalog or DEFAULT_CATALOG)
    merged = {**catalog.faults, **(faults or {})}
    config = LocalArenaConfig(
        db=Path(directory) / db_name,
        catalog=catalog,
        token=token or new_token(),
        task_timeout=task_timeout,
        max_concurrent_tasks=max_concurrent_tasks,
        faults=FaultConfig.from_mapping(merged),
        envelope=envelope,
        **({} if max_body_bytes is None else {"max_body_bytes": max_body_bytes}),
        **({} if body_timeout is None else {"body_timeout": body_timeout}),
    )
    app = create_app(config)
    with serve_in_thread(app, host, port) as url:
        yield LocalArenaHandle(url, config.token, app.state.arena)
