"""A workflow or agent path that does not import is refused before any worker starts."""

from __future__ import annotations

import re
import sys

import pytest

from areal.infra.workflow_paths import PATH_FORMS, WorkflowPathError, workflow_kind
from areal.trainer import rl_trainer
from examples.swe import arena_rollout_only, train_swe_rl
from examples.swe.train_swe_rl import ARENA_WORKFLOW, TrainingInputs
from tests.conftest import SWE_DIR

# The workflow the removed JSONL mode selected: its module was never part of this port.
MISSING_MODULE = "examples.swe.agent.SWEAgentWorkflow"
NO_SUCH_MODULE = re.escape("no module named 'examples.swe.agent'")


@pytest.fixture
def broken_package(tmp_path, monkeypatch):
    """``brokenpkg.needs_dep`` imports a dependency that is not installed,
    ``brokenpkg.raises`` fails with its own error when imported, and
    ``brokenpkg.sync_agent.SyncAgent`` has a ``run`` that is not ``async def``."""
    package = tmp_path / "brokenpkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "needs_dep.py").write_text("import not_installed_dependency_xyz\n")
    (package / "raises.py").write_text("raise RuntimeError('no config file next to me')\n")
    (package / "sync_agent.py").write_text(
        "class SyncAgent:\n    def run(self, data):\n        return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "brokenpkg"
    for name in [n for n in sys.modules if n == "brokenpkg" or n.startswith("brokenpkg.")]:
        del sys.modules[name]


def test_workflows_and_agents_that_import_are_told_apart():
    assert workflow_kind("examples.toy.token_reward.TokenRewardWorkflow") == "workflow"
    assert workflow_kind(ARENA_WORKFLOW) == "agent"
    assert workflow_kind("examples.toy.chat_agent.VowelAgent") == "agent"


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        (MISSING_MODULE, "ModuleNotFoundError: no module named 'examples.swe.agent'"),
        ("no_such_package_xyz.agents.Agent", "no module named 'no_such_package_xyz'"),
        (
            "examples.swe.arena_agent.ArenaStreamAgent",
            "AttributeError: module 'examples.swe.arena_agent' has no attribute 'ArenaStreamAgent'",
        ),
        ("ArenaStreamAgentWorkflow", "is not a dotted 'package.module.Name' path"),
    ],
)
def test_a_path_that_does_not_import_names_itself_and_why(path, reason):
    with pytest.raises(WorkflowPathError) as caught:
        workflow_kind(path)
    message = str(caught.value)
    assert message.startswith(f"workflow/agent path {path!r}: ")
    assert reason in message
    assert PATH_FORMS in message  # what a workflow path / agent path must be


def test_a_module_that_fails_on_import_is_reported_with_its_error(broken_package):
    with pytest.raises(WorkflowPathError, match="no module named 'not_installed_dependency_xyz'"):
        workflow_kind("brokenpkg.needs_dep.Agent")
    with pytest.raises(
        WorkflowPathError,
        match=re.escape("importing module 'brokenpkg.raises' raised RuntimeError: no config file"),
    ):
        workflow_kind("brokenpkg.raises.Agent")


def test_a_path_to_something_else_is_refused(broken_package):
    with pytest.raises(WorkflowPathError, match="neither a RolloutWorkflow nor an agent"):
        workflow_kind("brokenpkg.sync_agent.SyncAgent")  # run is not 'async def'
    with pytest.raises(WorkflowPathError, match="neither a RolloutWorkflow nor an agent"):
        workflow_kind("os.path.join")
    with pytest.raises(TypeError, match="neither a RolloutWorkflow nor an agent"):
        workflow_kind(42)


def test_the_trainer_no_longer_takes_an_unimportable_path_for_an_agent():
    with pytest.raises(WorkflowPathError, match=NO_SUCH_MODULE):
        rl_trainer._is_workflow(MISSING_MODULE)


def test_train_swe_rl_refuses_the_path_before_the_trainer_starts_workers(profile_env, monkeypatch):
    started = []
    monkeypatch.setattr(
        train_swe_rl,
        "build_training_inputs",
        lambda config: TrainingInputs([{"id": 1}], None, MISSING_MODULE, {}, {}),
    )
    monkeypatch.setattr(train_swe_rl, "PPOTrainer", lambda *a, **k: started.append(a))
    with pytest.raises(WorkflowPathError, match=NO_SUCH_MODULE):
        train_swe_rl.main(["--config", str(SWE_DIR / "arena_multi_stream.yaml")])
    assert started == []  # no trainer, so no worker


def test_arena_rollout_only_checks_its_agent_path(profile_env, monkeypatch):
    from areal.api.cli_args import load_expr_config
    from examples.swe.utils import SWEPPOConfig

    config, _ = load_expr_config(
        ["--config", str(SWE_DIR / "arena_local.yaml"), "scheduler.type=local"], SWEPPOConfig
    )
    monkeypatch.setattr(arena_rollout_only, "ARENA_WORKFLOW", MISSING_MODULE)
    with pytest.raises(WorkflowPathError, match=NO_SUCH_MODULE):
        arena_rollout_only._check_supported(config)
