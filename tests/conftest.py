"""Suite-wide settings: offline hub, the skip policy, and a fake environment for profiles."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("NO_COLOR", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
SWE_DIR = REPO_ROOT / "examples" / "swe"

# Sentinel secret planted by tests; it must never appear in any saved or printed output.
SECRET_SENTINEL = "sentinel-secret-7f3a9c1e"


@pytest.fixture
def profile_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment the Arena YAML profiles need, with a planted admin-key sentinel."""
    env = {
        "AREAL_FILEROOT": str(tmp_path / "fileroot"),
        "SWE_RL_ADMIN_API_KEY": SECRET_SENTINEL,
        "MODEL_PATH": "/shared/models/qwen3-4b",
        "AREAL_IMAGE": "/shared/images/areal.sif",
        "AREAL_PYTHON": "/opt/venv/bin/python",
        "AREAL_DIR": "/shared/src/areal",
        "ARENA_OPENAPI_BASE": "https://arena.example.test",
        "ROLLOUT_IMAGE": "/shared/images/sglang.sif",
        "FLASH_LINEAR_ATTENTION_ROOT": "/shared/src/fla",
        "AWEX_ROOT": "/shared/src/awex",
        "DATASET_CONFIG": str(SWE_DIR / "dataset_configs" / "flash-v3-multi-stream.yaml"),
    }
    for name in (
        "TRIAL_NAME",
        "ARENA_STREAM_ID",
        "EXPERIMENT_NAME",
        "RANK",
        "TOTAL_TRAIN_EPOCHS",
        "TOTAL_TRAIN_STEPS",
        "N_SAMPLES",
        "MAX_NEW_TOKENS",
        "MAX_TOKENS",
        "ROLLOUT_BACKEND",
        "MAX_CONCURRENT_ROLLOUTS",
        "ROLLOUT_RUNTIME_PYTHONPATH",
        "ACTOR_RUNTIME_PYTHONPATH",
        "AWEX_COLOCATE_TIMEOUT_S",
        "ARENA_PROXY_IDLE_TIMEOUT",
        "ARENA_TASK_TIMEOUT",
        "ACTOR_BACKEND",
        "ACTOR_N_MBS",
        "ACTOR_MAX_TOKENS_PER_MB",
        "ACTOR_N_MBS_DIVISOR",
        "ACTOR_LR",
        "ARENA_LLM_ROUTE_MODE",
        "ARENA_TASK_WAIT_TIMEOUT",
        "ARENA_MIXTURE_EPOCH_SIZE",
        "CONTEXT_LENGTH",
        "SGLANG_ATTENTION_BACKEND",
        "SGLANG_MAX_PREFILL_TOKENS",
        "SGLANG_CHUNKED_PREFILL_SIZE",
        "SGLANG_MAX_RUNNING_REQUESTS",
        "SGLANG_MEM_FRACTION_STATIC",
        "SGLANG_DISABLE_CUDA_GRAPH",
        "TRAIN_BATCH_SIZE",
        "ARENA_DATASET_SHUFFLE",
        "N_NODES",
    ):
        monkeypatch.delenv(name, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


@pytest.fixture
def areal_logs(caplog: pytest.LogCaptureFixture):
    """caplog for the ``areal`` loggers (which do not propagate to the root logger)."""
    import logging

    from areal.utils import logging as areal_logging

    root = areal_logging.getLogger()
    root.addHandler(caplog.handler)
    caplog.set_level(logging.DEBUG, logger="areal")
    try:
        yield caplog
    finally:
        root.removeHandler(caplog.handler)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 model with a BPE tokenizer, built offline once per session."""
    from areal.utils.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3"), seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_b(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same architecture with other random weights (a 'new checkpoint')."""
    from areal.utils.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-b"), seed=1)


@pytest.fixture(scope="session")
def ling3_tokenizer():
    """A BPE tokenizer in the Ling 3 chat format (``<role>``, ``<|role_end|>``, tool-call
    and think tags), built offline once per session."""
    from areal.utils.tiny_model import build_ling3_tokenizer

    return build_ling3_tokenizer()


@pytest.fixture(scope="session")
def ling3_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen3 model over the Ling 3 tokenizer's vocabulary, with that
    tokenizer and chat template (for runs that generate or train in the Ling 3 format)."""
    from areal.utils.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-ling3"), seed=0, tokenizer="ling3")


@pytest.fixture(scope="session")
def bailing_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Ling 3 (``BailingMoeV3ForCausalLM``) checkpoint: 2 KDA + 2 MLA layers,
    grouped-router MoE, the Ling 3 tokenizer, official config and weight names."""
    from areal.utils.tiny_bailing import build_tiny_bailing_model

    return build_tiny_bailing_model(tmp_path_factory.mktemp("tiny-bailing"), seed=0)


@pytest.fixture(scope="session")
def bailing_tool_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Ling 3 checkpoint of ``bailing_model_dir``, fine-tuned offline (under a
    minute on CPU) to answer claude-code Harness prompts with a Ling 3 ``submit`` call of 1
    to 4 random digits: a random model never writes a tool call, so end-to-end runs over
    Arena tool tasks need this one to show parsed calls and rewards that differ."""
    from areal.utils.tiny_bailing import build_tool_calling_bailing_model

    return build_tool_calling_bailing_model(tmp_path_factory.mktemp("tiny-bailing-tools"), seed=0)


# Fixtures and hooks defined elsewhere: a local Arena server process on loopback (for the
# submit scripts' Slurm tests); GPU tests skip without CUDA, and with CI set any other skip
# fails (see tests/skip_policy.py); one single-node Slurm cluster per session, for every
# module marked `slurm`.
from tests.helpers.slurm_jobs import local_arena  # noqa: E402, F401
from tests.skip_policy import (  # noqa: E402, F401
    pytest_collection_modifyitems,
    pytest_make_collect_report,
    pytest_runtest_makereport,
)
from tests.slurm_cluster import slurm_cluster  # noqa: E402, F401
