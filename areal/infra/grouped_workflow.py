"""Running a prompt's ``n_samples`` rollouts as one structured group, and resolving
the workflow argument of ``submit``.

Samples run as concurrent tasks, each seeing its own ``sample_idx`` in the workflow
context. A sample that returns ``None`` or raises is rejected on its own; the rest of
the group trains (also with rollout-time reward normalization, over the samples kept).
Once per group the inner workflow's ``record_group_metrics(data, rewards, group_size)``
hook, when it has one, gets every sample's reward (``None`` for a failed one). With
``drop_incomplete_group`` the group is rejected as soon as one sample is, and its
still-running siblings are cancelled, so that their external work (Arena tasks, proxy
sessions) is released instead of running on unobserved.
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
from typing import Any

import torch

from areal.api.workflow_api import RolloutWorkflow
from areal.infra import workflow_context
from areal.utils import logging
from areal.utils.data import concat_padded_tensors
from areal.utils.dynamic_import import import_from_string

__all__ = ["GroupedRolloutWorkflow", "resolve_workflow"]

logger = logging.getLogger("rollout.group")


def _is_empty(traj: Any) -> bool:
    return traj is None or (isinstance(traj, dict) and not traj)


def _is_interaction_dict(result: Any) -> bool:
    return (
        isinstance(result, dict)
        and bool(result)
        and all(
            hasattr(v, "to_tensor_dict") and hasattr(v, "set_reward_value") for v in result.values()
        )
    )


def _tensor_rewards(result: Any) -> torch.Tensor | None:
    rewards = result.get("rewards") if isinstance(result, dict) else None
    if not isinstance(rewards, torch.Tensor) or rewards.numel() == 0:
        return None
    if not all(isinstance(v, torch.Tensor) for v in result.values()):
        return None
    return rewards


def sample_reward(result: Any) -> float | None:
    """A sample's reward: its last interaction's, or its last row's ``rewards`` for a
    tensor dict; ``None`` for a failed sample (or one without a reward)."""
    if _is_empty(result):
        return None
    if _is_interaction_dict(result):
        reward = list(result.values())[-1].reward
        return None if reward is None else float(reward)
    rewards = _tensor_rewards(result)
    return None if rewards is None else float(rewards.reshape(-1)[-1])


def normalize_group_rewards(results: list[Any]) -> list[Any]:
    """Rollout-time reward normalization over the group's usable samples.

    Each sample's score is :func:`sample_reward`; every interaction (or row) of sample i
    gets ``R_i = (r_i - mean) / (std_pop + 1e-8)`` over the samples that have a score,
    keeping its own reward as the original. Failed samples are left out before this is
    called; a sample without a score is dropped (with a warning), so the group trains on
    the rest.
    """
    scored = [(r, sample_reward(r)) for r in results]
    kept = [(r, score) for r, score in scored if score is not None]
    if len(kept) < len(results):
        logger.warning(
            "%d sample(s) of task %s have no reward; normalizing over the other %d",
            len(results) - len(kept),
            workflow_context.get().task_id,
            len(kept),
        )
    if not kept:
        return []
    n = len(kept)
    mean = sum(score for _, score in kept) / n
    std = (sum((score - mean) ** 2 for _, score in kept) / n) ** 0.5
    for result, score in kept:
        normalized = (score - mean) / (std + 1e-8)
        if _is_interaction_dict(result):
            for interaction in result.values():
                if interaction.reward is not None:
                    interaction.set_reward_value(normalized, original=interaction.reward)
        else:
            rewards = result["rewards"]
            result.setdefault("original_rewards", rewards.clone())
            result["rewards"] = torch.full_like(rewards, normalized)
    return [result for result, _ in kept]


def _merge(results: list[Any]) -> Any:
    if all(
        isinstance(r, dict) and all(isinstance(v, torch.Tensor) for v in r.values())
        for r in results
    ):
        merged = concat_padded_tensors(results)
        return merged or None
    if all(isinstance(r, dict) for r in results):
        merged: dict[Any, Any] = {}
        for r in results:
            merged.update(r)
        return merged or None
    return results


class GroupedRolloutWorkflow(RolloutWorkflow):
    """``group_size`` concurrent copies of a workflow on the same row."""

    def __init__(
        self,
        workflow: RolloutWorkflow,
        group_size: int,
        drop_incomplete_group: bool = False,
        reward_normalization: bool = False,
    ):
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size}")
        self.workflow = workflow
        self.group_size = group_size
        self.drop_incomplete_group = drop_incomplete_group
        self.reward_normalization = reward_normalization

    async def _sample(self, engine: Any, data: Any, index: int) -> Any:
        context = dataclasses.replace(workflow_context.get(), sample_idx=index)
        workflow_context.set(context)  # this task's own copy of the context
        try:
            return await self.workflow.arun_episode(engine, data)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("sample %d of task %s failed; it is rejected", index, context.task_id)
            return None

    async def arun_episode(self, engine: Any, data: Any) -> Any:
        tasks = [asyncio.create_task(self._sample(engine, data, i)) for i in range(self.group_size)]
        results: list[Any] = [None] * self.group_size
        try:
            if self.drop_incomplete_group:
                index_of = {task: i for i, task in enumerate(tasks)}
                pending = set(tasks)
                while pending:
                    done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                    for task in done:
                        results[index_of[task]] = task.result()
                    if any(_is_empty(results[index_of[task]]) for task in done):
                        break  # the finally block cancels the siblings
            else:
                results = list(await asyncio.gather(*tasks))
        finally:
            unfinished = [t for t in tasks if not t.done()]
            for task in unfinished:
                task.cancel()
            if unfinished:
                await asyncio.gather(*unfinished, return_exceptions=True)
        await self._record_group_metrics(data, results)
        valid = [r for r in results if not _is_empty(r)]
        if not valid or (self.drop_incomplete_group and len(valid) < self.group_size):
            return None
        if len(valid) < self.group_size:
            logger.warning(
                "task %s kept %d of %d samples",
                workflow_context.get().task_id,
                len(valid),
                self.group_size,
            )
        if self.reward_normalization and self.group_size > 1:
            valid = normalize_group_rewards(valid)
            if not valid:
                return None
        return _merge(valid)

    async def _record_group_metrics(self, data: Any, results: list[Any]) -> None:
        """The inner workflow's ``record_group_metrics`` hook (pass@k for agents), once per
        group, with each sample's reward before normalization (``None``: it failed)."""
        record = getattr(self.workflow, "record_group_metrics", None)
        if record is None:
            return
        rewards = [sample_reward(r) for r in results]
        try:
            outcome = record(data, rewards, self.group_size)
            if inspect.isawaitable(outcome):
                await outcome
        except Exception:
            logger.exception(
                "record_group_metrics failed for task %s", workflow_context.get().task_id
            )


