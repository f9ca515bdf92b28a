"""Train a policy with GRPO on Arena Streams (``econfig.dataset_source: arena``).

    python -m examples.swe.train_swe_rl --config examples/swe/arena_multi_stream.yaml [k=v ...]

One dataset row is one prompt, and the trainer expands it into a group of
``gconfig.n_samples`` rollouts. So every group runs on a single Stream, with one Harness and
one grader. The group-relative advantage then compares attempts at the same task, scored
the same way. The Stream mixture is built here, once, by a deterministic weighted
round-robin without replacement. A run's data order is reproducible, and any window of the
epoch follows the configured weights.

The controller resolves each Stream against the live Arena before any worker starts: it
pins the grader the Stream has now (failing on drift from a pinned ``expected_reward_ref``)
and settles the Harness protocol. Workers get the resolved Stream list inline, so they need
neither the streams file nor the base64 payload, and each rollout checks the pin again.

Evaluation is opt-in: with validation rows (every row of the held-out
``econfig.arena_eval_streams``, or else the training mixture's) and an ``evaluator``
frequency (or
``evaluator.eval_before_train``), the same workflow decodes every valid row greedily
(temperature 0) on that schedule, logged under ``eval-rollout/``. Otherwise no eval workers
or proxies start.

With ``econfig.arena_base_url: local``, a local Arena (``examples/swe/local_arena``) runs
inside this process for the whole run. Its URL and a fresh token reach the workers through
the environment, never through argv or a saved config.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset

from areal.api.cli_args import conf_as_dict, load_expr_config
from areal.api.config.support import refuse_unsupported
from areal.infra.workflow_paths import workflow_kind
from areal.trainer.rl_trainer import PPOTrainer
from areal.utils import logging
from examples.swe.arena_client import (
    ArenaAPIError,
    ArenaOpenAPIClient,
    infer_llm_protocol_from_harness,
    resolve_llm_protocol,
)
from examples.swe.arena_config import build_weighted_arena_rows, load_arena_stream_configs
from examples.swe.arena_types import ArenaRewardRefConfig, ArenaStreamConfig
from examples.swe.utils import SWEPPOConfig

__all__ = [
    "ARENA_WORKFLOW",
    "TrainingInputs",
    "arena_client",
    "as_dataset",
    "build_training_inputs",
    "build_workflow_kwargs",
    "evaluation_scheduled",
    "get_arena_dataset",
    "get_arena_eval_dataset",
    "get_arena_mixture_dataset",
    "get_stream_rows",
    "get_swe_dataset",
    "group_filter",
    "local_arena_if_requested",
    "main",
    "pin_streams_for_workers",
    "resolve_arena_stream",
]

logger = logging.getLogger("train_swe_rl")

ARENA_WORKFLOW = "examples.swe.arena_agent.ArenaStreamAgentWorkflow"
# Environment the local Arena hands to this process and every worker started after it.
LOCAL_ARENA_ENV = ("ARENA_OPENAPI_BASE", "ARENA_OPENAPI_TOKEN", "ARENA_LLM_API_KEY")
# Legacy single-Stream fields; the resolved Stream list carries their meaning to workers.
LEGACY_STREAM_FIELDS = {
    "stream_id": "",
    "arena_llm_protocol": "",
    "arena_reward_threshold": None,
    "arena_reward_transform_fn": "",
}


def _setting(econfig: Any, key: str, default: Any) -> Any:
    """``econfig[key]`` or ``econfig.key``; ``default`` only when the key is absent."""
    if isinstance(econfig, Mapping):
        return econfig.get(key, default)
    return getattr(econfig, key, default)


# --- Arena datasets ---


def _live_reward_ref(stream: Mapping[str, Any], stream_id: str) -> ArenaRewardRefConfig:
    ref = stream.get("default_reward_ref")
    if ref is None:
        return ArenaRewardRefConfig()
    if not isinstance(ref, Mapping):
        raise ArenaAPIError(f"Arena Stream {stream_id!r} default_reward_ref must be an object")
    key, version = ref.get("key"), ref.get("version")
    if not (isinstance(key, str) and key and isinstance(version, str) and version):
        raise ArenaAPIError(
            f"Arena Stream {stream_id!r} default_reward_ref needs non-empty key and version, "
            f"got {dict(ref)!r}"
        )
    return ArenaRewardRefConfig(key=key, version=version)


def _stream_protocol(configured: ArenaStreamConfig, stream: Mapping[str, Any]) -> str:
    """The configured protocol, else the one of the configured Harness, else of the default."""
    if configured.llm_protocol:
        return resolve_llm_protocol(stream, configured.llm_protocol)
    if configured.harness:
        return infer_llm_protocol_from_harness(configured.harness)
    return resolve_llm_protocol(stream)


def resolve_arena_stream(
    client: ArenaOpenAPIClient, configured: ArenaStreamConfig
) -> tuple[ArenaStreamConfig, dict[str, Any]]:
    """The configured Stream pinned to what Arena serves now, and the live Stream object.

    An empty ``stream_id`` takes the first ACTIVE Stream. The result carries the resolved
    id, the resolved protocol and the *actual* grader as ``expected_reward_ref``, so an
    unpinned Stream is pinned to the grader that was live when the run started.
    """
    live = client.resolve_stream(configured.stream_id)
    stream_id = live.get("stream_id")
    if not isinstance(stream_id, str) or not stream_id:
        raise ArenaAPIError(f"Arena Stream {configured.name!r} resolved without a stream_id")
    actual = _live_reward_ref(live, stream_id)
    pinned = configured.expected_reward_ref
    if pinned.key and (pinned.key, pinned.version) != (actual.key, actual.version):
        raise ArenaAPIError(
            f"Arena Stream {configured.name!r} ({stream_id}) reward_ref drifted: expected "
            f"{pinned.key}@{pinned.version}, got {actual.key or '<none>'}@{actual.version}"
        )
    resolved = dataclasses.replace(
        configured,
        stream_id=stream_id,
        llm_protocol=_stream_protocol(configured, live),
        expected_reward_ref=actual,
    )
    return resolved, live


def get_stream_rows(client: ArenaOpenAPIClient, stream: ArenaStreamConfig) -> list[dict[str, Any]]:
    """Every dataset row of a resolved Stream, in Arena's order, with its Stream columns."""
    ref = stream.expected_reward_ref
    return [
        {
            **row,
            "arena_stream_name": stream.name,
            "reward_ref_key": ref.key,
            "reward_ref_version": ref.version,
        }
        for row in client.get_all_dataset_rows(
            stream_id=stream.stream_id, llm_protocol=stream.llm_protocol
        )
    ]


