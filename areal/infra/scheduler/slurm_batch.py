"""Batch scripts for Slurm workers: resource math, worker environment, quoting.

Everything here is a pure function of a ``SchedulingSpec`` and a few settings, so the
generated text can be unit-tested without a cluster. One role is one batch job whose
single ``srun`` step starts every replica (the worker index is ``$SLURM_PROCID``)::

    srun [resources] [srun_additional_args] CONTAINER exec [flags] IMAGE bash -c 'INNER'

Quoting rules (every value in the script is quoted; expansion happens only on purpose):

* Environment values, ``srun_additional_args`` tokens and ``cmd`` tokens are literal,
  except ``$NAME`` / ``${NAME}``, which expand on the worker (``$$`` is a literal ``$``).
  ``$(...)``, backticks, globs, spaces and quotes never do anything.
* Literal environment values travel as ``--env NAME=VALUE`` container flags. Values that
  reference a variable, or hold a comma (which ``apptainer --env`` would split), are
  exported inside the container instead, so an expanded credential is never on a
  command line. With ``container_type: none`` every value is exported that way.
* ``additional_bash_cmds`` are shell commands by definition and run verbatim, inside
  the container, before the worker command.
* Secrets (the RPC token, ``SecretStr`` environment values) never enter the script: it
  sources a mode-0600 file written by the scheduler and deletes it at job start.

When the controller itself runs in a Slurm job, the worker job records that job
(``--comment=areal-controller=ID``) and its script runs a watcher beside the step that
cancels the worker job once the controller's job is over, so a killed controller does
not leave its workers holding nodes until their time limit.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from areal.api.cli_args import SchedulingSpec
from areal.api.config.scheduling import RPC_SERVER_CMD
from areal.infra.rpc.secret_env import secrets_file_text
from areal.infra.scheduler.exceptions import WorkerConfigurationError
from areal.infra.scheduler.node_layout import gpu_nodes
from areal.utils.secrets import SecretStr

__all__ = [
    "CONTROLLER_COMMENT",
    "CONTROLLER_ENDED_STATES",
    "THREAD_VARS",
    "BatchJob",
    "SlurmResources",
    "batch_script",
    "binds",
    "container_command",
    "controller_watcher",
    "gpu_selection",
    "inner_command",
    "memory_saver_env",
    "plan_resources",
    "sbatch_options",
    "secrets_file_text",
    "shell_word",
    "split_env",
    "srun_command",
    "worker_env",
]

THREAD_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)

# A worker job's --comment: the Slurm job id of the controller that submitted it.
CONTROLLER_COMMENT = "areal-controller="
# squeue states of a controller job that is over or ending; its worker jobs go with it.
CONTROLLER_ENDED_STATES = (
    "COMPLETED",
    "COMPLETING",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
)

# $$ (a literal dollar), ${NAME}, $NAME; anything else is literal text
_TOKEN = re.compile(r"\$\$|\$\{([A-Za-z_]\w*)\}|\$([A-Za-z_]\w*)")
_PLAIN = re.compile(r"[\w@%+=:,./-]+")
_ENV_NAME = re.compile(r"[A-Za-z_]\w*")


# --- resources ---


@dataclass(frozen=True)
class SlurmResources:
    """What one role's batch job asks for (sizes in MB)."""

    nodes: int
    ntasks: int
    ntasks_per_node: int
    cpus_per_task: int
    mem_per_task_mb: int  # 0: the cluster's default (DefMemPerCPU)
    gpus_per_task: int  # GPUs each worker addresses (for CUDA_VISIBLE_DEVICES)
    gres_gpus_per_node: int  # 0: no --gres (CPU roles, roles pinned to another's nodes)
    nodelist: str | None = None
    exclude: str | None = None
    reservation: str | None = None
    exclusive: bool = False

    @property
    def cpus_per_node(self) -> int:
        return self.cpus_per_task * self.ntasks_per_node

    @property
    def mem_per_node_mb(self) -> int:
        return self.mem_per_task_mb * self.ntasks_per_node

    @property
    def mem_per_cpu_mb(self) -> int:
        return max(1, self.mem_per_task_mb // self.cpus_per_task)


def plan_resources(
    spec: SchedulingSpec,
    replicas: int,
    n_gpus_per_node: int,
    role: str,
    pinned_nodes: Sequence[str] | None = None,
) -> SlurmResources:
    """Nodes, tasks, CPUs, memory and GPUs for ``replicas`` workers of ``spec``.

    GPU roles take ``ceil(gpu x replicas / n_gpus_per_node)`` nodes with the replicas
    spread evenly; CPU roles run on one node. A role pinned to another role's nodes
    (colocation with a different replica count) asks for no GPUs of its own.
    """
    cpus = max(1, spec.cpu)
    mem = spec.mem * 1024
    if pinned_nodes:
        nodes = len(pinned_nodes)
        if replicas % nodes:
            raise WorkerConfigurationError(
                f"role {role!r}: {replicas} replicas cannot be spread evenly over the "
                f"{nodes} nodes of the role it is colocated with"
            )
        return SlurmResources(
            nodes=nodes,
            ntasks=replicas,
            ntasks_per_node=replicas // nodes,
            cpus_per_task=cpus,
            mem_per_task_mb=mem,
            gpus_per_task=0,
            gres_gpus_per_node=0,
            nodelist=",".join(pinned_nodes),
            exclude=None,
            reservation=spec.reservation,
            exclusive=False,
        )
    gres = 0
    nodes = 1
    if spec.gpu > 0:
        nodes = gpu_nodes(role, spec.gpu, replicas, n_gpus_per_node)
        gres = spec.gpu * (replicas // nodes)
    return SlurmResources(
        nodes=nodes,
        ntasks=replicas,
        ntasks_per_node=replicas // nodes,
        cpus_per_task=cpus,
        mem_per_task_mb=mem,
        gpus_per_task=spec.gpu,
        gres_gpus_per_node=gres,
        nodelist=spec.nodelist or None,
        exclude=spec.exclude or None,
        reservation=spec.reservation or None,
        exclusive=spec.exclusive,
    )


# --- environment ---


def worker_env(
    spec: SchedulingSpec,
    *,
    cpus_per_task: int,
    python_path: str,
    enable_offload: bool = False,
    controller_env: Mapping[str, str] | None = None,
    user: str = "areal",
) -> dict[str, str]:
    """The variables a worker gets on top of the exported submit environment.

    Base variables (caches, ``PYTHONPATH`` = controller's cwd + ``sys.path``), memory-saver
    variables when offloading, thread counts = ``cpus_per_task`` unless the controller's
    environment sets them, then the spec's ``env_vars``, which win over everything.
    """
    controller_env = os.environ if controller_env is None else controller_env
    cache = controller_env.get("AREAL_CACHE_DIR") or f"/tmp/areal-{user}"
    env = {
        "TOKENIZERS_PARALLELISM": "true",
        "PYTORCH_KERNEL_CACHE_PATH": f"{cache}/torch/kernels",
        "TRITON_CACHE_DIR": f"{cache}/triton",
        "VLLM_CACHE_ROOT": f"{cache}/vllm",
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        "PYTHONUNBUFFERED": "1",
        "PYTHONPATH": python_path,
    }
    if enable_offload:
        env.update(memory_saver_env())
    for name in THREAD_VARS:
        if name not in controller_env:
            env[name] = str(cpus_per_task)
    for key, value in (spec.env_vars or {}).items():
        if not _ENV_NAME.fullmatch(str(key)):
            raise WorkerConfigurationError(f"env_vars: {key!r} is not a valid variable name")
        env[str(key)] = value if isinstance(value, SecretStr) else str(value)
    return env


def memory_saver_env() -> dict[str, str]:
    """torch_memory_saver's switches, plus its preload library when installed here."""
    env = {"TMS_INIT_ENABLE": "1", "TMS_INIT_ENABLE_CPU_BACKUP": "1"}
    found = importlib.util.find_spec("torch_memory_saver")
    if found is not None and found.origin:
        site = Path(found.origin).parent.parent
        libs = sorted(site.glob("torch_memory_saver_hook_mode_preload*.so"))
        if libs:
            env["LD_PRELOAD"] = str(libs[0])
    return env


def split_env(
    env: Mapping[str, str], container_type: str
) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """``(flags, exports, secrets)``: values for ``--env`` flags, for ``export`` lines
    inside the container, and for the mode-0600 secrets file."""
    flags: dict[str, str] = {}
    exports: dict[str, str] = {}
    secrets: dict[str, str] = {}
    for key, value in env.items():
        if isinstance(value, SecretStr):
            secrets[key] = value.reveal()
        elif container_type == "none" or _needs_export(value):
            exports[key] = value
        else:
            flags[key] = value
    return flags, exports, secrets


def _needs_export(value: str) -> bool:
    # a reference must expand on the worker; commas and newlines break `apptainer --env`
    return "$" in value or "," in value or "\n" in value


# --- quoting ---


def shell_word(value: str) -> str:
    """``value`` as one shell word: literal, except ``$NAME``/``${NAME}`` expand.

    ``a b`` becomes ``'a b'``; ``$HOME/x $(id)`` becomes ``"${HOME}/x \\$(id)"`` (the
    reference expands, the command substitution stays text); ``$$`` is a literal ``$``.
    """
    if "$" not in value:
        return shlex.quote(value)
    out = ['"']
    pos = 0
    for m in _TOKEN.finditer(value):
        out.append(_escape_double(value[pos : m.start()]))
        name = m.group(1) or m.group(2)
        out.append("\\$" if name is None else "${" + name + "}")
        pos = m.end()
    out.append(_escape_double(value[pos:]))
    out.append('"')
    return "".join(out)


def _escape_double(text: str) -> str:
    """Text inside double quotes with no special meaning left."""
    return re.sub(r'([\\"$`])', r"\\\1", text)


def _sbatch_value(value: str, what: str) -> str:
    if _PLAIN.fullmatch(value):
        return value
    if '"' in value or "\n" in value:
        raise WorkerConfigurationError(f"{what} {value!r}: quotes and newlines are not allowed")
    return f'"{value}"'


# --- script parts ---


@dataclass(frozen=True)
class BatchJob:
    """Everything one role's batch script is made of."""

    role: str
    job_name: str
    resources: SlurmResources
    spec: SchedulingSpec
    env: Mapping[str, str]
    worker_flags: Sequence[str]  # --experiment-name ... (no --worker-index)
    container_bin: Sequence[str]
    log_dir: Path
    secrets_file: Path | None = None
    controller_job: str | None = None  # the controller's own Slurm job id: end with it
    controller_poll: float = 10.0  # seconds between the watcher's squeue calls

    @property
    def role_log(self) -> Path:
        return self.log_dir / f"{self.role}.log"

    @property
    def merged_log(self) -> Path:
        return self.log_dir / "merged.log"


def gpu_selection(gpus_per_task: int) -> list[str]:
    """Shell lines giving worker ``$SLURM_LOCALID`` its slice of the node's GPUs.

    Slices the GPUs Slurm assigned to the step (``$CUDA_VISIBLE_DEVICES``), or
    ``0..n-1`` when Slurm set none, and mirrors the result for Ascend NPUs.
    """
    g = gpus_per_task
    return [
        'IFS=, read -r -a _areal_gpus <<< "${CUDA_VISIBLE_DEVICES:-}"',
        "if [ ${#_areal_gpus[@]} -eq 0 ]; then "
        f"_areal_gpus=($(seq 0 $(( (SLURM_LOCALID + 1) * {g} - 1 )))); fi",
        'export CUDA_VISIBLE_DEVICES="$(IFS=,; echo '
        f'"${{_areal_gpus[*]:$(( SLURM_LOCALID * {g} )):{g}}}")"',
        'export ASCEND_RT_VISIBLE_DEVICES="$CUDA_VISIBLE_DEVICES"',
    ]


def inner_command(job: BatchJob, exports: Mapping[str, str]) -> str:
    """The shell text the worker's ``bash -c`` runs (inside the container)."""
    lines: list[str] = []
    if job.resources.gres_gpus_per_node > 0 and job.resources.gpus_per_task > 0:
        lines += gpu_selection(job.resources.gpus_per_task)
    lines += [f"export {key}={shell_word(value)}" for key, value in exports.items()]
    lines += list(job.spec.additional_bash_cmds or [])
    cmd = shlex.split(job.spec.cmd or RPC_SERVER_CMD)
    words = [shell_word(w) for w in cmd] + [shlex.quote(f) for f in job.worker_flags]
    lines.append("exec " + " ".join(words))
    return "\n".join(lines)


def container_command(job: BatchJob, flags: Mapping[str, str], inner: str) -> list[str]:
    """The step's command as shell words: the container (or plain ``bash``) around ``inner``."""
    bash = ["bash -c", shlex.quote(inner)]
    if job.spec.container_type == "none":
        return bash
    words = [shlex.quote(w) for w in job.container_bin]
    words += ["exec", "--no-home", "--writable-tmpfs"]
    if job.spec.gpu > 0:
        words.append("--nv")
    # a flag and its value stay one item so the script wraps between pairs
    words += [f"--bind {shlex.quote(bind)}" for bind in binds(job.spec.mount)]
    words += [f"--env {shlex.quote(f'{key}={value}')}" for key, value in flags.items()]
    words.append(shlex.quote(job.spec.image))
    return words + bash


def binds(mount: str | None) -> list[str]:
    """``src:dst[:opts]`` entries of a comma-separated ``mount`` string."""
    return [m.strip() for m in (mount or "").split(",") if m.strip()]


def srun_command(job: BatchJob, step: Sequence[str]) -> list[str]:
    r = job.resources
    words = [
        "srun",
        "--label",
        f"--nodes={r.nodes}",
        f"--ntasks={r.ntasks}",
        f"--cpus-per-task={r.cpus_per_task}",
    ]
    if r.mem_per_task_mb > 0:
        words.append(f"--mem-per-cpu={r.mem_per_cpu_mb}M")
    if r.gres_gpus_per_node > 0:
        words.append(f"--gres=gpu:{r.gres_gpus_per_node}")
    words += [shell_word(a) for a in shlex.split(job.spec.srun_additional_args or "")]
    return words + list(step)


def sbatch_options(job: BatchJob) -> list[str]:
    r = job.resources
    options = [
        f"--job-name={_sbatch_value(job.job_name, 'job name')}",
        f"--output={_sbatch_value(str(job.role_log), 'log path')}",
        "--open-mode=append",
        "--no-requeue",
        f"--nodes={r.nodes}",
        f"--ntasks-per-node={r.ntasks_per_node}",
        f"--cpus-per-task={r.cpus_per_task}",
    ]
    if r.mem_per_task_mb > 0:
        options.append(f"--mem={r.mem_per_node_mb}M")
    if r.gres_gpus_per_node > 0:
        options.append(f"--gres=gpu:{r.gres_gpus_per_node}")
    for name in ("nodelist", "exclude", "reservation"):
        value = getattr(r, name)
        if value:
            options.append(f"--{name}={_sbatch_value(value, name)}")
    if r.exclusive:
        options.append("--exclusive")
    if job.controller_job is not None:
        comment = CONTROLLER_COMMENT + job.controller_job
        options.append(f"--comment={_sbatch_value(comment, 'controller job')}")
    return options


def controller_watcher(job_id: str, poll: float) -> list[str]:
    """Shell lines starting a background watcher that cancels this job (``scancel``, so
    SIGTERM: workers shut down in order) once the controller's job ``job_id`` is over.

    The job is over when squeue no longer knows it ("Invalid job id", or no line) or
    lists it in one of ``CONTROLLER_ENDED_STATES``. Any other squeue failure (slurmctld
    busy or unreachable) says nothing about the controller: the watcher keeps polling.
    The watcher's pid is in ``$_areal_watcher``.
    """
    if not job_id.isdigit():  # it is written into the script unquoted
        raise WorkerConfigurationError(f"controller job id {job_id!r} is not a number")
    ended = "|".join(CONTROLLER_ENDED_STATES)
    return [
        f"# End with the controller: cancel this job once its Slurm job {job_id} is over.",
        "_areal_watch_controller() {",
        "    local out state",
        f"    while sleep {poll:g}; do",
        f"        if out=$(squeue -h -j {job_id} -o %T 2>&1); then",
        '            read -r state <<< "$out"',
        "        elif [[ \"$out\" == *'Invalid job id'* ]]; then",
        "            state=''",
        "        else",
        "            continue  # no answer from slurmctld: the controller may well be alive",
        "        fi",
        '        case "$state" in',
        f"            ''|{ended}) ;;",
        "            *) continue ;;",
        "        esac",
        f'        echo "controller job {job_id} has ended '
        '(${state:-no longer in the queue}); cancelling this worker job"',
        '        scancel "$SLURM_JOB_ID"',
        "        return",
        "    done",
        "}",
        "_areal_watch_controller &",
        "_areal_watcher=$!",
    ]


def _sed_prefix(role: str) -> str:
    """sed program turning srun's ``N: line`` labels into ``[role/N] line``."""
    safe = re.sub(r"([\\&#])", r"\\\1", role)
    return f"s#^ *\\([0-9][0-9]*\\): #[{safe}/\\1] #"


def batch_script(job: BatchJob) -> str:
    """The complete sbatch script for ``job`` (contains no secret)."""
    flags, exports, _ = split_env(job.env, job.spec.container_type)
    step = container_command(job, flags, inner_command(job, exports))
    srun = srun_command(job, step)
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in sbatch_options(job))]
    lines += [
        f"# Workers of role {job.role}, generated by areal's SlurmScheduler. Values are",
        "# quoted; $NAME in env values and srun args expands on the worker on purpose.",
        "set -o pipefail",
    ]
    if job.secrets_file is not None:
        path = shlex.quote(str(job.secrets_file))
        lines += [
            "# Secrets (the RPC token) come from a mode-0600 file, removed once read.",
            f"source {path} || exit 1",
            f"rm -f {path}",
        ]
    pipe = [
        "2>&1",
        "|",
        "tee",
        "-a",
        shlex.quote(str(job.role_log)),
        "|",
        "sed",
        "-u",
        shlex.quote(_sed_prefix(job.role)),
        ">>",
        shlex.quote(str(job.merged_log)),
    ]
    watched = job.controller_job is not None
    if watched:
        lines += controller_watcher(job.controller_job, job.controller_poll)
    lines.append(" \\\n    ".join(_wrap([*srun, *pipe])))
    if watched:
        lines += [
            "_areal_status=$?",
            'kill "$_areal_watcher" 2>/dev/null',
            'exit "$_areal_status"',
        ]
    return "\n".join(lines) + "\n"


def _wrap(words: list[str], width: int = 88) -> list[str]:
    """Group shell words into lines of about ``width`` characters."""
    out: list[str] = []
    line = ""
    for w in words:
        if line and len(line) + 1 + len(w) > width:
            out.append(line)
            line = w
        else:
            line = f"{line} {w}" if line else w
    if line:
        out.append(line)
    return out
