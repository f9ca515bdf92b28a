"""Fault injection for the local Arena: the transient failures a real deployment shows.

Settings come from the catalog's ``faults:`` section, then CLI flags, and can be changed
while the server runs (``PUT /openapi/v1/local/faults``):

``error_rates``
    per-request probabilities in [0, 1] (adding up to at most 1), applied to every
    ``/openapi/v1`` call before it is handled (so a rejected request has no effect):
    ``"429"`` (rate limited), ``"500"``, ``"403_marker"`` (403 whose body carries the
    gateway's transient-rejection marker) and ``"302_fromspanner"`` (a redirect to the
    gateway's waiting page).
``latency_ms``
    added to every ``/openapi/v1`` and gateway call, in [0, 60000] milliseconds. The
    fault settings endpoints (``/openapi/v1/local/...``) are never delayed, so a latency
    can always be taken back, and a stopping server cuts every injected delay short.
``env_latency_ms``
    the time every built-in harness spends in its environment after each LLM call (as a
    tool run or a sandbox step would), in [0, 60000] milliseconds: with the multi-turn
    harness (``kind: multi_turn``) it makes an agent workload whose rollouts are
    dominated by environment time, not generation. Read when a task starts.
``force_status``
    ``{data_id or stream_id: STATUS}``: tasks for that row or Stream end with the status
    (for example ``HARNESS_FAILED``, ``TIMEOUT``) without running the harness.
``fail_after_harness``
    ``{data_id or stream_id: STATUS}``: the harness runs (its LLM calls happen), then the
    task ends with the status. ``HARNESS_FAILED:<format>`` picks the result format of the
    failure, one per result family a training client can attribute to the model
    (``claude``, ``claude_empty``, ``gameagent``, ``native``, ``runner``) or
    ``unattributed`` (see :mod:`examples.swe.local_arena.harnesses.results`); plain
    ``HARNESS_FAILED`` is ``claude``: Claude Code's agent-phase log with the reason
    "Prompt is too long", as a real harness crash after some turns.
``route_ttl_seconds``
    registered LLM routes neither registered nor renewed (``PATCH``) within this many
    seconds (in (0, 86400]) are garbage-collected, as real Arena does with idle routes.
``seed``
    seeds the error draws, for reproducible runs (an integer in [0, 2**63)).

``force_status`` and ``fail_after_harness`` hold at most 10000 entries each. Every bound is
checked when the settings are loaded (catalog, flags or ``PUT``); a :class:`FaultError`
names the field and the allowed range.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field, fields
from typing import Any

from examples.swe.arena_results import FAILED_TASK_STATUSES, SUCCESS_TASK_STATUSES
from examples.swe.local_arena.harnesses.results import FAILURE_FORMATS

__all__ = [
    "ERROR_KINDS",
    "MAX_LATENCY_MS",
    "MAX_ROUTE_TTL_S",
    "MAX_TARGETS",
    "SPANNER_MARKER",
    "FaultConfig",
    "FaultError",
]

SPANNER_MARKER = "spanner-http-ant-group-watch-all"
WAITING_PAGE = "https://gateway.local-arena.invalid/waiting?fromspanner=apigwmoe_502"
ERROR_KINDS = ("429", "500", "403_marker", "302_fromspanner")
TERMINAL_STATUSES = SUCCESS_TASK_STATUSES | FAILED_TASK_STATUSES
MAX_LATENCY_MS = 60_000.0  # a minute per call is slow enough for any test
MAX_ROUTE_TTL_S = 86_400.0
MAX_TARGETS = 10_000  # entries of force_status / fail_after_harness
MAX_SEED = 2**63


class FaultError(ValueError):
    """Invalid fault settings; the message names the field."""


@dataclass
class FaultConfig:
    error_rates: dict[str, float] = field(default_factory=dict)
    latency_ms: float = 0.0
    env_latency_ms: float = 0.0
    force_status: dict[str, str] = field(default_factory=dict)
    fail_after_harness: dict[str, str] = field(default_factory=dict)
    route_ttl_seconds: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @classmethod
    def from_mapping(cls, raw: dict[str, Any] | None, where: str = "faults") -> FaultConfig:
        raw = dict(raw or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise FaultError(f"{where}: unknown keys {unknown}; known keys: {sorted(known)}")
        rates = raw.get("error_rates") or {}
        if not isinstance(rates, dict):
            raise FaultError(f"{where}.error_rates must be a mapping like {{'429': 0.1}}")
        checked: dict[str, float] = {}
        for kind, rate in rates.items():
            kind = str(kind)
            if kind not in ERROR_KINDS:
                raise FaultError(f"{where}.error_rates.{kind}: not one of {list(ERROR_KINDS)}")
            if not _number_in(rate, 0.0, 1.0):
                raise FaultError(
                    f"{where}.error_rates.{kind}: must be a number in [0, 1], got {_shown(rate)}"
                )
            checked[kind] = float(rate)
        if sum(checked.values()) > 1:
            raise FaultError(f"{where}.error_rates: the rates add up to more than 1")
        forced = _statuses(raw, "force_status", where)
        after = _statuses(raw, "fail_after_harness", where, formats=True)
        latency = _milliseconds(raw, "latency_ms", where)
        env_latency = _milliseconds(raw, "env_latency_ms", where)
        ttl = raw.get("route_ttl_seconds")
        if ttl is not None and not (_number_in(ttl, 0.0, MAX_ROUTE_TTL_S) and ttl > 0):
            raise FaultError(
                f"{where}.route_ttl_seconds must be a number of seconds in "
                f"(0, {MAX_ROUTE_TTL_S:g}] or null, got {_shown(ttl)}"
            )
        seed = raw.get("seed")
        if seed is not None and (
            isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < MAX_SEED
        ):
            raise FaultError(
                f"{where}.seed must be an integer in [0, 2**63) or null, got {_shown(seed)}"
            )
        return cls(checked, latency, env_latency, forced, after, ttl, seed)

    def to_json(self) -> dict[str, Any]:
        return {
            "error_rates": dict(self.error_rates),
            "latency_ms": self.latency_ms,
            "env_latency_ms": self.env_latency_ms,
            "force_status": dict(self.force_status),
            "fail_after_harness": dict(self.fail_after_harness),
            "route_ttl_seconds": self.route_ttl_seconds,
            "seed": self.seed,
        }

    def draw_error(self) -> str | None:
        """The injected error for this request, if any (one draw per request)."""
        if not self.error_rates:
            return None
        x = self._rng.random()
        for kind in ERROR_KINDS:
            rate = self.error_rates.get(kind, 0.0)
            if x < rate:
                return kind
            x -= rate
        return None

    def forced_status(self, stream_id: str, data_id: str) -> str | None:
        return self.force_status.get(data_id) or self.force_status.get(stream_id)

    def status_after_harness(self, stream_id: str, data_id: str) -> str | None:
        return self.fail_after_harness.get(data_id) or self.fail_after_harness.get(stream_id)


def _shown(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _number_in(value: Any, low: float, high: float) -> bool:
    """Whether ``value`` is a finite real number (not a bool) in ``[low, high]``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    try:
        number = float(value)
    except OverflowError:  # an int beyond any float
        return False
    return math.isfinite(number) and low <= number <= high


