"""An agent that provokes the proxy's counted mismatches, for end-to-end metric tests.

Two chat calls per episode. The first offers a tool and samples at temperature 1.0; the
second drops the tool and samples at 0.5. In ``concat`` mode the second prompt cannot
extend the first call's tokens (the dropped tools block held an EOS), so the proxy counts
``proxy/concat_prefix_mismatch``; with ``actor.temperature`` 1.0 it counts the second
call in ``proxy/sampling_temperature_mismatch``. The reward is the share of vowels in the
first reply; ``record_group_metrics`` records ``pass@k`` (some sample rewarded > 0).
"""

from __future__ import annotations

from typing import Any

import httpx

from areal.infra import workflow_context
from areal.utils import stats_tracker

__all__ = ["MismatchProbeAgent"]

VOWELS = set("aeiou")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "ls",
            "description": "list files",
            "parameters": {"type": "object", "properties": {}},
        },
    }
]


class MismatchProbeAgent:
    def __init__(self, max_tokens: int = 6):
        self.max_tokens = max_tokens

    async def run(self, data: dict[str, Any], *, base_url: str, api_key: str, **_: Any) -> float:
        headers = {"Authorization": f"Bearer {api_key}"}
        user = {"role": "user", "content": data["question"]}
        async with httpx.AsyncClient(timeout=120) as client:

            async def chat(messages: list[dict], **extra: Any) -> dict:
                body = {"model": "m", "messages": messages, "max_tokens": self.max_tokens}
                response = await client.post(
                    f"{base_url}/chat/completions", json={**body, **extra}, headers=headers
                )
                response.raise_for_status()
                return response.json()["choices"][0]["message"]

            reply = await chat([user], tools=TOOLS, temperature=1.0)
            await chat([user, reply], temperature=0.5)
        text = (reply.get("content") or "").lower()
        return len(VOWELS & set(text)) / len(VOWELS)

    def record_group_metrics(
        self, data: dict[str, Any], rewards: list[float | None], group_size: int
    ) -> None:
        passed = any(reward is not None and reward > 0 for reward in rewards)
        stats_tracker.get(workflow_context.stat_scope()).scalar(**{"pass@k": float(passed)})
