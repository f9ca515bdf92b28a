"""``PPOTrainer``: the single-controller GRPO loop.

    with PPOTrainer(config, train_dataset) as trainer:
        trainer.train(workflow="examples.toy.token_reward.TokenRewardWorkflow",
                      workflow_kwargs={...})

The trainer runs in a CPU controller process. It starts actor ranks and rollout workers
through the scheduler (``local``: subprocesses on this machine), then per step:
rollout (bounded by ``rollout.max_head_offpolicyness``) -> reference log-probs (when
``actor.kl_ctl > 0``) -> proximal log-probs -> advantages -> PPO update -> weight sync to
inference -> evaluation (when scheduled) -> HF save / recover checkpoint -> stats.

The KL penalty needs a reference model: with ``actor.kl_ctl > 0`` the ``ref`` engine
(``ref``, or by default a frozen copy of the actor forked beside its workers) scores every
batch, since scoring against nothing would make ``-kl_ctl x logp`` a bonus. Evaluation
workers start only when ``train`` gets an eval workflow (and there are valid rows): they
are forked beside the rollout workers and send requests to the same servers.

A run killed at any point resumes from its last recover checkpoint when started again with
the same experiment and trial names (``recover.mode`` on or auto): rows the rollout had
drawn ahead of training (asynchronous mode) are trained after the resume, once each, and
``stats.jsonl`` keeps no row of a step that is run again.

A dead inference server or rollout worker fails the run: the rollout controller's health
checks stop dispatching, and the step raises an error naming the server; no weight update
is attempted against it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import getpass
import json
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from areal.api.cli_args import PPOConfig
from areal.api.config.support import refuse_unsupported
from areal.api.config.train import parse_backend
from areal.api.io_struct import FinetuneSpec, WeightUpdateMeta
from areal.api.workflow_api import RolloutWorkflow
from areal.engine.weight_sync import push_weights
from areal.infra.controller.rollout_controller import RolloutController
from areal.infra.controller.train_controller import TrainController
from areal.infra.workflow_paths import workflow_kind
from areal.proxy.keys import ensure_run_admin_keys
from areal.trainer import evaluation
from areal.trainer.dataloader import StatefulDataLoader
from areal.utils import logging, seeding, stats_tracker

__all__ = ["PPOTrainer"]

logger = logging.getLogger("trainer")

ACTOR_ENGINES = {
    "fsdp": "areal.trainer.ppo.actor.FSDPPPOActor",
    "megatron": "areal.trainer.ppo.actor.MegatronPPOActor",
}


def _is_workflow(workflow: Any) -> bool:
    if isinstance(workflow, RolloutWorkflow):
        return True
    if isinstance(workflow, type):
        return issubclass(workflow, RolloutWorkflow)
    if isinstance(workflow, str):
        return workflow_kind(workflow) == "workflow"  # a path that does not import is refused
    return False


class PPOTrainer:
    def __init__(
        self,
        config: PPOConfig,
        train_dataset: Sequence[Any],
        valid_dataset: Sequence[Any] | None = None,
    ):
        self.config = config
        self.actor: TrainController | None = None
        self.ref: TrainController | None = None  # the KL penalty's reference model
        self.rollout: RolloutController | None = None
        self.eval_rollout: RolloutController | None = None  # created by train(), lazily
        self.valid_dataset = valid_dataset
        self.scheduler = None
        self.stats_logger = None
        self._log_files: list[Path] = []
        try:
            self._build(train_dataset, valid_dataset)
        except BaseException:
            self.close()
            raise

    # --- construction ---

    def _build(self, train_dataset, valid_dataset) -> None:
        cfg = self.config
        refuse_unsupported(cfg)  # before any worker starts
        self.log_dir = (
            Path(cfg.cluster.fileroot)
            / "logs"
            / getpass.getuser()
            / (f"{cfg.experiment_name}/{cfg.trial_name}")
        )
        self._log_files = [
            logging.setup_file_logging(self.log_dir, name) for name in ("main.log", "merged.log")
        ]
        seeding.set_random_seed(cfg.seed, f"trainer{os.environ.get('RANK', '0')}")
        self.tokenizer = _load_tokenizer(cfg.tokenizer_path or cfg.actor.path)
        # unset admin keys get random per-run values before the scheduler exports the
        # config's secrets to the workers' environment
        ensure_run_admin_keys(cfg)
        self.scheduler = _build_scheduler(cfg)

        self.dataloader = StatefulDataLoader(
            train_dataset,
            batch_size=cfg.train_dataset.batch_size,
            shuffle=cfg.train_dataset.shuffle,
            drop_last=cfg.train_dataset.drop_last,
        )
        self.ft_spec = FinetuneSpec(
            total_train_epochs=cfg.total_train_epochs,
            dataset_size=len(self.dataloader) * cfg.train_dataset.batch_size,
            train_batch_size=cfg.train_dataset.batch_size,
        )

        self.actor = self._train_engine("actor", cfg.actor)
        ref_cfg = cfg.ref_config()  # None unless actor.kl_ctl > 0
        if ref_cfg is not None:
            self.ref = self._train_engine("ref", ref_cfg)

        rollout_alloc = parse_backend(cfg.rollout.backend)
        rollout_cfg = dataclasses.replace(
            cfg.rollout,
            experiment_name=cfg.rollout.experiment_name or cfg.experiment_name,
            trial_name=cfg.rollout.trial_name or cfg.trial_name,
            # where the workers write rollout.dump_to_file dumps, and how they decode them
            fileroot=cfg.rollout.fileroot or cfg.cluster.fileroot,
            tokenizer_path=cfg.rollout.tokenizer_path or cfg.tokenizer_path or cfg.actor.path,
        )
        self.rollout = RolloutController(rollout_cfg, self.scheduler, role="rollout")
        strategy = cfg.rollout.scheduling_strategy
        # colocated servers share the actor's devices: they give their memory back
        # while the actor trains (the supported shape is checked at config load)
        self.colocated = strategy is not None and strategy.type == "colocation"
        self.rollout.initialize(
            rollout_alloc.parallel.dp_size,
            cfg.rollout.scheduling_spec[0],
            server_args=_server_args(cfg),
            strategy=strategy if self.colocated else None,
        )

        self.weight_update_meta = self._weight_update_meta()
        self.actor.connect_engine(self.rollout, self.weight_update_meta)

        from areal.utils.saving import Evaluator, RecoverHandler, Saver
        from areal.utils.stats_logger import StatsLogger

        self.saver = Saver(cfg.saver, self.ft_spec)
        self.evaluator = Evaluator(cfg.evaluator, self.ft_spec)
        self.recover_handler = RecoverHandler(cfg.recover, self.ft_spec)
        self.stats_logger = StatsLogger(cfg, self.ft_spec)
        self.recover_info = self.recover_handler.load(
            self.actor,
            self.saver,
            self.evaluator,
            self.stats_logger,
            self.dataloader,
        )
        if self.recover_info is not None:
            version = self.recover_info.last_step_info.global_step + 1
            self.rollout.staleness.on_version_recovered(version)
            self._push_weights(version)
            logger.info(
                "recovered: resuming at global step %d (%d row(s) drawn ahead are trained first)",
                version,
                len(self.dataloader.outstanding()),
            )
        self.stats_logger.resume_at(0 if self.recover_info is None else version)

    def _train_engine(self, role: str, engine_cfg: Any) -> TrainController:
        """The ranks of ``role`` (actor, or the frozen ref: same engine class, no optimizer)."""
        alloc = parse_backend(engine_cfg.backend)
        engine = ACTOR_ENGINES.get(alloc.backend)
        if engine is None:
            raise ValueError(
                f"{role}.backend {engine_cfg.backend!r}: the trainer runs fsdp or megatron engines"
            )
        controller = TrainController(engine, engine_cfg, self.scheduler, role=role)
        controller.initialize(
            alloc.parallel.world_size,
            engine_cfg.scheduling_spec[0],
            self.ft_spec,
            engine_cfg.scheduling_strategy,
        )
        return controller

    def _weight_update_meta(self) -> WeightUpdateMeta:
        cfg = self.config
        mode = cfg.actor.weight_update_mode
        if mode == "disk":
            root = (
                Path(cfg.cluster.fileroot)
                / "checkpoints"
                / getpass.getuser()
                / cfg.experiment_name
                / cfg.trial_name
                / "default"
                / "weight_update"
            )
            return WeightUpdateMeta(type="disk", path=str(root))
        if mode in ("xccl", "awex"):
            layout = parse_backend(cfg.rollout.backend).parallel
            return WeightUpdateMeta(
                type=mode,
                gen_tp_size=layout.tp_size,
                gen_pp_size=layout.pp_size,
                gen_n_servers=layout.dp_size,
                weight_chunked_mem_mb=1024,
            )
        raise ValueError(
            f"actor.weight_update_mode {mode!r} is not supported here; disk, xccl or awex"
        )

    def _meta_for(self, version: int) -> WeightUpdateMeta:
        meta = dataclasses.replace(self.weight_update_meta, version=version)
        if meta.type == "disk":
            meta.path = f"{self.weight_update_meta.path}_v{version}"
        return meta

    def _push_weights(self, version: int, resume: bool = True) -> None:
        """The weight-sync handshake, driven from here (train ranks never call the rollout
        side): inside the rollout side's barrier (dispatch stopped, in-flight generation
        aborted), the servers receive while the actor's ranks send, concurrently
        (:func:`~areal.engine.weight_sync.push_weights`); then the actor takes the version.
        With ``resume`` the barrier ends: the version reaches every rollout worker, server
        and proxy, and rollouts go on."""
        self.rollout.begin_weight_update(version)  # a no-op when the step already closed it
        push_weights(self.actor, self.rollout, self._meta_for(version), self.actor.weight_plan)
        self.actor.set_version(version)
        if resume:
            self.rollout.end_weight_update(version)

    # --- the loop ---

    def train(
        self,
        workflow: Any,
        eval_workflow: Any = None,
        workflow_kwargs: dict[str, Any] | None = None,
        eval_workflow_kwargs: dict[str, Any] | None = None,
        dynamic_filter_fn: str | None = None,
        total_epochs: int | None = None,
    ) -> None:
        """Train until ``total_epochs`` (default ``total_train_epochs``) or
        ``total_train_steps``.

        ``workflow`` and ``eval_workflow`` are :class:`RolloutWorkflow` instances, classes
        or import paths, or import paths of agents (run through rollout proxies). With an
        ``eval_workflow`` and a ``valid_dataset``, every valid row is rolled out
        (``eval_gconfig.n_samples`` samples each, ``is_eval``) after the weight update of
        each step the ``evaluator`` schedule fires at; its stats go under
        ``eval-rollout/``.
        """
        if isinstance(eval_workflow, Mapping):
            raise TypeError(
                "train(workflow, eval_workflow=None, workflow_kwargs=None, ...): the second "
                "positional argument is the eval workflow, but a dict was given; pass "
                "workflow_kwargs=... by keyword"
            )
        cfg = self.config
        epochs = total_epochs or cfg.total_train_epochs
        if epochs <= 0:
            raise ValueError("total_train_epochs must be > 0")
        steps_per_epoch = len(self.dataloader)
        max_steps = epochs * steps_per_epoch
        if cfg.total_train_steps is not None:
            max_steps = min(max_steps, cfg.total_train_steps)
        start = 0
        if self.recover_info is not None:
            start = self.recover_info.last_step_info.next().global_step
        proxy_addr = None
        if not _is_workflow(workflow):
            tokenizer_path = cfg.tokenizer_path or cfg.actor.path
            proxy_addr = self.rollout.start_proxies(
                tokenizer_path, expected_temperature=cfg.actor.temperature
            )[0]
        from areal.utils.saving import StepInfo
        from areal.utils.stats_logger import ProgressDisplay

        progress = ProgressDisplay(total_steps=max_steps, start_step=start)
        with self._failures_named(), progress:
            evaluate = self._eval_pass(eval_workflow, eval_workflow_kwargs)
            before_train: dict[str, float] = {}
            if evaluate is not None and start == 0 and cfg.evaluator.eval_before_train:
                with stats_tracker.get().record_timing("eval"):
                    before_train = evaluation.rescope(
                        evaluate(), evaluation.EVAL_SCOPE, f"{evaluation.EVAL_SCOPE}/before_train"
                    )
            for global_step in range(start, max_steps):
                epoch, epoch_step = divmod(global_step, steps_per_epoch)
                step_info = StepInfo(epoch, epoch_step, global_step, steps_per_epoch)
                began = time.monotonic()
                tracker = stats_tracker.get()
                with tracker.record_timing("rollout"):
                    batch = self.rollout.prepare_batch(
                        self.dataloader,
                        workflow,
                        workflow_kwargs,
                        should_accept_fn=dynamic_filter_fn,
                        group_size=cfg.gconfig.n_samples,
                        reward_normalization=cfg.gconfig.reward_normalization,
                        drop_incomplete_group=cfg.gconfig.drop_incomplete_group,
                        proxy_addr=proxy_addr,
                        batch_size=cfg.train_dataset.batch_size,
                    )
                self._record_trained(batch, global_step)
                if self.colocated:
                    with tracker.record_timing("offload_rollout"):
                        # the weight-update barrier closes now: idle servers while the actor trains
                        self.rollout.begin_weight_update(global_step + 1)
                        self.rollout.offload()
                if self.ref is not None:  # the KL penalty's reference (actor.kl_ctl > 0)
                    with tracker.record_timing("ref_logp"):
                        logps = self.ref.compute_logp(batch)
                        for trajectory, logp in zip(batch, logps, strict=True):
                            trajectory["ref_logp"] = logp
                if self.actor.should_compute_prox_logp():
                    with tracker.record_timing("recompute_logp"):
                        logps = self.actor.compute_logp(batch)
                        for trajectory, logp in zip(batch, logps, strict=True):
                            trajectory["prox_logp"] = logp
                with tracker.record_timing("compute_advantage"):
                    advantaged = self.actor.compute_advantages(batch)
                with tracker.record_timing("train_step"):
                    update_stats = self.actor.ppo_update(advantaged)
                    self.actor.step_lr_scheduler()
                # --- weight update: one barrier on the rollout side, from here to the
                # step's end (evaluation, save and checkpoint see no rollout running) ---
                self.rollout.check_health()  # never start a weight update towards a dead server
                version = global_step + 1
                self.rollout.begin_weight_update(version)
                if self.colocated:
                    with tracker.record_timing("onload_rollout"):
                        self.rollout.onload()
                with tracker.record_timing("update_weights"):
                    self._push_weights(version, resume=False)
                sync_stats = self._check_weight_sync()
                # --- evaluation (after the weight update, before the recover checkpoint
                # records the evaluator's schedule) ---
                eval_stats = before_train
                before_train = {}
                if evaluate is not None:
                    self.eval_rollout.set_version(version)
                    with tracker.record_timing("eval"):
                        self.evaluator.evaluate(
                            lambda into=eval_stats: into.update(evaluate()),
                            epoch,
                            epoch_step,
                            global_step,
                        )
                with tracker.record_timing("save"):
                    self.saver.save(
                        self.actor, epoch, epoch_step, global_step, tokenizer=self.tokenizer
                    )
                with tracker.record_timing("checkpoint_for_recover"):
                    self.recover_handler.dump(
                        self.actor,
                        step_info,
                        self.saver,
                        self.evaluator,
                        self.stats_logger,
                        self.dataloader,
                        tokenizer=self.tokenizer,
                    )
                stats = {**self.actor.export_stats(), **self.rollout.export_stats()}
                stats.update(stats_tracker.export_all())
                stats.update(_batch_stats(batch, update_stats, time.monotonic() - began))
                stats.update(sync_stats)
                stats.update(eval_stats)
                stats["train/weight_version"] = float(version)
                self.stats_logger.commit(epoch, epoch_step, global_step, stats)
                progress.update(global_step + 1, stats)
                self.after_step(step_info, stats)
                if global_step + 1 < max_steps:  # nothing is launched for a step that never runs
                    self.rollout.end_weight_update(version)

    # --- evaluation ---

    def _eval_pass(
        self, eval_workflow: Any, eval_workflow_kwargs: dict[str, Any] | None
    ) -> Callable[[], dict[str, float]] | None:
        """One evaluation over every valid row, as a function returning its stats; None
        without an eval workflow, valid rows or a schedule (then no eval worker starts)."""
        cfg = self.config
        if not evaluation.will_evaluate(eval_workflow, self.valid_dataset, cfg.evaluator):
            return None
        if self.eval_rollout is None:
            spec = cfg.rollout.scheduling_spec[0]
            self.eval_rollout = evaluation.start_eval_rollout(self.rollout, self.scheduler, spec)
        proxy_addr = None
        if not _is_workflow(eval_workflow):
            tokenizer_path = cfg.tokenizer_path or cfg.actor.path
            proxy_addr = self.eval_rollout.start_proxies(tokenizer_path)[0]
        n_samples = (cfg.eval_gconfig or cfg.gconfig).n_samples
        return evaluation.eval_pass(
            self.eval_rollout,
            self.valid_dataset,
            eval_workflow,
            eval_workflow_kwargs,
            n_samples,
            proxy_addr,
        )

    @contextlib.contextmanager
    def _failures_named(self) -> Iterator[None]:
        """A step that failed because a server or rollout worker died raises the health
        error naming it (chained to what failed), not, say, a weight-update error."""
        try:
            yield
        except Exception as error:
            failure = None
            if self.rollout is not None:
                try:
                    failure = self.rollout.diagnose()
                except Exception:  # the original error is the one to report then
                    logger.exception("diagnosing the rollout side failed")
            if failure is None or failure is error:
                raise
            raise failure from error

    def _check_weight_sync(self) -> dict[str, float]:
        """``actor.weight_sync_check``: every server's log-probs against the actor's."""
        cfg = self.config.actor
        if not cfg.weight_sync_check:
            return {}
        from areal.trainer.weight_sync_check import check_weight_sync

        return check_weight_sync(
            self.actor,
            self.rollout.server_addrs,
            self.tokenizer,
            temperature=cfg.temperature,
            n_data_parallel=self.actor.dp_size,
            tolerance=cfg.weight_sync_check_tolerance,
            api_key=_inference_api_key(self.scheduler),
        )

    def after_step(self, step_info: Any, stats: dict[str, float]) -> None:
        """Called after each step (weights synced, rollout still paused); override to probe."""

    def _record_trained(self, batch: list[dict], global_step: int) -> None:
        """With ``rollout.dump_to_file``: one line per step in ``rollout/trained.jsonl``
        naming the groups the step trains (each group's prompt and rewards). The workers'
        dumps hold every finished group, accepted, rejected or drawn ahead and lost to a
        crash; this says which ones training used. A step run again after a resume appends
        a new line: the last line of a step is the one that counted."""
        if not self.config.rollout.dump_to_file:
            return
        from areal.utils.trajectory_dump import trajectory_records

        groups = []
        for group in batch:
            records = trajectory_records([group], self.tokenizer, "")
            groups.append(
                {
                    "prompt": records[0]["prompt"] if records else None,
                    "rewards": [float(r) for r in group["rewards"].reshape(-1)],
                }
            )
        line = json.dumps({"global_step": global_step, "groups": groups}, ensure_ascii=False)
        directory = self.log_dir / "rollout"
        directory.mkdir(parents=True, exist_ok=True)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(directory / "trained.jsonl", flags, 0o600)
        with os.fdopen(fd, "a", encoding="utf-8") as out:
            out.write(line + "\n")

    # --- teardown ---

    def close(self) -> None:
        for part in ("eval_rollout", "rollout", "ref", "actor"):
            component = getattr(self, part, None)
            if component is not None:
                try:
                    component.destroy()
                except Exception as e:
                    logger.warning("closing %s failed: %s", part, e)
                setattr(self, part, None)
        if self.stats_logger is not None:
            self.stats_logger.close()
            self.stats_logger = None
        if self.scheduler is not None:
            self.scheduler.delete_workers()
            self.scheduler = None
        for path in self._log_files:
            logging.stop_file_logging(path)
        self._log_files = []

    def __enter__(self) -> PPOTrainer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _batch_stats(batch: list[dict], update_stats: list[dict], seconds: float) -> dict[str, float]:
    rewards = [float(r) for group in batch for r in group["rewards"].reshape(-1)]
    samples = len(rewards)
    out = {
        "rollout/reward_mean": sum(rewards) / max(1, samples),
        "perf/samples_per_minute": 60.0 * samples / max(seconds, 1e-9),
        "perf/step_seconds": seconds,
    }
    losses = [s["loss"] for s in update_stats if "loss" in s]
    if losses:
        out["ppo_actor/loss"] = sum(losses) / len(losses)
    steps = [s["optimizer_steps"] for s in update_stats if "optimizer_steps" in s]
    if steps:
        out["ppo_actor/optimizer_steps"] = max(steps)
    norms = [s["grad_norm"] for s in update_stats if "grad_norm" in s]
    if norms:
        out["ppo_actor/grad_norm"] = sum(norms) / len(norms)
    return out


def _inference_api_key(scheduler: Any) -> str:
    """The run's inference-server API key (the scheduler makes one per run)."""
    key = getattr(scheduler, "inference_api_key", None)
    return key.reveal() if key is not None else ""


def _load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _build_scheduler(cfg: PPOConfig):
    kind = cfg.scheduler.type or "local"
    if kind == "local":
        from areal.infra.scheduler.local import LocalScheduler

        return LocalScheduler(cfg)
    if kind == "slurm":
        from areal.infra.scheduler.slurm import SlurmScheduler

        return SlurmScheduler(cfg)
    if kind == "ray":
        from areal.infra.scheduler.ray import RayScheduler

        return RayScheduler(cfg)
    raise NotImplementedError(f"scheduler.type {kind!r}: this port has local, slurm and ray")


def _server_args(cfg: PPOConfig) -> dict[str, Any]:
    """Arguments of each rollout worker's own server (host and port chosen there)."""
    from areal.engine.sglang_backend import HFBackend, SGLangBackend

    allocation = parse_backend(cfg.rollout.backend)
    impl = HFBackend() if allocation.backend == "hf" else SGLangBackend()
    sglang = cfg.sglang
    if not sglang.model_path:
        sglang = dataclasses.replace(sglang, model_path=cfg.actor.path)
    args = impl.server_args(sglang, host="", port=0, tp_size=allocation.parallel.tp_size)
    args.pop("host", None)
    args.pop("port", None)
    return args