def _statuses(
    raw: dict[str, Any], key: str, where: str, *, formats: bool = False
) -> dict[str, str]:
    """``{target: STATUS}`` of a status-forcing setting, each a terminal status; with
    ``formats``, ``HARNESS_FAILED:<format>`` names a failure result format too."""
    entries = raw.get(key) or {}
    if not isinstance(entries, dict):
        raise FaultError(f"{where}.{key} must be a mapping of data_id or stream_id to a status")
    if len(entries) > MAX_TARGETS:
        raise FaultError(
            f"{where}.{key} has {len(entries)} entries; at most {MAX_TARGETS} are allowed"
        )
    out: dict[str, str] = {}
    for target, status in entries.items():
        name, colon, fmt = str(status).strip().partition(":")
        normalized = name.strip().upper()
        if colon:
            if not formats or normalized != "HARNESS_FAILED" or fmt not in FAILURE_FORMATS:
                allowed = ", ".join(f"HARNESS_FAILED:{f}" for f in FAILURE_FORMATS)
                raise FaultError(
                    f"{where}.{key}.{target}: {status!r} is not a failure result format"
                    + (f" (allowed: {allowed})" if formats else "")
                )
            out[str(target)] = f"{normalized}:{fmt}"
            continue
        if normalized not in TERMINAL_STATUSES:
            raise FaultError(
                f"{where}.{key}.{target}: {status!r} is not a terminal task status "
                f"({', '.join(sorted(TERMINAL_STATUSES))})"
            )
        out[str(target)] = normalized
    return out


def _milliseconds(raw: dict[str, Any], key: str, where: str) -> float:
    """``raw[key]``: a delay in [0, MAX_LATENCY_MS] milliseconds (absent or null: 0)."""
    value = raw.get(key, 0.0)
    if value is None:
        value = 0.0
    if not _number_in(value, 0.0, MAX_LATENCY_MS):
        raise FaultError(
            f"{where}.{key} must be a number of milliseconds in "
            f"[0, {MAX_LATENCY_MS:g}], got {_shown(value)}"
        )
    return float(value)