def as_dataset(rows: Sequence[Mapping[str, Any]]) -> Dataset:
    """A ``datasets.Dataset`` of ``rows`` with every key of every row as a column.

    ``Dataset.from_list`` takes its columns from the first row only; rows are first
    normalized to the union of all keys (in first-seen order, missing ones as ``None``), so
    a field absent from the first row survives.
    """
    keys = list(dict.fromkeys(key for row in rows for key in row))
    return Dataset.from_list([{key: row.get(key) for key in keys} for row in rows])


def arena_client(econfig: Any) -> ArenaOpenAPIClient:
    """The Arena client of a run (base URL, timeout and retries from ``econfig``)."""
    return ArenaOpenAPIClient(
        base_url=_setting(econfig, "arena_base_url", "") or "",
        timeout=float(_setting(econfig, "arena_request_timeout", 60.0)),
        request_retries=int(_setting(econfig, "arena_request_retries", 3)),
    )


def get_arena_mixture_dataset(
    econfig: Any, *, size_multiple: int = 1, client: ArenaOpenAPIClient | None = None
) -> tuple[Dataset, list[ArenaStreamConfig]]:
    """One epoch of rows mixed from every configured Stream, and the resolved Streams.

    ``econfig`` is the ``econfig`` block (dataclass or mapping). ``size_multiple`` is the
    training batch size: a positive ``arena_mixture_epoch_size`` must be divisible by it,
    and the full union (epoch size 0) is never padded to it. ``client`` replaces the
    client built from ``econfig`` (tests pass one over a mock transport). The rows are a
    ``datasets.Dataset`` (the trainer's dataloader indexes it) with the columns
    ``data_id``, ``stream_id``, ``llm_protocol``, ``arena_task_type``,
    ``arena_stream_name``, ``reward_ref_key`` and ``reward_ref_version``.
    """
    owned = client is None
    client = client or arena_client(econfig)
    try:
        configured = load_arena_stream_configs(econfig)
        resolved: list[ArenaStreamConfig] = []
        rows_by_stream: dict[str, list[dict[str, Any]]] = {}
        for stream in configured:
            pinned, _ = resolve_arena_stream(client, stream)
            rows_by_stream[pinned.name] = get_stream_rows(client, pinned)
            resolved.append(pinned)
    finally:
        if owned:
            client.close()

    epoch_size = int(_setting(econfig, "arena_mixture_epoch_size", 0))
    rows = build_weighted_arena_rows(rows_by_stream, resolved, epoch_size, size_multiple)
    counts = Counter(row["arena_stream_name"] for row in rows)
    logger.info(
        "Arena mixture: %d rows from %d Stream(s): %s",
        len(rows),
        len(resolved),
        ", ".join(
            f"{s.name} ({s.stream_id}, {s.llm_protocol}) {counts[s.name]}/"
            f"{len(rows_by_stream[s.name])}"
            for s in resolved
        ),
    )
    remainder = len(rows) % size_multiple
    if size_multiple > 1 and remainder:
        logger.warning(
            "Arena mixture of %d rows is not a multiple of the batch size %d: the last %d rows "
            "form a partial batch (dropped with train_dataset.drop_last; nothing is repeated)",
            len(rows),
            size_multiple,
            remainder,
        )
    return as_dataset(rows), resolved


