"""Running launched tasks: harness, then grader, then the stored result.

Each launch becomes an asyncio task (at most ``max_concurrent`` run at once; the rest wait
as ``PENDING``). A task runs its harness under a deadline, grades the answer in a worker
thread, and writes the result envelope. Outcomes map to Arena statuses:

==========================  ==================  ==============================
what happened               status              ``raw``
==========================  ==================  ==============================
graded                      ``DONE``            answer, turns, grade detail
harness raised              ``HARNESS_FAILED``  ``error``
no answer                   ``NO_OUTPUT``       turns, transcript
deadline passed             ``TIMEOUT``         ``error``
grader raised               ``EVAL_FAILED``     ``error``
fault injection             forced status       ``error`` naming the fault
==========================  ==================  ==============================

A harness that raises :class:`~examples.swe.local_arena.harnesses.results.HarnessResultError`
adds its result fields to ``raw`` (a GameAgent outcome code, a receipt). A
``fail_after_harness`` fault of ``HARNESS_FAILED:<format>`` ends the task with that result
format (:data:`~examples.swe.local_arena.harnesses.results.FAILURE_FORMATS`; plain
``HARNESS_FAILED`` is the ``claude`` format) and ``fault_injection: true`` in ``raw``.

Artifacts (the answer and the transcript) go to ``{artifacts}/tasks/{task_id}/``, whose
``file://`` URI is the result's ``artifacts_uri``.

:meth:`TaskRunner.stop` (server shutdown) cancels the running tasks, which are then
recorded as interrupted, and kills every child process they started (harness tools and
CLIs, grader programs, also those run from worker threads), so a stop never waits for a
harness or grader timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from areal.utils import logging
from examples.swe.local_arena import sandbox
from examples.swe.local_arena.faults import FaultConfig
from examples.swe.local_arena.store import Store, TaskRecord, utc_now
from examples.swe.local_arena.types import (
    DatasetRow,
    GraderError,
    HarnessError,
    HarnessOutput,
    HarnessRun,
    HarnessSpec,
    RewardSpec,
    StreamSpec,
)

__all__ = ["Launch", "TaskRunner"]

logger = logging.getLogger("local_arena.tasks")

RAW_TEXT_LIMIT = 4000
CLOSE_WAIT_S = 3.0  # how long close() waits for cancelled tasks to unwind


@dataclass
class Launch:
    """A validated launch request (secrets stay in memory only)."""

    stream: StreamSpec
    row: DatasetRow
    harness: HarnessSpec
    reward: RewardSpec
    model_name: str
    base_url: str
    api_key: str
    envs: dict[str, str] = field(default_factory=dict)
    session_id: str = ""


def _clip(text: str | None, limit: int = RAW_TEXT_LIMIT) -> str | None:
    if text is None or len(text) <= limit:
        return text
    return text[:limit] + f"... [{len(text) - limit} more characters]"


def _redact(text: str, launch: Launch) -> str:
    """``text`` without the launch key or any secret-looking env value (or header line).

    Values are compared stripped of surrounding whitespace: a key sent with a trailing
    newline shows up bare (or escaped) in error texts.
    """
    secrets = [launch.api_key]
    for name, value in launch.envs.items():
        if any(word in name.upper() for word in ("KEY", "TOKEN", "SECRET", "HEADERS")):
            secrets += [value, *(line.partition(":")[2] for line in value.splitlines())]
    stripped = {s.strip() for s in secrets}
    for secret in sorted({s for s in stripped if len(s) >= 4}, key=len, reverse=True):
        text = text.replace(secret, "[redacted]")
    return text


class TaskRunner:
    def __init__(
        self,
        store: Store,
        artifacts: Path,
        faults: Callable[[], FaultConfig],
        task_timeout: float = 600.0,
        max_concurrent: int = 64,
    ):
        self.store = store
        self.artifacts = artifacts
        self.faults = faults
        self.task_timeout = task_timeout
        self.slots = asyncio.Semaphore(max_concurrent)
        self.running: dict[str, asyncio.Task] = {}
        self.children = sandbox.ProcessGroups()  # every child process a task started

    def launch(self, launch: Launch) -> TaskRecord:
        task_id = f"task-{uuid.uuid4().hex}"
        now = utc_now()
        record = TaskRecord(
            task_id=task_id,
            stream_id=launch.stream.stream_id,
            data_id=launch.row.data_id,
            harness_key=launch.harness.key,
            harness_version=launch.harness.version,
            reward_key=launch.reward.key,
            reward_version=launch.reward.version,
            model_name=launch.model_name,
            session_id=launch.session_id,
            status="PENDING",
            score=None,
            raw=None,
            artifacts_uri=None,
            trace_id=uuid.uuid4().hex,
            computed_at=None,
            created_at=now,
            updated_at=now,
        )
        self.store.add_task(record)
        task = asyncio.create_task(self._run(record, launch), name=task_id)
        self.running[task_id] = task
        task.add_done_callback(lambda _: self.running.pop(task_id, None))
        return record

    def kill_children(self) -> int:
        """SIGKILL every child process of every task, now and from now on (thread-safe)."""
        return self.children.kill_all()

    def stop(self) -> int:
        """Cancel every running task, then kill their children (in the loop's thread).

        Cancelling first matters: a task whose harness or grader died under it would
        otherwise record that as its outcome; cancelled, it is recorded as interrupted.
        Returns how many child process groups were killed.
        """
        for task in list(self.running.values()):
            task.cancel()
        return self.kill_children()

    async def close(self) -> None:
        """Stop every task (see :meth:`stop`); they are recorded as interrupted
        (``SETUP_FAILED``). Returns within about :data:`CLOSE_WAIT_S` seconds."""
        tasks = list(self.running.values())
        killed = self.stop()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=CLOSE_WAIT_S)
            if stuck or killed:
                logger.warning(
                    "stopping: killed %d child process group(s); %d task(s) still unwinding",
                    killed,
                    len(stuck),
                )
        self.store.fail_interrupted()

    async def _run(self, record: TaskRecord, launch: Launch) -> None:
        sandbox.owned_by(self.children)  # this task's context and the threads it starts
        async with self.slots:
            self.store.set_status(record.task_id, "RUNNING")
            status, score, raw = await self._outcome(record, launch)
        workdir = self.artifacts / "tasks" / record.task_id
        self.store.finish_task(
            record.task_id,
            status,
            score,
            raw,
            artifacts_uri=workdir.resolve().as_uri() if workdir.exists() else None,
            trace_id=record.trace_id,
        )
        logger.info(
            "task %s (%s/%s): %s %s",
            record.task_id,
            record.stream_id,
            record.data_id,
            status,
            "" if score is None else f"score {score:g}",
        )

    async def _outcome(
        self, record: TaskRecord, launch: Launch
    ) -> tuple[str, float | None, dict[str, Any]]:
        forced = self.faults().forced_status(launch.stream.stream_id, launch.row.data_id)
        base = {"harness": str(launch.harness.ref), "reward": str(launch.reward.ref)}
        if forced is not None:
            score = 0.0 if forced in ("DONE", "OK") else None
            return forced, score, {**base, "error": f"status {forced} forced by fault injection"}
        workdir = self.artifacts / "tasks" / record.task_id / "work"
        workdir.mkdir(parents=True, exist_ok=True)
        timeout = float(launch.harness.options.get("timeout", self.task_timeout))
        run = HarnessRun(
            task_id=record.task_id,
            prompt=launch.row.prompt,
            row=dataclasses.replace(launch.row, grading={}),  # the answer key stays here
            model=launch.model_name,
            base_url=launch.base_url,
            api_key=launch.api_key,
            envs=dict(launch.envs),
            workdir=workdir,
            timeout=timeout,
            session_id=launch.session_id,
            env_seconds=self.faults().env_latency_ms / 1000,
        )
        from examples.swe.local_arena.graders import grade
        from examples.swe.local_arena.harnesses import run_harness
        from examples.swe.local_arena.harnesses.results import HarnessResultError, failure_fields

        try:
            output = await asyncio.wait_for(run_harness(launch.harness, run), timeout)
        except TimeoutError:
            return "TIMEOUT", None, {**base, "error": f"the harness ran past {timeout:g}s"}
        except HarnessError as e:
            fields = e.fields if isinstance(e, HarnessResultError) else {}
            return "HARNESS_FAILED", None, {**base, **fields, "error": _redact(str(e), launch)}
        except Exception as e:  # a bug in a harness is still a harness failure
            logger.exception("harness %s crashed on task %s", launch.harness.ref, record.task_id)
            return (
                "HARNESS_FAILED",
                None,
                {**base, "error": _redact(f"{type(e).__name__}: {e}", launch)},
            )
        self._save_artifacts(workdir.parent, output)
        details = {
            **base,
            "answer": _clip(output.answer),
            "turns": output.turns,
            "transcript": output.transcript[-20:],
        }
        failed = self.faults().status_after_harness(launch.stream.stream_id, launch.row.data_id)
        if failed is not None:
            status, _, fmt = failed.partition(":")
            if status == "HARNESS_FAILED":
                fields = failure_fields(fmt or "claude", str(launch.harness.ref))
                return status, None, {**details, **fields, "fault_injection": True}
            return status, None, {**details, "error": f"status {status} forced (fault injection)"}
        if not (output.answer or "").strip():
            return "NO_OUTPUT", None, {**details, "error": "the harness produced no answer"}
        try:
            result = await asyncio.to_thread(grade, launch.reward, launch.row, output.answer)
        except GraderError as e:
            return "EVAL_FAILED", None, {**details, "error": str(e)}
        except Exception as e:
            logger.exception("grader %s crashed on task %s", launch.reward.ref, record.task_id)
            return "EVAL_FAILED", None, {**details, "error": f"{type(e).__name__}: {e}"}
        return "DONE", float(result.score), {**details, "grade": result.detail}

    @staticmethod
    def _save_artifacts(directory: Path, output: HarnessOutput) -> None:
        (directory / "answer.txt").write_text(output.answer or "")
        (directory / "transcript.json").write_text(json.dumps(output.transcript, default=str))
