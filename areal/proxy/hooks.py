"""The contract between the proxy workflow and an agent.

An agent is any object with ``async def run(data, **kwargs) -> float | dict | None``
(the reference's signature, so existing agents keep working). ``run`` receives the
keyword arguments of :class:`AgentRunKwargs`; the optional hooks of :class:`AgentHooks`
let it take part in failure handling, metrics and audit. Every hook may be sync or async
unless noted.

Hooks whose answer decides what a sample trains on (:data:`DECISION_HOOKS`: its session
metadata, failure disposition, the drop decision, the exported reward and metadata) must
not fail: an exception, or an answer of the wrong kind, rejects the sample with an
:class:`AgentHookError` instead of training on a default. Hooks that only observe
(:data:`OBSERVER_HOOKS`: audit and metrics) are logged and ignored when they fail.
"""

from __future__ import annotations

from typing import Any, Literal, Protocol, TypedDict, runtime_checkable

__all__ = [
    "DECISION_HOOKS",
    "OBSERVER_HOOKS",
    "AgentHookError",
    "AgentHooks",
    "AgentRunKwargs",
    "FailureDisposition",
    "WorkerRuntime",
]

FailureDisposition = Literal[
    "model_failure_zero", "system_failure_reject", "unknown_failure_reject"
]

DECISION_HOOKS = frozenset(
    {
        "get_session_metadata",
        "classify_proxy_failure",
        "record_failure_disposition",
        "should_reject_failed_sample",
        "get_failure_reward_for_export",
        "get_episode_reward_for_export",
        "get_episode_metadata",
    }
)
"""Hooks that decide a sample's reward, disposition or export: a failure rejects it."""
OBSERVER_HOOKS = frozenset(
    {"persist_episode_result", "record_episode_metrics", "record_group_metrics"}
)
"""Hooks that only audit or record metrics: a failure is logged and the sample goes on."""


class AgentHookError(RuntimeError):
    """A decision hook raised or answered out of contract; the sample is rejected."""

    def __init__(self, hook: str, error: BaseException):
        self.hook = hook
        super().__init__(
            f"agent hook {hook} failed ({type(error).__name__}: {error}); the sample is "
            "rejected rather than trained on a default"
        )


@runtime_checkable
class WorkerRuntime(Protocol):
    """The long-lived rollout engine, shared by every agent of one rollout worker."""

    def register_destroy_callback(self, key: str, fn: Any) -> bool:
        """Run ``fn`` when the engine is destroyed; the first registration per key wins."""


class AgentRunKwargs(TypedDict):
    base_url: str  # the proxy, e.g. http://10.0.0.5:8123 (no /v1)
    api_key: str  # this session's key: generation, rewards and end-of-session
    http_client: Any  # a shared httpx.AsyncClient
    session_id: str  # matches ^[A-Za-z0-9][A-Za-z0-9_.:-]{0,199}$
    proxy_gateway_api_key: str  # generation-only key, the same for the whole run
    proxy_session_token: str  # proves X-Session-Id together with the gateway key
    worker_runtime: WorkerRuntime


class AgentHooks(Protocol):
    """Optional agent methods the workflow calls when they exist."""

    def get_session_metadata(self, data: dict) -> dict[str, Any]: ...

    def get_episode_metadata(self) -> dict[str, Any]: ...

    @staticmethod
    def classify_proxy_failure(
        error: BaseException, *, context_overflow: bool, interaction_count: int
    ) -> FailureDisposition:
        """Sync, class-level. Decides whether a failed episode trains with reward 0 or is
        rejected; any other value rejects the sample."""

    def record_failure_disposition(
        self, data: dict, error: BaseException, disposition: FailureDisposition
    ) -> None: ...

    def should_reject_failed_sample(
        self, error: BaseException, disposition: FailureDisposition
    ) -> bool:
        """True: drop only this sample (its group siblings are kept) instead of raising.
        Consulted for failed episodes when the proxy saw no system error."""

    def persist_episode_result(self, data: dict, reward: float | None) -> None:
        """The episode's final reward (``None``: nothing was trained)."""

    def get_failure_reward_for_export(self, data: dict, *, export_style: str) -> float | None:
        """The reward of every exported interaction of a zero-reward (failed) episode."""

    def get_episode_reward_for_export(
        self, data: dict, reward: float | None, *, export_style: str
    ) -> float | None:
        """The reward of every exported interaction of a successful episode."""

    def record_episode_metrics(self, data: dict, reward: float | None) -> None:
        """Sync; called after a usable export."""

    def record_group_metrics(
        self, data: dict, rewards: list[float | None], group_size: int
    ) -> None: ...
