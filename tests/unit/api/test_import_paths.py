"""Every ``areal`` import the Arena example files make resolves."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

# (module, name) as written in ``from module import name``; name None: ``import module``
SPEC_IMPORTS = [
    # train_swe_rl.py
    ("areal", "PPOTrainer"),
    ("areal.api.cli_args", "load_expr_config"),
    ("areal.utils", "logging"),
    # utils.py
    ("areal.api.cli_args", "PPOConfig"),
    # arena_agent.py
    ("areal.infra", "workflow_context"),
    ("areal.utils", "stats_tracker"),
    ("areal.utils.dynamic_import", "import_from_string"),
    ("areal.experimental.openai.proxy.workflow", "HARNESS_OUTCOME_METRIC_CODES"),
    # arena_rollout_only.py
    ("areal.api.alloc_mode", "ModelAllocation"),
    ("areal.api.cli_args", "SGLangConfig"),
    ("areal.engine", "RemoteSGLangEngine"),
    ("areal.infra", "LocalScheduler"),
    ("areal.infra.rpc.rtensor", "RTensor"),
    ("areal.utils.config_utils", "redact_sensitive_config"),
    ("areal.utils.logging", "setup_file_logging"),
    # areal/__init__.py top-level names
    ("areal", "RolloutController"),
    ("areal", "TrainController"),
    ("areal", "StalenessManager"),
    ("areal", "WorkflowExecutor"),
    ("areal", "workflow_context"),
    ("areal", "current_platform"),
    # the worker command of every profile
    ("areal.infra.rpc.rpc_server", None),
]


@pytest.mark.parametrize(
    ("module", "name"), SPEC_IMPORTS, ids=[f"{m}:{n}" for m, n in SPEC_IMPORTS]
)
def test_spec_import_path_resolves(module, name):
    if name is None:
        importlib.import_module(module)
        return
    namespace: dict = {}
    exec(f"from {module} import {name}", namespace)  # the statement exactly as written
    assert namespace[name] is not None


def test_reexports_are_the_real_objects():
    import areal.engine.sglang_remote
    import areal.infra.scheduler.local
    import areal.proxy.workflow
    from areal.engine import RemoteSGLangEngine
    from areal.experimental.openai.proxy.workflow import HARNESS_OUTCOME_METRIC_CODES
    from areal.infra import LocalScheduler

    assert RemoteSGLangEngine is areal.engine.sglang_remote.RemoteSGLangEngine
    assert LocalScheduler is areal.infra.scheduler.local.LocalScheduler
    assert HARNESS_OUTCOME_METRIC_CODES is areal.proxy.workflow.HARNESS_OUTCOME_METRIC_CODES


def test_rtensor_localize_passes_by_value_results_through():
    from areal.infra.rpc.rtensor import RTensor

    result = {"input_ids": [[1, 2, 3]], "rewards": [1.0]}
    assert RTensor.localize(result) is result


def test_unknown_names_raise_attribute_error():
    import areal
    import areal.engine
    import areal.infra

    for module in (areal, areal.engine, areal.infra):
        with pytest.raises(AttributeError):
            module.NoSuchThing  # noqa: B018


def test_import_areal_stays_light():
    code = "import sys, areal, areal.infra, areal.engine; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
