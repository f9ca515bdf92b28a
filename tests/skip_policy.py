"""When a test may skip: GPU tests skip without CUDA; in CI nothing else may skip.

A skip reads as green, so a CI run without the agent CLIs, the SGLang wheels or Slurm
would pass while testing none of them. With ``CI`` set (``true``, ``1`` or ``yes``), a
skipped test is reported as failed unless it is marked ``gpu`` and skipped for want of a
CUDA GPU, the one thing the CI machine is not expected to have. tests/conftest.py imports
these hooks; tests/unit/test_ci_skips.py loads the module with ``-p tests.skip_policy``.
"""

from __future__ import annotations

import os
import re
from collections.abc import Generator

import pytest

__all__ = [
    "GPU_SKIP_REASON",
    "ci_enabled",
    "pytest_collection_modifyitems",
    "pytest_make_collect_report",
    "pytest_runtest_makereport",
    "skip_allowed_in_ci",
]

GPU_SKIP_REASON = "needs a CUDA GPU (run on the GPU machine)"
# The reasons of the GPU skips: this module's, and the tests' own "needs two CUDA GPUs".
_GPU_REASON = re.compile(r"\bneeds (?:a|one|two|\d+) CUDA GPUs?\b")


def ci_enabled() -> bool:
    """Whether this run is a CI run (the ``CI`` variable most CI systems set)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def skip_allowed_in_ci(marked_gpu: bool, reason: str) -> bool:
    """A skip is allowed in CI only for a ``gpu`` test that names a missing CUDA GPU."""
    return marked_gpu and _GPU_REASON.search(reason) is not None


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items or _cuda_available():
        return
    # First among the item's skipif marks, so that without CUDA the reported reason is the
    # GPU one rather than a test's own condition (e.g. "torch has no varlen_attn kernel").
    skip_gpu = pytest.mark.skipif(True, reason=GPU_SKIP_REASON)
    for item in gpu_items:
        item.add_marker(skip_gpu, append=False)


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple):  # (path, line, "Skipped: reason")
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


def _ci_failure(reason: str) -> str:
    return (
        f"skipped in CI: {reason}. With CI set only a gpu test may skip, for want of a "
        "CUDA GPU: install what the test needs (see .ci/run) or fix the test"
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    # wasxfail: an expected failure, reported as skipped but not a skip
    if not report.skipped or hasattr(report, "wasxfail") or not ci_enabled():
        return report
    reason = _skip_reason(report)
    if not skip_allowed_in_ci(item.get_closest_marker("gpu") is not None, reason):
        report.outcome = "failed"
        report.longrepr = _ci_failure(reason)
    return report


@pytest.hookimpl(wrapper=True)
def pytest_make_collect_report(
    collector: pytest.Collector,
) -> Generator[None, pytest.CollectReport, pytest.CollectReport]:
    # A module-level skip (pytest.importorskip, allow_module_level) skips a whole file.
    report = yield
    if report.skipped and ci_enabled():
        report.outcome = "failed"
        report.longrepr = _ci_failure(_skip_reason(report))
    return report
