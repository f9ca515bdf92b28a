"""Per-step statistics to ``stats.jsonl``, TensorBoard, and W&B / SwanLab / Trackio if configured.

Only rank 0 logs (``RANK`` unset or ``0``); elsewhere every method is a no-op. The JSONL file
and TensorBoard need nothing but the disk. The hosted backends are imported only when their
mode is not ``disabled``; a missing package is then an error naming it. In ``offline`` and
``local`` modes nothing logs in to a server. Secrets (``wandb_api_key``, SwanLab's
``api_key``) go to the backend through the environment or its login call, never to a log
line, and the run config handed to a backend is redacted.

A rerun of a trial never duplicates steps in ``stats.jsonl``: before its first row the
logger drops the rows of the step it continues at and later ones (all of them when it
starts over), keeping the previous file as ``stats.jsonl.prev``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import math
import os
import shutil
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

from areal.api.io_struct import FinetuneSpec
from areal.utils import logging
from areal.utils.config_utils import redact_sensitive_config
from areal.utils.paths import get_log_path
from areal.utils.secrets import reveal
from areal.utils.table import render_table

__all__ = ["PREVIOUS_SUFFIX", "STATS_FILE", "ProgressDisplay", "StatsLogger"]

logger = logging.getLogger("stats_logger")

STATS_FILE = "stats.jsonl"
PREVIOUS_SUFFIX = ".prev"  # the file as a rerun found it, when it dropped rows
_COUNT_SUFFIX = "__count"


def _require(module: str, field: str, mode: Any) -> Any:
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise RuntimeError(
            f"{field}={mode} needs the '{module}' package: pip install {module}, "
            f"or set {field}=disabled"
        ) from e


def _areal_version() -> str:
    try:
        return importlib.metadata.version("areal-arena")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


class StatsLogger:
    """Commits one row of statistics per training step to every configured backend.

    ``config`` is the experiment config (anything with ``.stats_logger``; its whole,
    redacted content becomes the W&B / SwanLab run config) or a ``StatsLoggerConfig``.
    """

    def __init__(self, config: Any, ft_spec: FinetuneSpec | None = None, rank: int | None = None):
        self.exp_config = config if hasattr(config, "stats_logger") else None
        self.config = config.stats_logger if self.exp_config is not None else config
        self.ft_spec = ft_spec
        self.rank = int(os.environ.get("RANK", "0")) if rank is None else rank
        self._last_commit_step = -1
        self._resume_step: int | None = None
        self.log_dir: Path | None = None
        self._jsonl = None
        self._tensorboard = None
        self._wandb = None
        self._swanlab = None
        self._trackio = None
        if self.rank != 0:
            return
        c = self.config
        self.log_dir = get_log_path(c.fileroot, c.experiment_name, c.trial_name)
        if c.tensorboard.path:
            from tensorboardX import SummaryWriter

            self._tensorboard = SummaryWriter(logdir=c.tensorboard.path)
        self._wandb = self._init_wandb()
        self._swanlab = self._init_swanlab()
        self._trackio = self._init_trackio()

    # --- backends ---

    def _run_config(self, extra: Mapping[str, Any] | None) -> dict[str, Any]:
        source = self.exp_config if self.exp_config is not None else self.config
        run_config = redact_sensitive_config(source)
        run_config["areal_version"] = _areal_version()
        if extra:
            run_config.update(redact_sensitive_config(dict(extra)))
        return run_config

    def _init_wandb(self) -> Any:
        cfg, c = self.config.wandb, self.config
        if cfg.mode == "disabled":
            return None
        wandb = _require("wandb", "stats_logger.wandb.mode", cfg.mode)
        if cfg.wandb_base_url:
            os.environ["WANDB_BASE_URL"] = cfg.wandb_base_url
        api_key = reveal(cfg.wandb_api_key)
        if api_key:
            logging.register_secret(api_key)
            os.environ["WANDB_API_KEY"] = api_key
        online = cfg.mode in ("online", "shared")
        if online:
            wandb.login()
        suffix = time.strftime("%Y%m%d-%H%M%S") if cfg.id_suffix == "timestamp" else cfg.id_suffix
        run_name = f"{c.experiment_name}_{c.trial_name}"
        wandb.init(
            mode=cfg.mode,
            entity=cfg.entity,
            project=cfg.project or c.experiment_name,
            name=cfg.name or c.trial_name,
            job_type=cfg.job_type,
            group=cfg.group or run_name,
            notes=cfg.notes,
            tags=cfg.tags,
            config=self._run_config(cfg.config),
            dir=str(self.log_dir),
            id=f"{run_name}_{suffix}" if suffix else run_name,
            resume="allow",
            **({"force": True} if online else {}),
        )
        return wandb

    def _init_swanlab(self) -> Any:
        cfg, c = self.config.swanlab, self.config
        if cfg.mode in (None, "disabled"):
            return None
        swanlab = _require("swanlab", "stats_logger.swanlab.mode", cfg.mode)
        api_key = reveal(cfg.api_key) or os.environ.get("SWANLAB_API_KEY", "")
        if cfg.mode == "cloud" and api_key:
            logging.register_secret(api_key)
            swanlab.login(api_key=api_key)
        swanlab.init(
            project=cfg.project or c.experiment_name,
            experiment_name=cfg.name or c.trial_name,
            config=self._run_config(cfg.config),
            logdir=cfg.logdir or str(self.log_dir / "swanlab"),
            mode=cfg.mode,
        )
        return swanlab

    def _init_trackio(self) -> Any:
        cfg, c = self.config.trackio, self.config
        if cfg.mode == "disabled":
            return None
        trackio = _require("trackio", "stats_logger.trackio.mode", cfg.mode)
        trackio.init(
            project=cfg.project or c.experiment_name,
            name=cfg.name or c.trial_name,
            space_id=cfg.space_id if cfg.mode == "online" else None,
            config=self._run_config(None),
        )
        return trackio

    # --- logging ---

    def commit(self, epoch: int, step: int, global_step: int, data: Mapping[str, Any]) -> None:
        """Log one step's statistics (``step`` is the step within ``epoch``).

        ``…__count`` keys are dropped. Backends get the row at
        ``max(global_step, last committed step + 1)``, so a resumed run never logs a step
        twice; the JSONL row keeps the caller's ``epoch``, ``step`` and ``global_step``.
        """
        if self.rank != 0:
            return
        stats = {k: float(v) for k, v in data.items() if not k.endswith(_COUNT_SUFFIX)}
        log_step = max(global_step, self._last_commit_step + 1)
        self._log_progress(epoch, step, global_step)
        if stats:
            rows = [(key, f"{value:.6g}") for key, value in sorted(stats.items())]
            logger.info(
                "\n%s",
                render_table(f"Stats (global step {global_step + 1})", ("key", "value"), rows),
            )

        row = {"epoch": epoch, "step": step, "global_step": global_step, "time": time.time()}
        row.update({k: v if math.isfinite(v) else None for k, v in stats.items()})
        if self._jsonl is None:
            self._jsonl = self._open_jsonl()
        self._jsonl.write(json.dumps(row) + "\n")
        self._jsonl.flush()
        if self._tensorboard is not None:
            for key, value in stats.items():
                self._tensorboard.add_scalar(key, value, log_step)
            self._tensorboard.flush()
        if self._wandb is not None:
            self._wandb.log(stats, step=log_step)
        if self._swanlab is not None:
            self._swanlab.log(stats, step=log_step)
        if self._trackio is not None:
            self._trackio.log(stats, step=log_step)
        self._last_commit_step = log_step

    def _log_progress(self, epoch: int, step: int, global_step: int) -> None:
        if self.ft_spec is None:
            logger.info(
                "Epoch %d step %d (global step %d) done", epoch + 1, step + 1, global_step + 1
            )
            return
        logger.info(
            "Epoch %d/%d step %d/%d (global step %d/%d) done",
            epoch + 1,
            self.ft_spec.total_train_epochs,
            step + 1,
            self.ft_spec.steps_per_epoch,
            global_step + 1,
            self.ft_spec.total_train_steps,
        )

    def resume_at(self, global_step: int) -> None:
        """This run continues at ``global_step`` (0: it starts over).

        Rows an earlier run of the trial logged for ``global_step`` or later are dropped
        before the first commit. Without a call, the run continues after the last step
        restored by :meth:`load_state_dict` (or starts over).
        """
        if self._jsonl is not None:
            raise RuntimeError("resume_at() must come before the first commit")
        self._resume_step = global_step

    def _open_jsonl(self) -> Any:
        """``stats.jsonl`` for appending, holding only the rows of steps before the resume."""
        assert self.log_dir is not None
        path = self.log_dir / STATS_FILE
        start = self._resume_step
        if start is None:
            start = self._last_commit_step + 1
        if path.exists():
            lines = [x for x in path.read_text(encoding="utf-8").splitlines() if x.strip()]
            kept = [line for line in lines if _step_of(line) < start]
            if len(kept) < len(lines):
                previous = path.with_name(STATS_FILE + PREVIOUS_SUFFIX)
                shutil.copyfile(path, previous)
                staging = path.with_name(STATS_FILE + ".staging")
                staging.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
                staging.replace(path)
                logger.info(
                    "%s: kept %d row(s) of steps before %d, dropped %d from an earlier run "
                    "(the old file is %s)",
                    path,
                    len(kept),
                    start,
                    len(lines) - len(kept),
                    previous.name,
                )
        return open(path, "a", encoding="utf-8")

    def state_dict(self) -> dict[str, Any]:
        return {"last_commit_step": self._last_commit_step}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._last_commit_step = int(state.get("last_commit_step", -1))

    def close(self) -> None:
        """Flush and close every backend; safe to call twice."""
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        for name in ("_wandb", "_swanlab", "_trackio"):
            backend = getattr(self, name)
            if backend is not None:
                backend.finish()
                setattr(self, name, None)


class ProgressDisplay:
    """Training progress: step k/N, mean reward, throughput and ETA.

    On a terminal this is a rich progress bar; otherwise (logs redirected to a file, CI)
    each ``update`` writes one plain log line. The reward is the first of
    ``reward_keys`` present in the step's stats; throughput is generated tokens per
    second when ``token_key`` is present, else samples per minute from ``sample_key``.
    A step lasts what the trainer measured (``step_key``) when it is in the stats, else
    the time since the previous update (which would count an evaluation before training
    into the first step). The ETA extrapolates the mean step time. ``start_step`` is the
    number of steps a resumed run had already completed.
    """

    def __init__(
        self,
        total_steps: int,
        start_step: int = 0,
        *,
        console: Console | None = None,
        clock: Callable[[], float] = time.monotonic,
        reward_keys: tuple[str, ...] = (
            "rollout/reward_mean",
            "rollout/reward",
            "ppo_actor/task_reward/avg",
        ),
        token_key: str = "ppo_actor/n_valid_tokens",
        sample_key: str = "ppo_actor/n_seqs",
        step_key: str = "perf/step_seconds",
    ):
        self.total_steps = total_steps
        self.start_step = start_step
        self.reward_keys = reward_keys
        self.token_key = token_key
        self.sample_key = sample_key
        self.step_key = step_key
        self._clock = clock
        self._last = clock()
        self._elapsed = 0.0  # seconds of the steps run so far
        self._console = console if console is not None else Console()
        self._progress: Progress | None = None
        if self._console.is_terminal:
            self._progress = Progress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"),
                console=self._console,
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, completed=start_step, info=""
            )
            self._progress.start()

    def update(self, completed: int, stats: Mapping[str, float]) -> str:
        """Record that ``completed`` steps are done (``global_step + 1``); returns the line."""
        now = self._clock()
        step_secs, self._last = now - self._last, now
        measured = stats.get(self.step_key)
        if isinstance(measured, int | float) and measured > 0:
            step_secs = float(measured)
        self._elapsed += step_secs
        parts = [f"step {completed}/{self.total_steps}"]
        reward = next((stats[k] for k in self.reward_keys if k in stats), None)
        if reward is not None:
            parts.append(f"reward {reward:.3f}")
        if self.token_key in stats and step_secs > 0:
            parts.append(f"{stats[self.token_key] / step_secs:,.0f} tok/s")
        elif self.sample_key in stats and step_secs > 0:
            parts.append(f"{stats[self.sample_key] * 60 / step_secs:,.1f} samples/min")
        steps_run = completed - self.start_step
        if steps_run > 0:
            eta = self._elapsed / steps_run * max(self.total_steps - completed, 0)
            parts.append(f"ETA {_format_secs(eta)}")
        line = " | ".join(parts)
        if self._progress is not None:
            self._progress.update(self._task, completed=completed, info=" | ".join(parts[1:]))
        else:
            logger.info("%s", line)
        return line

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def __enter__(self) -> ProgressDisplay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _step_of(line: str) -> float:
    """The ``global_step`` of a JSONL row; a torn or foreign line sorts last (dropped)."""
    try:
        return float(json.loads(line)["global_step"])
    except (ValueError, KeyError, TypeError):
        return math.inf


def _format_secs(secs: float) -> str:
    hours, rest = divmod(round(secs), 3600)
    minutes, seconds = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{seconds:02d}" if hours else f"{minutes}:{seconds:02d}"
