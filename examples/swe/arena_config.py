"""Stream configuration: parsing and validating Streams, and the weighted row mixture.

Streams come from exactly one of three sources in ``econfig``: an inline list
(``arena_streams``), a base64 YAML document (``arena_streams_yaml_b64``) or a YAML/JSON
file (``arena_streams_file``). With none set, the legacy single-Stream fields
(``stream_id`` and friends, usually from ``ARENA_STREAM_ID``) describe one Stream.
"""

from __future__ import annotations

import base64
import binascii
import heapq
import math
import re
from collections.abc import Mapping, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any

import yaml

from areal.utils import logging
from examples.swe.arena_types import ArenaRewardRefConfig, ArenaStreamConfig

__all__ = [
    "LLM_PROTOCOLS",
    "build_weighted_arena_rows",
    "load_arena_stream_configs",
    "parse_arena_stream_config",
]

logger = logging.getLogger("arena.config")

LLM_PROTOCOLS = ("anthropic", "responses", "chat_completions")
_STREAM_FIELDS = (
    "name",
    "stream_id",
    "sampling_weight",
    "harness",
    "llm_protocol",
    "task_envs",
    "expected_reward_ref",
    "reward_threshold",
    "reward_transform_fn",
)
# Names end up in metric keys and file names: one path part, never "." or "..".
_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


# --- one Stream entry ---


def _text(value: Any) -> str:
    """The trimmed string form of a value; falsy values (None, "") give ""."""
    return str(value).strip() if value else ""


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _string_map(value: Any, what: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and k and isinstance(v, str) for k, v in value.items()
    ):
        raise ValueError(f"{what} must map non-empty strings to strings")
    return dict(value)


def _reward_ref(value: Any) -> ArenaRewardRefConfig:
    if value is None or value == "":
        ref = ArenaRewardRefConfig()
    elif isinstance(value, ArenaRewardRefConfig):
        ref = ArenaRewardRefConfig(key=_text(value.key), version=_text(value.version))
    elif isinstance(value, Mapping):
        unknown = sorted(set(map(str, value)) - {"key", "version"})
        if unknown:
            raise ValueError(f"expected_reward_ref has unknown fields: {', '.join(unknown)}")
        ref = ArenaRewardRefConfig(key=_text(value.get("key")), version=_text(value.get("version")))
    else:
        raise ValueError("expected_reward_ref must be an object with key and version")
    if bool(ref.key) != bool(ref.version):
        raise ValueError("expected_reward_ref requires both key and version (or neither)")
    return ref


def parse_arena_stream_config(value: ArenaStreamConfig | Mapping[str, Any]) -> ArenaStreamConfig:
    """Validate one Stream entry and return a new, normalized :class:`ArenaStreamConfig`."""
    if isinstance(value, ArenaStreamConfig):
        value = {name: getattr(value, name) for name in _STREAM_FIELDS}
    if not isinstance(value, Mapping):
        raise ValueError(f"an Arena Stream entry must be an object, got {type(value).__name__}")
    unknown = sorted(str(k) for k in value if k not in _STREAM_FIELDS)
    if unknown:
        raise ValueError(f"Arena Stream entry has unknown fields: {', '.join(unknown)}")

    name = _text(value.get("name"))
    if not name or not _NAME_RE.fullmatch(name) or ".." in name or len(name) > 128:
        raise ValueError(
            f"Arena Stream name {name!r} may only contain letters, digits, '.', '_' and '-', "
            "must start with a letter, a digit or '_', must not contain '..' and has at most "
            "128 characters (it is used in metric keys and file names)"
        )
    stream_id = _text(value.get("stream_id"))
    if not stream_id:
        raise ValueError(f"Arena Stream {name!r} needs a non-empty stream_id")

    weight = value.get("sampling_weight", 1.0)
    if not _is_number(weight):
        raise ValueError(f"Arena Stream {name!r}: sampling_weight must be numeric, got {weight!r}")
    weight = float(weight)
    if not (math.isfinite(weight) and weight > 0):
        raise ValueError(f"Arena Stream {name!r}: sampling_weight must be finite and positive")

    protocol = _text(value.get("llm_protocol"))
    if protocol and protocol not in LLM_PROTOCOLS:
        raise ValueError(
            f"Arena Stream {name!r}: llm_protocol must be empty or one of "
            f"{', '.join(LLM_PROTOCOLS)}, got {protocol!r}"
        )
    task_envs = _string_map(value.get("task_envs"), f"Arena Stream {name!r}: task_envs")

    threshold = value.get("reward_threshold")
    if threshold is not None:
        if not _is_number(threshold):
            raise ValueError(f"Arena Stream {name!r}: reward_threshold must be numeric or null")
        threshold = float(threshold)
        if not math.isfinite(threshold):
            raise ValueError(f"Arena Stream {name!r}: reward_threshold must be finite")

    try:
        ref = _reward_ref(value.get("expected_reward_ref"))
    except ValueError as e:
        raise ValueError(f"Arena Stream {name!r}: {e}") from None

    return ArenaStreamConfig(
        name=name,
        stream_id=stream_id,
        sampling_weight=weight,
        harness=_text(value.get("harness")),
        llm_protocol=protocol,
        task_envs=task_envs,
        expected_reward_ref=ref,
        reward_threshold=threshold,
        reward_transform_fn=_text(value.get("reward_transform_fn")),
    )