def get_arena_eval_dataset(
    econfig: Any,
    training: list[ArenaStreamConfig],
    *,
    client: ArenaOpenAPIClient | None = None,
) -> tuple[Dataset, list[ArenaStreamConfig]]:
    """Every row of the held-out ``econfig.arena_eval_streams`` once, and those Streams.

    They must be other Streams than the ``training`` ones (names and ids), so no
    evaluated task is also trained on.
    """
    held_out = {
        "arena_streams": list(econfig.arena_eval_streams),
        "arena_streams_yaml_b64": "",
        "arena_streams_file": "",
        "arena_mixture_epoch_size": 0,
        "arena_task_envs": dict(_setting(econfig, "arena_task_envs", {}) or {}),
        "arena_harness": _setting(econfig, "arena_harness", ""),
        **{
            key: _setting(econfig, key, None)
            for key in ("arena_base_url", "arena_request_timeout", "arena_request_retries")
        },
    }
    configured = load_arena_stream_configs(held_out)
    for stream in configured:
        clash = [t for t in training if stream.name == t.name or stream.stream_id == t.stream_id]
        if clash:
            raise ValueError(
                f"econfig.arena_eval_streams: {stream.name!r} ({stream.stream_id}) is also a "
                f"training Stream ({clash[0].name!r}, {clash[0].stream_id}); a held-out Stream "
                "must be another Stream with another name"
            )
    return get_arena_mixture_dataset(held_out, client=client)


def get_arena_dataset(
    econfig: Any, *, client: ArenaOpenAPIClient | None = None
) -> tuple[Dataset, str]:
    """Legacy single-Stream form: ``(dataset, stream_id)``; an error unless one Stream is set."""
    dataset, streams = get_arena_mixture_dataset(econfig, client=client)
    if len(streams) != 1:
        raise ValueError(
            f"get_arena_dataset serves exactly one Arena Stream, got {len(streams)} "
            f"({', '.join(s.name for s in streams)}); use get_arena_mixture_dataset"
        )
    return dataset, streams[0].stream_id


# --- JSONL datasets (a loader only: training on them needs an SWE agent this port lacks) ---

REQUIRED_SWE_KEYS = ("instance_id", "problem_statement")


