"""``areal.experimental.openai.proxy.workflow``: the reference's path of
:mod:`areal.proxy.workflow` (Arena agents import ``HARNESS_OUTCOME_METRIC_CODES`` here)."""

from __future__ import annotations

from areal.proxy.workflow import (
    HARNESS_OUTCOME_METRIC_CODES,
    OpenAIProxyWorkflow,
    record_interaction_stats,
)

__all__ = ["HARNESS_OUTCOME_METRIC_CODES", "OpenAIProxyWorkflow", "record_interaction_stats"]
