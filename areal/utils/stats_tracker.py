"""Scoped statistics: record values during a step, export reduced scalars at its end.

Record kinds:

* ``denominator(**masks)``: boolean masks; exported as their total count (SUM).
* ``stat(denominator=key, **values)``: float tensors of the mask's shape; exported as
  ``key/avg``, ``key/min``, ``key/max`` over the elements where the mask is true.
* ``scalar(**floats)``: plain numbers; exported as their mean plus ``key__count``
  (the count lets rollout-worker stats be merged as a count-weighted mean).
* ``record_timing(key)``: a context manager recording seconds under ``timeperf/<key>``.

Keys are prefixed by the tracker's name, then by the active scopes: a named tracker
records under its name (``get("rollout").scalar(reward=1.0)`` exports ``rollout/reward``,
``get(workflow_context.stat_scope())`` records under ``rollout/`` or ``eval-rollout/``),
and ``with scope("a"): scalar(reward=1.0)`` on the default tracker ``""`` (the module
functions) records ``a/reward``. The scope stack lives in a context variable, so
concurrent asyncio tasks each keep their own. A rollout worker exports every tracker
(:func:`export_all`), so whatever a workflow records in any named tracker reaches the
trainer's stats.
"""

from __future__ import annotations

import asyncio
import contextvars
import enum
import functools
import math
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = [
    "ReduceType",
    "StatsTracker",
    "denominator",
    "export",
    "export_all",
    "get",
    "merge_exports",
    "record_timing",
    "scalar",
    "scope",
    "stat",
]


class ReduceType(enum.Enum):
    AVG_MIN_MAX = "avg_min_max"
    AVG = "avg"
    SUM = "sum"
    MIN = "min"
    MAX = "max"
    SCALAR = "scalar"


class _Scope:
    """``with tracker.scope(name):`` or ``@tracker.scope(name)`` (sync or async functions)."""

    def __init__(self, tracker: StatsTracker, name: str):
        self._tracker = tracker
        self._name = name
        self._tokens: list[contextvars.Token] = []

    def __enter__(self) -> _Scope:
        self._tokens.append(self._tracker._scopes.set((*self._tracker._scopes.get(), self._name)))
        return self

    def __exit__(self, *exc: object) -> None:
        self._tracker._scopes.reset(self._tokens.pop())

    def __call__(self, fn: Callable) -> Callable:
        tracker, name = self._tracker, self._name
        if asyncio.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def async_wrapper(*args: Any, **kwargs: Any) -> Any:
                with _Scope(tracker, name):
                    return await fn(*args, **kwargs)

            return async_wrapper

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with _Scope(tracker, name):
                return fn(*args, **kwargs)

        return wrapper


