"""Arena rollouts without training: a smoke test of the whole rollout path.

    python -m examples.swe.arena_rollout_only --config <yaml> [--num-rollouts N]
        [--registry-smoke] [--serve-after-smoke-seconds S] [k=v ...]

Starts one inference server (``sglang``, or the embedded ``hf`` server) and a rollout
proxy in front of it, in this process, then runs ``N`` tasks of one Arena Stream (the
legacy single-Stream config) through ``ArenaStreamAgentWorkflow``, one sample per row, and
prints what came back. ``ARENA_ROLLOUT_DATA_ID`` runs exactly that row; otherwise ``N``
rows are sampled with the experiment ``seed``. Nothing is trained and no weights change.

``--registry-smoke`` first checks the route registry end to end: a proxy session, an Arena
LLM route pointing at the proxy with that session's key (kept alive for
``--serve-after-smoke-seconds`` so it can be exercised by hand), then its removal.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import random
import re
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx

from areal.api.cli_args import load_expr_config
from areal.api.config.train import parse_backend
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.infra.staleness_manager import StalenessManager
from areal.infra.workflow_paths import workflow_kind
from areal.proxy.keys import ensure_run_admin_keys
from areal.trainer.rl_trainer import _server_args  # the trainer's rollout server arguments
from areal.utils import logging
from areal.utils.secrets import reveal
from areal.utils.stats_logger import StatsLogger
from examples.swe.arena_client import ArenaOpenAPIClient
from examples.swe.arena_config import load_arena_stream_configs
from examples.swe.arena_types import ArenaStreamConfig
from examples.swe.train_swe_rl import (
    ARENA_WORKFLOW,
    arena_client,
    build_workflow_kwargs,
    get_stream_rows,
    local_arena_if_requested,
    pin_streams_for_workers,
    resolve_arena_stream,
)
from examples.swe.utils import SWEPPOConfig

__all__ = [
    "RolloutSummary",
    "_run_rollout_tasks",
    "_trajectory_reward",
    "main",
    "parse_args",
    "registry_smoke",
    "select_rows",
    "summarize",
]

logger = logging.getLogger("arena_rollout_only")

DATA_ID_ENV = "ARENA_ROLLOUT_DATA_ID"
ROLLOUT_BACKENDS = ("sglang", "hf")
SMOKE_HTTP_TIMEOUT = 60.0


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, list[str]]:
    """This tool's flags, and the rest (``--config`` and overrides) for the config loader."""
    parser = argparse.ArgumentParser(
        prog="python -m examples.swe.arena_rollout_only",
        description="Run Arena rollouts through the rollout proxy without training.",
        epilog="Other arguments go to the config loader: --config FILE.yaml [key=value ...]",
    )
    parser.add_argument("--num-rollouts", type=int, default=1, help="Rows to run (>= 1).")
    parser.add_argument(
        "--registry-smoke",
        action="store_true",
        help="First register and delete an Arena LLM route pointing at the proxy.",
    )
    parser.add_argument(
        "--serve-after-smoke-seconds",
        type=float,
        default=0.0,
        help="Keep the smoke route registered this many seconds before deleting it.",
    )
    args, rest = parser.parse_known_args(list(argv))
    if args.num_rollouts < 1:
        parser.error(f"--num-rollouts must be >= 1, got {args.num_rollouts}")
    if args.serve_after_smoke_seconds < 0:
        parser.error("--serve-after-smoke-seconds must be >= 0")
    return args, rest


# --- rows ---


def select_rows(
    econfig: Any,
    num_rollouts: int,
    seed: int,
    *,
    client: ArenaOpenAPIClient | None = None,
) -> tuple[list[dict[str, Any]], ArenaStreamConfig]:
    """The rows to run and their resolved Stream (exactly one Stream must be configured).

    ``$ARENA_ROLLOUT_DATA_ID`` gives that one row; otherwise ``num_rollouts`` rows are
    sampled with ``seed`` from the Stream's whole dataset (``ValueError`` if it has fewer).
    """
    configured = load_arena_stream_configs(econfig)
    if len(configured) != 1:
        raise ValueError(f"arena_rollout_only runs one Arena Stream, got {len(configured)}")
    data_id = os.environ.get(DATA_ID_ENV, "").strip()
    owned = client is None
    client = client or arena_client(econfig)
    try:
        stream, _ = resolve_arena_stream(client, configured[0])
        if data_id:
            ref = stream.expected_reward_ref
            row = {
                "data_id": data_id,
                "stream_id": stream.stream_id,
                "llm_protocol": stream.llm_protocol,
                "arena_task_type": "unknown",
                "arena_stream_name": stream.name,
                "reward_ref_key": ref.key,
                "reward_ref_version": ref.version,
            }
            return [row], stream
        rows = get_stream_rows(client, stream)
    finally:
        if owned:
            client.close()
    if len(rows) < num_rollouts:
        raise ValueError(
            f"Arena Stream {stream.stream_id!r} has {len(rows)} rows, fewer than the "
            f"{num_rollouts} rollouts requested"
        )
    return random.Random(seed).sample(rows, num_rollouts), stream


