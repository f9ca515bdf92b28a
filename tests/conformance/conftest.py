"""Fixtures of the SGLang conformance tier: install the real wheels (cached), one worker each.

The tier needs PyPI once (the wheels are then cached under ``.cache/sglang-conformance``); it
skips, saying so, only when the index cannot be reached (a failure when ``CI`` is set, see
tests/skip_policy.py). Deselect it with ``-m "not sglang"``.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.conformance.install_sglang import (
    VERSIONS,
    IndexUnreachableError,
    SGLangSite,
    ensure_installed,
)
from tests.conformance.worker_client import SGLangWorker

_REPORT: list[str] = []


@pytest.fixture(scope="session")
def sglang_sites() -> dict[str, SGLangSite]:
    try:
        sites = ensure_installed(log=_REPORT.append)
    except IndexUnreachableError as error:
        pytest.skip(f"PyPI is unreachable, so the real SGLang wheels cannot be installed: {error}")
    total = sum(site.downloaded_mb for site in sites.values())
    _REPORT.append(f"sglang-conformance: downloaded {total:.1f} MB this run")
    return sites


@pytest.fixture(scope="session")
def sglang_workers(
    sglang_sites: dict[str, SGLangSite], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, SGLangWorker]]:
    """Every version's worker, started together so their imports overlap."""
    log_dir = tmp_path_factory.mktemp("sglang-workers")
    workers = {version: SGLangWorker(site, log_dir) for version, site in sglang_sites.items()}
    yield workers
    for worker in workers.values():
        if worker.ready_s is not None:
            ready = f"{worker.version} worker ready in {worker.ready_s:.1f} s"
            _REPORT.append(f"sglang-conformance: {ready}")
        worker.close()


@pytest.fixture(scope="session", params=VERSIONS)
def sglang(request: pytest.FixtureRequest, sglang_workers: dict[str, SGLangWorker]) -> SGLangWorker:
    """The worker of one tested SGLang version (tests run once per version)."""
    worker = sglang_workers[request.param]
    worker.wait_ready()
    return worker


def pytest_terminal_summary(terminalreporter) -> None:
    for line in _REPORT:
        terminalreporter.write_line(line)