class StatsTracker:
    """One named tracker; see the module docstring for the record kinds."""

    def __init__(self, name: str = ""):
        self.name = name.strip("/")
        self._prefix: tuple[str, ...] = (self.name,) if self.name else ()
        self._scopes: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar(
            f"stats_scopes_{name}_{id(self)}", default=()
        )
        self._lock = threading.Lock()
        self._kinds: dict[str, ReduceType] = {}
        self._values: dict[str, list[Any]] = {}
        self._masks: dict[str, list[torch.Tensor]] = {}

    # --- recording ---

    def scope(self, name: str) -> _Scope:
        return _Scope(self, name)

    def _key(self, key: str) -> str:
        return "/".join((*self._prefix, *self._scopes.get(), key))

    def _record(self, key: str, kind: ReduceType, value: Any) -> None:
        previous = self._kinds.setdefault(key, kind)
        if previous is not kind:
            raise ValueError(f"stat {key!r} was recorded as {previous.value}, now as {kind.value}")
        self._values.setdefault(key, []).append(value)

    def denominator(self, **masks: torch.Tensor) -> None:
        """Record boolean masks (exported as the count of true elements)."""
        with self._lock:
            for key, mask in masks.items():
                if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
                    raise TypeError(f"denominator {key!r} must be a bool tensor")
                full = self._key(key)
                mask = mask.detach().cpu()
                self._record(full, ReduceType.SUM, mask)
                self._masks.setdefault(full, []).append(mask)

    def stat(
        self,
        denominator: str,
        reduce_type: ReduceType = ReduceType.AVG_MIN_MAX,
        **values: torch.Tensor,
    ) -> None:
        """Record float tensors, reduced over the elements where ``denominator`` is true."""
        with self._lock:
            den_key = self._key(denominator)
            if den_key not in self._masks:
                raise ValueError(f"denominator {den_key!r} must be recorded before stat()")
            mask = self._masks[den_key][-1]
            for key, value in values.items():
                value = torch.as_tensor(value).detach().float().cpu()
                if value.shape != mask.shape:
                    raise ValueError(
                        f"stat {key!r} has shape {tuple(value.shape)}, denominator "
                        f"{denominator!r} has {tuple(mask.shape)}"
                    )
                full = self._key(key)
                self._record(full, reduce_type, (value, mask))

    def scalar(self, **values: float) -> None:
        """Record plain numbers (exported as the mean and ``key__count``)."""
        with self._lock:
            for key, value in values.items():
                self._record(self._key(key), ReduceType.SCALAR, float(value))

    @contextmanager
    def record_timing(self, key: str) -> Iterator[None]:
        """Record the block's wall time in seconds as ``timeperf/<key>`` (under the
        tracker's name, not under the active scopes)."""
        start = time.perf_counter()
        try:
            yield
        finally:
            full = "/".join((*self._prefix, "timeperf", key))
            with self._lock:
                self._record(full, ReduceType.SCALAR, time.perf_counter() - start)

    # --- export ---

    def export(
        self,
        key: str | None = None,
        reduce_group: Any = None,
        reset: bool = True,
        mergeable: bool = False,
    ) -> dict[str, float]:
        """Reduce everything recorded (or only keys under ``key``) to floats.

        With a ``torch.distributed`` ``reduce_group`` the sums, counts, minima and maxima
        are all-reduced first, so every rank gets the global values; every rank must then
        have recorded the same keys.

        ``mergeable`` adds, for every exported key, how exports of several processes
        combine (see :func:`merge_exports`): ``<key>__count`` for a mean (its weight),
        ``<key>__sum``, ``<key>__min`` or ``<key>__max`` (value 1) otherwise. Scalars
        always carry their ``__count``.
        """
        with self._lock:
            keys = sorted(
                k for k in self._values if key is None or k == key or k.startswith(key + "/")
            )
            result: dict[str, float] = {}
            for k in keys:
                result.update(self._reduce(k, reduce_group, mergeable))
            if reset:
                for k in keys:
                    self._values.pop(k, None)
                    self._kinds.pop(k, None)
                    self._masks.pop(k, None)
            return result

    def _reduce(self, key: str, group: Any, mergeable: bool = False) -> dict[str, float]:
        kind = self._kinds[key]
        records = self._values[key]
        if kind is ReduceType.SCALAR:
            total, count = _all_reduce_sum([math.fsum(records), float(len(records))], group)
            if count == 0:
                return {}
            return {key: total / count, f"{key}__count": count}
        if key in self._masks:  # a denominator: count of true elements
            (total,) = _all_reduce_sum([float(sum(int(m.sum()) for m in records))], group)
            return {key: total, f"{key}__sum": 1.0} if mergeable else {key: total}
        values = torch.cat([v[mask].flatten() for v, mask in records])
        total, count = _all_reduce_sum([float(values.sum()), float(values.numel())], group)
        vmin = _all_reduce_extreme(
            float(values.min()) if values.numel() else math.inf, group, "min"
        )
        vmax = _all_reduce_extreme(
            float(values.max()) if values.numel() else -math.inf, group, "max"
        )
        if count == 0:
            return {}
        parts = {
            ReduceType.AVG_MIN_MAX: (
                (f"{key}/avg", total / count, "count"),
                (f"{key}/min", vmin, "min"),
                (f"{key}/max", vmax, "max"),
            ),
            ReduceType.AVG: ((key, total / count, "count"),),
            ReduceType.SUM: ((key, total, "sum"),),
            ReduceType.MIN: ((key, vmin, "min"),),
            ReduceType.MAX: ((key, vmax, "max"),),
        }[kind]
        out = {name: value for name, value, _ in parts}
        if mergeable:
            for name, _, how in parts:
                out[f"{name}__{how}"] = count if how == "count" else 1.0
        return out