def resolve_workflow(
    workflow: Any,
    workflow_kwargs: dict[str, Any] | None = None,
    *,
    group_size: int = 1,
    drop_incomplete_group: bool = False,
    reward_normalization: bool = False,
    proxy_addr: str | None = None,
    agent_config: Any = None,
) -> RolloutWorkflow:
    """A ready-to-run workflow from an instance, a class or an import path.

    ``RolloutWorkflow`` classes are built with ``workflow_kwargs``; anything else is an
    agent (``async def run(data, **kwargs)``), built with ``workflow_kwargs or {}`` and run
    through the rollout proxy at ``proxy_addr`` with the settings of ``agent_config``
    (``rollout.agent``). Wrapped in :class:`GroupedRolloutWorkflow` when ``group_size > 1``.
    """
    if isinstance(workflow, str):
        workflow = import_from_string(workflow)
    if isinstance(workflow, type) and issubclass(workflow, RolloutWorkflow):
        if workflow_kwargs is None:
            raise ValueError(f"workflow_kwargs are required to build {workflow.__name__}")
        workflow = workflow(**workflow_kwargs)
    if not isinstance(workflow, RolloutWorkflow):
        agent = workflow(**(workflow_kwargs or {})) if isinstance(workflow, type) else workflow
        if not callable(getattr(agent, "run", None)):
            raise TypeError(
                f"{workflow!r} is neither a RolloutWorkflow nor an agent with async run(data, ...)"
            )
        from areal.proxy.workflow import OpenAIProxyWorkflow

        if not proxy_addr:
            raise ValueError("agent workflows run through the rollout proxy: pass proxy_addr")
        workflow = OpenAIProxyWorkflow(
            mode=getattr(agent_config, "mode", "inline"),
            agent=agent,
            proxy_addr=proxy_addr,
            admin_api_key=getattr(agent_config, "admin_api_key", ""),
            discount=getattr(agent_config, "turn_discount", 1.0),
            export_style=getattr(agent_config, "export_style", "individual"),
            drop_retry_orphans=getattr(agent_config, "drop_retry_orphans", False),
        )
    if group_size > 1:
        workflow = GroupedRolloutWorkflow(
            workflow, group_size, drop_incomplete_group, reward_normalization
        )
    return workflow