# --- the three sources ---


def _get(econfig: Any, key: str, default: Any) -> Any:
    if isinstance(econfig, Mapping):
        value = econfig.get(key, default)
    else:
        value = getattr(econfig, key, default)
    return default if value is None and default is not None else value


def _is_set(value: Any) -> bool:
    if isinstance(value, str):
        return bool(value.strip())
    return bool(value)


def _stream_list(document: Any, source: str) -> list[Any]:
    if isinstance(document, Mapping):
        unknown = sorted(str(k) for k in document if k != "streams")
        if unknown:
            raise ValueError(
                f"{source} has unknown top-level fields: {', '.join(unknown)} (only 'streams')"
            )
        document = document.get("streams")
    if not isinstance(document, list) or not document:
        raise ValueError(f"{source} must contain a non-empty 'streams' list")
    return document


def _load_yaml(text: str, source: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ValueError(f"{source} is not valid YAML: {e}") from None


def _decode_b64(payload: str) -> str:
    try:
        return base64.b64decode(payload.strip(), validate=True).decode("utf-8")
    except (binascii.Error, ValueError):
        # The payload itself is never echoed: it may carry task env secrets.
        raise ValueError("econfig.arena_streams_yaml_b64 is not valid base64 UTF-8") from None


def _read_streams_file(path_text: str) -> str:
    path = Path(path_text.strip()).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"econfig.arena_streams_file {str(path)!r} is not a file")
    return path.read_text(encoding="utf-8")


def load_arena_stream_configs(econfig: Any) -> list[ArenaStreamConfig]:
    """The validated Streams of an ``econfig`` (a mapping or an attribute object)."""
    inline = _get(econfig, "arena_streams", [])
    encoded = _get(econfig, "arena_streams_yaml_b64", "")
    file_path = _get(econfig, "arena_streams_file", "")
    common_envs = _string_map(_get(econfig, "arena_task_envs", {}), "arena_task_envs")
    common_harness = _text(_get(econfig, "arena_harness", ""))

    chosen = [
        name
        for name, v in (
            ("arena_streams", inline),
            ("arena_streams_yaml_b64", encoded),
            ("arena_streams_file", file_path),
        )
        if _is_set(v)
    ]
    if len(chosen) > 1:
        raise ValueError(
            "econfig.arena_streams, arena_streams_yaml_b64 and arena_streams_file are mutually "
            f"exclusive; set only one (got {', '.join(chosen)})"
        )
    if not chosen:
        return [_legacy_stream(econfig, common_envs, common_harness)]

    source = chosen[0]
    if source == "arena_streams_yaml_b64":
        label = "the encoded Streams YAML (arena_streams_yaml_b64)"
        entries = _stream_list(_load_yaml(_decode_b64(encoded), label), label)
    elif source == "arena_streams_file":
        label = f"Streams file {file_path.strip()!r}"
        entries = _stream_list(_load_yaml(_read_streams_file(file_path), label), label)
    else:
        label = "econfig.arena_streams"
        entries = list(inline)

    streams = []
    for index, entry in enumerate(entries):
        try:
            stream = parse_arena_stream_config(entry)
        except ValueError as e:
            raise ValueError(f"{label}, entry {index}: {e}") from None
        stream.harness = stream.harness or common_harness
        stream.task_envs = {**common_envs, **stream.task_envs}
        streams.append(stream)
    _check_unique(streams)
    _warn_ignored_legacy_fields(econfig)
    return streams


def _check_unique(streams: Sequence[ArenaStreamConfig]) -> None:
    names = [s.name for s in streams]
    if len(set(names)) != len(names):
        raise ValueError(f"Arena Stream names must be unique: {names}")
    ids = [s.stream_id for s in streams]
    if len(set(ids)) != len(ids):
        raise ValueError(f"Arena Stream ids must be unique: {ids}")


def _warn_ignored_legacy_fields(econfig: Any) -> None:
    ignored = [
        key
        for key in ("stream_id", "arena_llm_protocol", "arena_reward_transform_fn")
        if _is_set(_get(econfig, key, ""))
    ]
    if _get(econfig, "arena_reward_threshold", None) is not None:
        ignored.append("arena_reward_threshold")
    if ignored:
        logger.warning(
            "econfig.%s ignored: a Stream list is configured; set these per Stream instead",
            ", econfig.".join(ignored),
        )