def _dist_ready(group: Any) -> bool:
    return (
        group is not None
        and torch.distributed.is_available()
        and torch.distributed.is_initialized()
    )


def _all_reduce_sum(values: list[float], group: Any) -> list[float]:
    if not _dist_ready(group):
        return values
    t = torch.tensor(values, dtype=torch.float64)
    torch.distributed.all_reduce(t, group=group)
    return t.tolist()


def _all_reduce_extreme(value: float, group: Any, which: str) -> float:
    if not _dist_ready(group):
        return value
    t = torch.tensor([value], dtype=torch.float64)
    op = torch.distributed.ReduceOp.MIN if which == "min" else torch.distributed.ReduceOp.MAX
    torch.distributed.all_reduce(t, op=op, group=group)
    return float(t.item())


_trackers: dict[str, StatsTracker] = {}
_trackers_lock = threading.Lock()


def get(name: str = "") -> StatsTracker:
    """The tracker called ``name`` (created on first use)."""
    with _trackers_lock:
        if name not in _trackers:
            _trackers[name] = StatsTracker(name)
        return _trackers[name]


def export_all(
    reduce_group: Any = None, reset: bool = True, mergeable: bool = False
) -> dict[str, float]:
    """Export every tracker into one dict (named trackers' keys carry their names)."""
    with _trackers_lock:
        trackers = list(_trackers.values())
    result: dict[str, float] = {}
    for tracker in trackers:
        result.update(tracker.export(reduce_group=reduce_group, reset=reset, mergeable=mergeable))
    return result


_MERGE_TAGS = ("__count", "__sum", "__min", "__max")


def merge_exports(exports: list[dict[str, float]]) -> dict[str, float]:
    """Combine ``export(mergeable=True)`` results of several processes into one.

    A key with a ``__count`` is the count-weighted mean over the exports, one tagged
    ``__sum`` their sum, ``__min`` / ``__max`` their extreme. Untagged keys are dropped
    (nothing says how to combine them); the tags themselves are not returned.
    """
    totals: dict[str, float] = {}
    weights: dict[str, float] = {}
    for stats in exports:
        for key, value in stats.items():
            if key.endswith(_MERGE_TAGS):
                continue
            if f"{key}__count" in stats:
                weight = stats[f"{key}__count"]
                totals[key] = totals.get(key, 0.0) + value * weight
                weights[key] = weights.get(key, 0.0) + weight
            elif f"{key}__sum" in stats:
                totals[key] = totals.get(key, 0.0) + value
            elif f"{key}__min" in stats:
                totals[key] = min(totals.get(key, math.inf), value)
            elif f"{key}__max" in stats:
                totals[key] = max(totals.get(key, -math.inf), value)
    out = {}
    for key, total in totals.items():
        if key in weights:
            if weights[key] > 0:
                out[key] = total / weights[key]
        else:
            out[key] = total
    return out


def scope(name: str) -> _Scope:
    return get().scope(name)


def denominator(**masks: torch.Tensor) -> None:
    get().denominator(**masks)


def stat(denominator: str, reduce_type: ReduceType = ReduceType.AVG_MIN_MAX, **values: Any) -> None:
    get().stat(denominator, reduce_type, **values)


def scalar(**values: float) -> None:
    get().scalar(**values)


def record_timing(key: str):
    return get().record_timing(key)


def export(
    key: str | None = None, reduce_group: Any = None, reset: bool = True, mergeable: bool = False
) -> dict[str, float]:
    return get().export(key=key, reduce_group=reduce_group, reset=reset, mergeable=mergeable)