# --- running and scoring ---


def _trajectory_reward(traj: Any) -> float:
    """A trajectory's total reward: its ``rewards`` tensor, or its interactions' rewards."""
    if isinstance(traj, Mapping) and traj.get("rewards") is not None:
        return float(traj["rewards"].sum())
    interactions = traj.get("interactions") if isinstance(traj, Mapping) else None
    if isinstance(interactions, list):
        return float(
            sum(float(item.get("reward") or 0.0) for item in interactions if isinstance(item, dict))
        )
    raise ValueError(
        f"cannot read a reward from a {type(traj).__name__} trajectory "
        "(expected a 'rewards' tensor or an 'interactions' list)"
    )


def _run_rollout_tasks(
    controller: Any,
    rows: Sequence[Mapping[str, Any]],
    workflow_kwargs: dict[str, Any],
    *,
    proxy_addr: str | None = None,
) -> tuple[list[tuple[str, float]], list[str]]:
    """Run one agent rollout per row; ``([(data_id, reward)], [failed data_id])``.

    ``controller`` is anything with ``submit(*, data, workflow, workflow_kwargs, **kw) ->
    task_id`` and ``wait_for_task(*, task_id)`` (the inference engine), called with
    keyword arguments only, so keyword-only wrappers work too. All rows are submitted
    before any is awaited, so they run concurrently. A row fails when its submission
    raises, when its trajectory is ``None`` (rejected) or when waiting raises; the other
    rows still count.
    """
    submit_kwargs: dict[str, Any] = {"group_size": 1}
    if proxy_addr:
        submit_kwargs["proxy_addr"] = proxy_addr
    submitted: list[tuple[str, Any]] = []
    failed: list[str] = []
    for row in rows:
        data_id = str(row.get("data_id", ""))
        try:
            task_id = controller.submit(
                data=dict(row),
                workflow=ARENA_WORKFLOW,
                workflow_kwargs=workflow_kwargs,
                **submit_kwargs,
            )
        except Exception as e:
            logger.error("submitting Arena row %s failed: %s", data_id, e)
            failed.append(data_id)
            continue
        submitted.append((data_id, task_id))
    completed: list[tuple[str, float]] = []
    for data_id, task_id in submitted:
        try:
            trajectory = controller.wait_for_task(task_id=task_id)
            if trajectory is None:
                logger.warning("Arena row %s was rejected", data_id)
                failed.append(data_id)
                continue
            reward = _trajectory_reward(trajectory)
        except Exception as e:
            logger.error("Arena row %s failed: %s", data_id, e)
            failed.append(data_id)
            continue
        logger.info("Arena row %s: reward %.4g", data_id, reward)
        completed.append((data_id, reward))
    return completed, failed


@dataclasses.dataclass
class RolloutSummary:
    completed: int
    failed: int
    mean_reward: float
    max_reward: float
    reward_one_count: int

    def as_stats(self) -> dict[str, float]:
        return {
            "rollout/mean_reward": self.mean_reward,
            "rollout/max_reward": self.max_reward,
            "rollout/reward_one_count": float(self.reward_one_count),
            "rollout/completed": float(self.completed),
            "rollout/failed": float(self.failed),
        }


def summarize(completed: Sequence[tuple[str, float]], failed: Sequence[str]) -> RolloutSummary:
    rewards = [reward for _, reward in completed]
    return RolloutSummary(
        completed=len(rewards),
        failed=len(failed),
        mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
        max_reward=max(rewards) if rewards else 0.0,
        reward_one_count=sum(1 for r in rewards if r >= 1.0),
    )


# --- registry smoke ---


def _smoke_model_name(trial_name: str, suffix: str) -> str:
    """``stream-areal-<trial name, sanitized, last 40 chars>-<suffix>``."""
    trial = re.sub(r"[^a-z0-9-]+", "-", trial_name.lower()).strip("-")[-40:].strip("-")
    return f"stream-areal-{trial or 'trial'}-{suffix}"