def _legacy_stream(
    econfig: Any, common_envs: dict[str, str], common_harness: str
) -> ArenaStreamConfig:
    threshold = _get(econfig, "arena_reward_threshold", None)
    if threshold is not None:
        try:
            threshold = float(threshold)
        except (TypeError, ValueError):
            raise ValueError("econfig.arena_reward_threshold must be numeric or null") from None
        if not math.isfinite(threshold):
            raise ValueError("econfig.arena_reward_threshold must be finite")
    return ArenaStreamConfig(
        name="default",
        stream_id=_text(_get(econfig, "stream_id", "")),
        sampling_weight=1.0,
        harness=common_harness,
        llm_protocol=_text(_get(econfig, "arena_llm_protocol", "")),
        task_envs=dict(common_envs),
        expected_reward_ref=ArenaRewardRefConfig(),
        reward_threshold=threshold,
        reward_transform_fn=_text(_get(econfig, "arena_reward_transform_fn", "")),
    )


# --- the weighted mixture ---


def build_weighted_arena_rows(
    rows_by_stream: Mapping[str, Sequence[Mapping[str, Any]]],
    streams: Sequence[ArenaStreamConfig],
    epoch_size: int = 0,
    size_multiple: int = 1,
) -> list[dict[str, Any]]:
    """One epoch of rows drawn from several Streams by weight, deterministically.

    ``epoch_size == 0`` uses every row of every Stream once (weights only shape the
    order). A positive ``epoch_size`` takes a weighted subset without replacement: each
    Stream gets a share proportional to ``rows x weight``, capped at its row count, and
    contributes the first rows in Arena order. Rows are interleaved by a weighted
    round-robin so that any window of the epoch follows the weights. Nothing is ever
    padded or repeated; ``size_multiple`` (the batch size) must divide ``epoch_size``.
    """
    if isinstance(epoch_size, bool) or not isinstance(epoch_size, int) or epoch_size < 0:
        raise ValueError(f"arena_mixture_epoch_size must be non-negative, got {epoch_size!r}")
    if isinstance(size_multiple, bool) or not isinstance(size_multiple, int) or size_multiple < 1:
        raise ValueError(f"size_multiple must be an int >= 1, got {size_multiple!r}")
    if not streams:
        raise ValueError("at least one Arena Stream is required")
    capacity = {}
    for s in streams:
        rows = rows_by_stream.get(s.name, ())
        if not rows:
            raise ValueError(f"Arena Stream {s.name!r} ({s.stream_id}) contains no dataset rows")
        capacity[s.name] = len(rows)
    mass = {s.name: capacity[s.name] * s.sampling_weight for s in streams}
    # A plain sum: math.fsum raises OverflowError where finite masses add up past float max.
    total_mass = sum(mass.values())
    if not all(math.isfinite(m) and m > 0 for m in mass.values()) or not (
        math.isfinite(total_mass) and total_mass > 0
    ):
        raise ValueError("Arena Stream weights overflowed the mixture mass; use smaller weights")

    total_rows = sum(capacity.values())
    size = epoch_size or total_rows
    if epoch_size:
        if epoch_size > total_rows:
            raise ValueError(
                f"arena_mixture_epoch_size={epoch_size} cannot exceed the {total_rows} unique "
                "source rows"
            )
        if epoch_size % size_multiple:
            raise ValueError(
                f"arena_mixture_epoch_size={epoch_size} must be divisible by the training "
                f"batch size {size_multiple}"
            )
    counts = capacity if size == total_rows else _water_fill(size, capacity, mass, streams)

    # Weighted round-robin: the next row comes from the Stream minimizing
    # (emitted + 1) / weight, ties to the ascending name. Exact fractions keep the order
    # identical when all weights are scaled by a common factor.
    weights = {s.name: Fraction(s.sampling_weight) for s in streams}
    heap = [(1 / weights[n], n) for n in sorted(counts) if counts[n] > 0]
    heapq.heapify(heap)
    emitted = dict.fromkeys(counts, 0)
    result: list[dict[str, Any]] = []
    while heap:
        _, name = heapq.heappop(heap)
        result.append(dict(rows_by_stream[name][emitted[name]]))
        emitted[name] += 1
        if emitted[name] < counts[name]:
            heapq.heappush(heap, ((emitted[name] + 1) / weights[name], name))
    return result


def _water_fill(
    size: int,
    capacity: Mapping[str, int],
    mass: Mapping[str, float],
    streams: Sequence[ArenaStreamConfig],
) -> dict[str, int]:
    """Capped proportional allocation of ``size`` rows (exact rational arithmetic)."""
    exact_mass = {name: Fraction(m) for name, m in mass.items()}
    counts: dict[str, int] = {}
    active = [s.name for s in streams]
    remaining = size
    shares: dict[str, Fraction] = {}
    while active:
        active_mass = sum(exact_mass[n] for n in active)
        shares = {n: remaining * exact_mass[n] / active_mass for n in active}
        capped = [n for n in active if shares[n] >= capacity[n]]
        if not capped:
            break
        for n in capped:
            counts[n] = capacity[n]
            remaining -= capacity[n]
        active = [n for n in active if n not in capped]
    for n in active:
        counts[n] = math.floor(shares[n])
    leftover = size - sum(counts.values())
    by_fraction = sorted(active, key=lambda n: (-(shares[n] - math.floor(shares[n])), n))
    for n in by_fraction[:leftover]:
        counts[n] += 1
    return counts