def get_swe_dataset(path: str, split: str = "train", min_items: int = 64) -> Dataset:
    """A JSONL SWE dataset as a ``datasets.Dataset``, repeated up to ``min_items`` records.

    Blank lines are skipped; so are records without ``instance_id`` or
    ``problem_statement``, with a warning. Every record gets the union of all keys (the
    missing ones as ``None``), so fields present in only some records survive batching.
    ``split`` names the dataset in messages.
    """
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"SWE {split} dataset {path!r} does not exist")
    records: list[dict[str, Any]] = []
    with file.open(encoding="utf-8") as lines:
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict) or any(
                record.get(key) in (None, "") for key in REQUIRED_SWE_KEYS
            ):
                logger.warning(
                    "%s:%d: skipped a record without %s",
                    path,
                    lineno,
                    " or ".join(REQUIRED_SWE_KEYS),
                )
                continue
            records.append(record)
    if not records:
        raise ValueError(
            f"SWE {split} dataset {path!r} has no record with {' and '.join(REQUIRED_SWE_KEYS)}"
        )
    if len(records) < min_items:
        records = records * math.ceil(min_items / len(records))
    logger.info("SWE %s dataset %s: %d records", split, path, len(records))
    return as_dataset(records)


# --- the local Arena ---


@contextmanager
def local_arena_if_requested(config: SWEPPOConfig) -> Iterator[Any]:
    """Serve a local Arena for the duration of the block when ``arena_base_url == "local"``.

    State lives under ``{cluster.fileroot}/local_arena/{experiment}/{trial}``, so a rerun
    of the same trial reopens its routes and task results. Inside the block
    ``econfig.arena_base_url`` is the server's URL and ``ARENA_OPENAPI_BASE``,
    ``ARENA_OPENAPI_TOKEN`` and ``ARENA_LLM_API_KEY`` are exported for this process and
    the workers it starts; the gateway accepts the API token, so both keys are the token.
    Afterwards the previous values are restored. Yields the server handle, or ``None``
    when no local Arena was requested. ``$AREAL_LOCAL_ARENA_CATALOG`` names another
    catalog YAML (for example one with a ``faults:`` section); the default ships with the
    local Arena.
    """
    econfig = config.econfig
    if econfig.arena_base_url.strip() != "local":
        yield None
        return
    from examples.swe.local_arena.testing import running_local_arena

    directory = (
        Path(config.cluster.fileroot) / "local_arena" / config.experiment_name / config.trial_name
    )
    directory.mkdir(parents=True, exist_ok=True)
    previous = {name: os.environ.get(name) for name in LOCAL_ARENA_ENV}
    catalog = os.environ.get("AREAL_LOCAL_ARENA_CATALOG") or None
    slots = local_arena_task_slots(config)
    with running_local_arena(directory, catalog, max_concurrent_tasks=slots) as arena:
        logging.register_secret(arena.token)
        try:
            os.environ["ARENA_OPENAPI_BASE"] = arena.base_url
            os.environ["ARENA_OPENAPI_TOKEN"] = arena.token
            os.environ["ARENA_LLM_API_KEY"] = arena.token
            econfig.arena_base_url = arena.base_url
            logger.info("local Arena at %s (state in %s)", arena.base_url, directory)
            yield arena
        finally:
            econfig.arena_base_url = "local"
            for name, value in previous.items():
                if value is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = value


def local_arena_task_slots(config: SWEPPOConfig) -> int:
    """Tasks the local Arena runs at once: every task the rollout side may have in flight
    (the staleness bound and ``max_concurrent_rollouts`` count groups of ``n_samples``
    tasks), at least the server's default of 64, at most its limit of 1024. Fewer would
    queue tasks inside the Arena and undo the asynchronous pipeline."""
    rollout = getattr(config, "rollout", None)
    if rollout is None:  # a hand-built config without a rollout section
        return 64
    batch = max(1, rollout.consumer_batch_size)
    groups = rollout.max_concurrent_rollouts or batch
    if rollout.max_head_offpolicyness is not None:  # null: no staleness bound
        groups = min(groups, (rollout.max_head_offpolicyness + 1) * batch)
    return max(64, min(1024, groups * max(1, config.gconfig.n_samples)))


# --- entry point ---


def group_filter(x: Mapping[str, Any]) -> bool:
    """Keep a group unless it is (almost) solved: mean reward at most 0.95."""
    return bool(torch.as_tensor(x["rewards"], dtype=torch.float32).mean() <= 0.95)