def registry_smoke(
    proxy_addr: str,
    admin_api_key: str,
    trial_name: str,
    arena: ArenaOpenAPIClient,
    *,
    serve_seconds: float = 0.0,
    http: httpx.Client | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Register an Arena route to the proxy under a fresh session key, then remove both.

    The route and the session are always cleaned up. The first error wins; a cleanup error
    is raised only when nothing else failed. Returns the route's model name.
    """
    with contextlib.ExitStack() as stack:
        if http is None:
            http = stack.enter_context(httpx.Client(timeout=SMOKE_HTTP_TIMEOUT, trust_env=False))
        admin = {"Authorization": f"Bearer {reveal(admin_api_key)}"}
        base = proxy_addr.rstrip("/")
        suffix = uuid.uuid4().hex[:10]
        http.post(f"{base}/grant_capacity", headers=admin).raise_for_status()
        started = http.post(
            f"{base}/rl/start_session", headers=admin, json={"task_id": f"registry-smoke-{suffix}"}
        )
        started.raise_for_status()
        session_key = started.json()["api_key"]
        logging.register_secret(session_key)
        model_name = _smoke_model_name(trial_name, suffix)

        error: BaseException | None = None
        try:
            arena.register_llm_proxy(
                model_name=model_name,
                upstream_base_url=base,
                upstream_api_key=session_key,
                protocol="chat_completions",
            )
            logger.info("registry smoke: route %s -> %s registered", model_name, base)
            if serve_seconds > 0:
                logger.info("registry smoke: serving the route for %.0f s", serve_seconds)
                sleep(serve_seconds)
        except BaseException as e:  # Ctrl-C while serving still cleans up
            error = e
        cleanups = (
            lambda: arena.delete_llm_proxy(model_name),
            lambda: http.post(
                f"{base}/rl/end_session", headers={"Authorization": f"Bearer {session_key}"}
            ).raise_for_status(),
        )
        for cleanup in cleanups:
            try:
                cleanup()
            except Exception as e:
                if error is None:
                    error = e
                else:
                    logger.warning("registry smoke cleanup failed too: %s", e)
        if error is not None:
            raise error
        logger.info("registry smoke: route %s deleted, session ended", model_name)
        return model_name


# --- entry point ---


def _check_supported(config: SWEPPOConfig) -> None:
    if (config.scheduler.type or "local") != "local":
        raise ValueError(
            f"arena_rollout_only runs on this machine: scheduler.type must be 'local', "
            f"got {config.scheduler.type!r}"
        )
    backend = parse_backend(config.rollout.backend).backend
    if backend not in ROLLOUT_BACKENDS:
        raise ValueError(
            f"rollout.backend {config.rollout.backend!r}: arena_rollout_only drives "
            f"{' or '.join(ROLLOUT_BACKENDS)} inference servers"
        )
    if config.econfig.dataset_source != "arena":
        raise ValueError("arena_rollout_only needs econfig.dataset_source: arena")
    workflow_kind(ARENA_WORKFLOW)  # an agent path that does not import: refused before servers


def main(argv: Sequence[str]) -> int:
    args, rest = parse_args(argv)
    config, _ = load_expr_config(rest, SWEPPOConfig)
    _check_supported(config)
    ensure_run_admin_keys(config)  # an unset admin key: a random one for this run
    with local_arena_if_requested(config):
        econfig = config.econfig
        rows, stream = select_rows(econfig, args.num_rollouts, config.seed)
        pin_streams_for_workers(econfig, [stream])
        workflow_kwargs, _ = build_workflow_kwargs(config)
        rollout_config = dataclasses.replace(
            config.rollout,
            experiment_name=config.rollout.experiment_name or config.experiment_name,
            trial_name=config.rollout.trial_name or config.trial_name,
        )
        # no controller and no trainer here: the engine gates its own rollouts, by
        # max_concurrent_rollouts only (nothing is trained, so nothing can go stale)
        gate = StalenessManager(
            version_provider=lambda: 0,
            max_concurrent_rollouts=rollout_config.max_concurrent_rollouts,
            consumer_batch_size=rollout_config.consumer_batch_size,
            max_staleness=None,
        )
        engine = RemoteSGLangEngine(config=rollout_config, staleness=gate)
        try:
            server_addr = engine.launch_local_server(server_args=_server_args(config))
            engine.initialize(addr=server_addr)
            proxy_addr = engine.launch_proxy(
                tokenizer_path=config.tokenizer_path or config.actor.path
            )
            if args.registry_smoke:
                with ArenaOpenAPIClient(
                    base_url=econfig.arena_base_url,
                    timeout=econfig.arena_registration_timeout,
                    request_retries=econfig.arena_request_retries,
                ) as arena:
                    registry_smoke(
                        proxy_addr,
                        config.rollout.agent.admin_api_key,
                        config.trial_name,
                        arena,
                        serve_seconds=args.serve_after_smoke_seconds,
                    )
            completed, failed = _run_rollout_tasks(
                engine, rows, workflow_kwargs, proxy_addr=proxy_addr
            )
        finally:
            engine.destroy()

    summary = summarize(completed, failed)
    logger.info(
        "Arena rollouts: %d completed, %d failed, mean reward %.4g, max %.4g, %d with reward >= 1",
        summary.completed,
        summary.failed,
        summary.mean_reward,
        summary.max_reward,
        summary.reward_one_count,
    )
    if failed:
        logger.warning("failed rows: %s", ", ".join(failed))
    stats_logger = StatsLogger(config=config)  # stats.jsonl, TensorBoard and W&B when configured
    try:
        stats_logger.commit(epoch=0, step=0, global_step=0, data=summary.as_stats())
    finally:
        stats_logger.close()
    return 0 if summary.completed else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
