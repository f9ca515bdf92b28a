"""With CI set, a skip fails the run unless it is a gpu test without a CUDA GPU.

The end-to-end cases run pytest in a subprocess with ``CUDA_VISIBLE_DEVICES`` empty, so
the gpu test skips the same way on a GPU machine as on a CPU one.
"""

from __future__ import annotations

import pytest

from tests.conftest import REPO_ROOT
from tests.skip_policy import GPU_SKIP_REASON, skip_allowed_in_ci

pytest_plugins = ["pytester"]

# the policy under test; no cache or asyncio plugin, which only add noise to the inner runs
PLUGINS = ("-p", "tests.skip_policy", "-p", "no:cacheprovider", "-p", "no:asyncio")

INNER_TESTS = """
import pytest

@pytest.mark.gpu
def test_gpu():
    pass

@pytest.mark.gpu
@pytest.mark.skipif(True, reason="torch has no varlen_attn kernel")
def test_gpu_with_a_condition_of_its_own():
    pass

def test_runs():
    pass

def test_skips_in_the_body():
    pytest.skip("the claude CLI is not installed")

@pytest.mark.skipif(True, reason="shellcheck is not installed")
def test_skipif():
    pass

@pytest.fixture
def slurm():
    pytest.skip("Slurm binaries not installed")

def test_fixture_skips(slurm):
    pass

@pytest.mark.xfail(reason="a known bug", strict=True)
def test_expected_failure():
    assert False
"""


@pytest.fixture
def inner(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    pytester.makeini("[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n")
    pytester.makepyfile(test_inner=INNER_TESTS)
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    return pytester


def run_inner(inner: pytest.Pytester, *args: str) -> pytest.RunResult:
    return inner.runpytest_subprocess(*PLUGINS, *args)


def test_in_ci_only_the_gpu_skips_pass(inner, monkeypatch):
    monkeypatch.setenv("CI", "true")
    result = run_inner(inner, "-rA")
    # the gpu tests skip (their own condition is overridden by the GPU one); the body
    # skip fails in call, the skipif and fixture skips fail at setup (pytest: errors)
    result.assert_outcomes(passed=1, skipped=2, failed=1, errors=2, xfailed=1)
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            f"SKIPPED * {GPU_SKIP_REASON}",
            f"SKIPPED * {GPU_SKIP_REASON}",
            "ERROR *::test_skipif - skipped in CI: shellcheck is not installed. *",
            "ERROR *::test_fixture_skips - skipped in CI: Slurm binaries not installed. *",
            "FAILED *::test_skips_in_the_body - skipped in CI: the claude CLI is not installed. *",
        ]
    )
    result.stdout.no_fnmatch_line("*varlen_attn*")


@pytest.mark.parametrize("ci", [None, "false"])
def test_outside_ci_a_skip_is_a_skip(inner, monkeypatch, ci):
    if ci is None:
        monkeypatch.delenv("CI", raising=False)
    else:
        monkeypatch.setenv("CI", ci)
    result = run_inner(inner)
    result.assert_outcomes(passed=1, skipped=5, xfailed=1)
    assert result.ret == pytest.ExitCode.OK


def test_a_module_level_skip_fails_in_ci(pytester, monkeypatch):
    pytester.makepyfile(test_whole_file="import pytest\npytest.importorskip('no_such_module')\n")
    monkeypatch.setenv("PYTHONPATH", str(REPO_ROOT))
    monkeypatch.setenv("CI", "1")
    result = pytester.runpytest_subprocess(*PLUGINS)
    assert result.ret == pytest.ExitCode.INTERRUPTED  # a collection error stops the run
    result.stdout.fnmatch_lines(["*skipped in CI: could not import 'no_such_module'*"])


@pytest.mark.parametrize(
    ("marked_gpu", "reason", "allowed"),
    [
        (True, GPU_SKIP_REASON, True),
        (True, "needs two CUDA GPUs", True),  # tests/gpu on a one-GPU machine
        (True, "needs megatron-core", False),  # on a GPU machine: a missing package
        (True, "torch has no varlen_attn kernel", False),
        (False, GPU_SKIP_REASON, False),  # the reason alone is not enough
        (False, "the codex CLI is not installed; run `make agent-clis`", False),
    ],
)
def test_which_skips_ci_allows(marked_gpu, reason, allowed):
    assert skip_allowed_in_ci(marked_gpu, reason) is allowed
