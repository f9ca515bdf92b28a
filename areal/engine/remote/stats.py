"""A rollout worker's stats: all its trackers and its proxies', as one mergeable export."""

from __future__ import annotations

import httpx

from areal.api.io_struct import LocalInfServerInfo
from areal.utils import logging, stats_tracker

__all__ = ["combine_mergeable", "proxy_stats", "worker_stats"]

logger = logging.getLogger("engine.remote")


def combine_mergeable(exports: list[dict[str, float]]) -> dict[str, float]:
    """Several ``export(mergeable=True)`` results as one, still mergeable: the values of
    ``stats_tracker.merge_exports`` with each key's tag (counts summed) kept."""
    merged = stats_tracker.merge_exports(exports)
    out = dict(merged)
    for key in merged:
        for tag in ("__count", "__sum", "__min", "__max"):
            weights = [e[key + tag] for e in exports if key + tag in e]
            if weights:
                out[key + tag] = sum(weights) if tag == "__count" else 1.0
                break
    return out


def proxy_stats(
    http: httpx.Client, proxies: list[LocalInfServerInfo], admin_key: str
) -> list[dict[str, float]]:
    """What each proxy recorded since the last call (``POST /rl/stats``, admin key); a
    proxy that cannot answer costs its metrics of this step, never the step."""
    headers = {"Authorization": f"Bearer {admin_key}"}
    out = []
    for proxy in proxies:
        try:
            response = http.post(f"http://{proxy.address}/rl/stats", headers=headers, timeout=30)
            response.raise_for_status()
            out.append(dict(response.json()["stats"]))
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:
            logger.warning("no stats from the proxy on %s this step: %s", proxy.address, e)
    return out


def worker_stats(
    http: httpx.Client, proxies: list[LocalInfServerInfo], admin_key: str
) -> dict[str, float]:
    """Everything this worker recorded, in any tracker (``rollout/*``, ``eval-rollout/*``,
    a workflow's own), and its proxies' (``proxy/*``), mergeable."""
    exports = [stats_tracker.export_all(mergeable=True)]
    if proxies:
        exports += proxy_stats(http, proxies, admin_key)
    return exports[0] if len(exports) == 1 else combine_mergeable(exports)