def build_workflow_kwargs(config: SWEPPOConfig) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(workflow_kwargs, eval_workflow_kwargs)`` for the rollout workers.

    The ``econfig`` goes as a plain dict (nested Stream dataclasses included). Evaluation
    decodes greedily with the same completion budget.
    """
    gconfig = config.gconfig
    econfig = conf_as_dict(config.econfig)
    econfig["arena_streams_yaml_b64"] = ""  # a secret; workers read resolved Streams only
    workflow_kwargs = {
        "econfig": econfig,
        "gen_args": {
            "temperature": gconfig.temperature,
            "top_p": gconfig.top_p,
            "top_k": gconfig.top_k,
            "max_completion_tokens": gconfig.max_new_tokens,
        },
        "timeout": config.econfig.timeout,
    }
    eval_workflow_kwargs = {
        **workflow_kwargs,
        "gen_args": {"temperature": 0.0, "max_completion_tokens": gconfig.max_new_tokens},
    }
    return workflow_kwargs, eval_workflow_kwargs


def pin_streams_for_workers(econfig: Any, streams: list[ArenaStreamConfig]) -> None:
    """Make the resolved ``streams`` the workers' only Stream source (edits ``econfig``).

    The streams file and base64 payload are cleared, and so are the legacy single-Stream
    fields, whose meaning the resolved list now carries (left set, each worker would warn
    on every rollout that they are ignored).
    """
    econfig.arena_streams = list(streams)
    econfig.arena_streams_yaml_b64 = ""
    econfig.arena_streams_file = ""
    for name, empty in LEGACY_STREAM_FIELDS.items():
        setattr(econfig, name, empty)


@dataclass
class TrainingInputs:
    """Everything ``PPOTrainer`` needs besides the config."""

    train_dataset: Dataset
    valid_dataset: Dataset | None
    workflow: str
    workflow_kwargs: dict[str, Any]
    eval_workflow_kwargs: dict[str, Any]


def build_training_inputs(
    config: SWEPPOConfig, *, arena_client: ArenaOpenAPIClient | None = None
) -> TrainingInputs:
    """Datasets, workflow path and kwargs for ``econfig.dataset_source``.

    In Arena mode ``config.econfig`` is rewritten for the workers by
    :func:`pin_streams_for_workers`.
    """
    econfig = config.econfig
    source = econfig.dataset_source
    if source != "arena":  # the loader refuses it too; this covers configs edited after load
        raise ValueError(f"econfig.dataset_source {source!r} is not supported; use 'arena'")
    train, streams = get_arena_mixture_dataset(
        econfig, size_multiple=config.train_dataset.batch_size, client=arena_client
    )
    valid = train
    if econfig.arena_eval_streams:
        valid, eval_streams = get_arena_eval_dataset(econfig, streams, client=arena_client)
        streams = [*streams, *eval_streams]  # the workers launch tasks of both
    pin_streams_for_workers(econfig, streams)
    workflow_kwargs, eval_workflow_kwargs = build_workflow_kwargs(config)
    return TrainingInputs(train, valid, ARENA_WORKFLOW, workflow_kwargs, eval_workflow_kwargs)


def evaluation_scheduled(config: SWEPPOConfig, inputs: TrainingInputs) -> bool:
    """Whether there are valid rows and an ``evaluator`` schedule to evaluate them on."""
    ev = config.evaluator
    frequencies = (ev.freq_epochs, ev.freq_steps, ev.freq_secs)
    scheduled = ev.eval_before_train or any(f is not None for f in frequencies)
    return scheduled and inputs.valid_dataset is not None and len(inputs.valid_dataset) > 0


def main(argv: list[str]) -> None:
    warnings.filterwarnings("ignore", category=UserWarning, module="pydantic")
    config, _ = load_expr_config(argv, SWEPPOConfig)
    refuse_unsupported(config)  # before any Arena, scheduler or worker is touched
    with local_arena_if_requested(config):
        inputs = build_training_inputs(config)
        workflow_kind(inputs.workflow)  # a path that does not import: refused before workers
        with PPOTrainer(
            config, train_dataset=inputs.train_dataset, valid_dataset=inputs.valid_dataset
        ) as trainer:
            trainer.train(
                workflow=inputs.workflow,
                workflow_kwargs=inputs.workflow_kwargs,
                eval_workflow=inputs.workflow if evaluation_scheduled(config, inputs) else None,
                eval_workflow_kwargs=inputs.eval_workflow_kwargs,
                dynamic_filter_fn=config.should_accept_fn,
            )


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
