"""A toy agent for the proxy path: one chat call, rewarded by the vowels it writes.

``PPOTrainer.train("examples.toy.chat_agent.VowelAgent")`` runs it through the rollout
proxy (an agent is not a ``RolloutWorkflow``): the proxy records the tokens and
log-probs of the call, and the reward the agent returns is assigned to it.
"""

from __future__ import annotations

from typing import Any

import httpx

__all__ = ["VowelAgent", "make_chat_dataset"]

VOWELS = set("aeiou")


def make_chat_dataset(rows: int) -> list[dict[str, Any]]:
    return [{"id": i, "question": f"Say something about the number {i}."} for i in range(rows)]


class VowelAgent:
    def __init__(self, max_tokens: int = 8, temperature: float = 1.0):
        self.max_tokens = max_tokens
        self.temperature = temperature

    async def run(self, data: dict[str, Any], *, base_url: str, api_key: str, **_: Any) -> float:
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": data["question"]}],
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
        }
        async with httpx.AsyncClient(timeout=120) as client:
            response = await client.post(
                f"{base_url}/chat/completions",
                json=body,
                headers={"Authorization": f"Bearer {api_key}"},
            )
        response.raise_for_status()
        text = response.json()["choices"][0]["message"]["content"] or ""
        return len(VOWELS & set(text.lower())) / len(VOWELS)
