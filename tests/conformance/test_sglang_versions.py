"""The tested SGLang range is one fact: the tier's versions, the constants, pyproject's extra.

Also: each version runs from its own cache directory ahead of the venv (which stays free of
SGLang), with the kernel stand-in and the venv's own torch; the installer is cached; and the
version handling of ``SGLangConfig.build_args`` (range check, renamed CUDA-graph flags).
"""

from __future__ import annotations

import importlib.util
import os
import tomllib
from pathlib import Path

import pytest

from areal.api.cli_args import SGLangConfig
from areal.api.config import inference
from areal.api.config.inference import MAX_SGLANG_VERSION, MIN_SGLANG_VERSION
from areal.utils.network import find_free_port
from tests.conformance.install_sglang import (
    CACHE_DIR,
    REPO_ROOT,
    VERSIONS,
    IndexUnreachableError,
    SGLangSite,
    ensure_installed,
)
from tests.conformance.worker_client import SGLangWorker

pytestmark = pytest.mark.sglang


def test_tier_versions_are_the_supported_range_and_pyproject_states_it():
    assert VERSIONS == (MIN_SGLANG_VERSION, MAX_SGLANG_VERSION)
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    extra = pyproject["project"]["optional-dependencies"]["sglang"]
    assert extra == [f"sglang>={MIN_SGLANG_VERSION},<={MAX_SGLANG_VERSION}"]


def test_each_version_runs_from_its_own_directory_ahead_of_the_venv(sglang: SGLangWorker):
    info = sglang.call("info")
    own = CACHE_DIR / sglang.version
    assert info["sglang_version"] == sglang.version
    assert Path(info["sglang_file"]).is_relative_to(own)
    assert Path(info["sys_path_head"][0]) == own
    # the venv's torch, not one from the cache (nothing installed there shadows the venv)
    assert Path(info["torch_file"]).is_relative_to(REPO_ROOT / ".venv")
    assert info["kernel_standin"] is True
    assert Path(info["kernel_file"]).is_relative_to(own)


def test_the_venv_has_no_sglang():
    assert importlib.util.find_spec("sglang") is None
    assert importlib.util.find_spec("sgl_kernel") is None


def test_installer_second_run_downloads_nothing(sglang_sites: dict[str, SGLangSite]):
    lines: list[str] = []
    again = ensure_installed(log=lines.append)
    assert all(site.downloaded_mb == 0 for site in again.values())
    assert sum("cached" in line for line in lines) == len(VERSIONS) + 1  # + the torch-tied dir


def test_build_args_refuses_older_and_warns_once_about_newer(monkeypatch: pytest.MonkeyPatch):
    warnings: list[str] = []
    monkeypatch.setattr(inference.ConfigNode, "warn", staticmethod(warnings.append))
    monkeypatch.setattr(inference, "_warned_newer", set())
    config = SGLangConfig(model_path="/m")
    with pytest.raises(RuntimeError, match=f"needs sglang >= {MIN_SGLANG_VERSION}"):
        SGLangConfig.build_args(config, tp_size=1, base_gpu_id=0, sglang_version="0.5.9")
    for version in VERSIONS:
        SGLangConfig.build_args(config, tp_size=1, base_gpu_id=0, sglang_version=version)
    assert warnings == []
    for _ in range(2):
        SGLangConfig.build_args(config, tp_size=1, base_gpu_id=0, sglang_version="0.6.0")
    assert len(warnings) == 1
    assert "0.6.0 is newer" in warnings[0] and MAX_SGLANG_VERSION in warnings[0]


@pytest.mark.parametrize(
    ("version", "spelling"),
    [
        ("0.5.10.post1", ("cuda_graph_max_bs", "cuda_graph_bs")),
        ("0.5.13.post1", ("cuda_graph_max_bs", "cuda_graph_bs")),
        ("0.5.14", ("cuda_graph_max_bs_decode", "cuda_graph_bs_decode")),
        ("0.5.23", ("cuda_graph_max_bs_decode", "cuda_graph_bs_decode")),
    ],
)
def test_build_args_spells_cuda_graph_flags_for_the_target_version(version, spelling):
    config = SGLangConfig(model_path="/m", cuda_graph_max_bs=64, cuda_graph_bs=[1, 8])
    args = SGLangConfig.build_args(config, tp_size=1, base_gpu_id=0, sglang_version=version)
    assert {key: args[key] for key in spelling} == dict(zip(spelling, (64, [1, 8]), strict=True))
    every_spelling = {"cuda_graph_max_bs", "cuda_graph_bs"}
    every_spelling |= {"cuda_graph_max_bs_decode", "cuda_graph_bs_decode"}
    assert every_spelling & set(args) == set(spelling)  # never both spellings


def test_build_args_targets_the_floor_when_sglang_is_not_installed_here():
    assert importlib.util.find_spec("sglang") is None
    assert inference.target_sglang_version() == MIN_SGLANG_VERSION
    config = SGLangConfig(model_path="/m", cuda_graph_max_bs=64)
    assert SGLangConfig.build_args(config, tp_size=1, base_gpu_id=0)["cuda_graph_max_bs"] == 64


def test_an_unreachable_index_is_told_apart_from_a_failed_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    """The tier skips only for this error (conftest); any other install failure fails it."""
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", f"http://127.0.0.1:{find_free_port()}/simple")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    with pytest.raises(IndexUnreachableError):
        ensure_installed(cache_dir=tmp_path, log=lambda _: None)
    assert not any(p.name.endswith(".partial") or p.is_dir() for p in tmp_path.iterdir())
