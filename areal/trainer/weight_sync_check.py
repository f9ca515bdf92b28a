"""After a weight update, check that every inference server serves the actor's weights.

Each server decodes a fixed probe prompt greedily and reports the log-prob of every token
it chose; the actor scores the same tokens (``compute_logp``). With the same weights both
compute ``log_softmax(logits / T)`` of one model, so the largest absolute difference is
numerical noise (about 1e-5 in float32 on CPU); a server that missed an update, loaded a
partial bucket or holds another model differs by orders of magnitude more.

``actor.weight_sync_check: true`` runs it after every step's weight update and records
``weight_sync/max_abs_logp_diff`` (and one value per server);
``actor.weight_sync_check_tolerance`` turns a larger difference into an error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import httpx
import torch

from areal.api.cli_args import GenerationHyperparameters
from areal.api.io_struct import ModelRequest
from areal.engine.sglang_backend import SGLangBackend

__all__ = ["PROBE_TEXT", "ServerProbe", "check_weight_sync"]

PROBE_TEXT = "Weight sync check. The quick brown fox jumps over the lazy dog because"
PROBE_NEW_TOKENS = 8


@dataclass
class ServerProbe:
    """One server's greedy continuation of the probe and its log-probs."""

    address: str
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]


def probe_server(
    address: str,
    prompt: list[int],
    temperature: float,
    api_key: str = "",
    timeout: float = 120.0,
) -> ServerProbe:
    """Greedy tokens (top-k 1 at ``temperature``, so log-probs use the actor's scale)."""
    gconfig = GenerationHyperparameters(
        max_new_tokens=PROBE_NEW_TOKENS,
        max_tokens=len(prompt) + PROBE_NEW_TOKENS + 1,
        temperature=temperature,
        top_k=1,
        ignore_eos=True,
    )
    backend = SGLangBackend()
    request = backend.build_generation_request(
        ModelRequest(input_ids=list(prompt), gconfig=gconfig), PROBE_NEW_TOKENS, version=0
    )
    response = httpx.post(
        f"http://{address}{request.endpoint}",
        json=request.payload,
        headers={"Authorization": f"Bearer {api_key}"} if api_key else None,
        timeout=timeout,
    )
    response.raise_for_status()
    result = backend.parse_generation_response(response.json())
    return ServerProbe(address, list(prompt), result.output_tokens, result.output_logprobs)


def check_weight_sync(
    actor: Any,
    addresses: list[str],
    tokenizer: Any,
    temperature: float,
    n_data_parallel: int,
    tolerance: float | None = None,
    api_key: str = "",
) -> dict[str, float]:
    """Probe every server, score each continuation with ``actor``; the stats.

    ``n_data_parallel``: the actor's data-parallel size (each rank needs a group, so the
    probe batch repeats the sequences until every rank has one). ``api_key``: the servers'.
    """
    prompt = list(tokenizer(PROBE_TEXT)["input_ids"])
    probes = [probe_server(address, prompt, temperature, api_key) for address in addresses]
    groups = [_as_group(p.prompt + p.tokens) for p in probes]
    while len(groups) < n_data_parallel:
        groups.append(groups[len(groups) % len(probes)])
    scored = actor.compute_logp(groups)
    stats: dict[str, float] = {}
    worst = 0.0
    for i, probe in enumerate(probes):
        # position t scores token t + 1: the generated tokens start at len(prompt)
        start = len(probe.prompt) - 1
        mine = scored[i][0, start : start + len(probe.tokens)].double()
        theirs = torch.tensor(probe.logprobs, dtype=torch.float64)
        diff = float((mine - theirs).abs().max()) if len(probe.tokens) else 0.0
        stats[f"weight_sync/server{i}_max_abs_logp_diff"] = diff
        worst = max(worst, diff)
    stats["weight_sync/max_abs_logp_diff"] = worst
    if tolerance is not None and worst > tolerance:
        detail = ", ".join(
            f"{p.address}: {stats[f'weight_sync/server{i}_max_abs_logp_diff']:.3g}"
            for i, p in enumerate(probes)
        )
        raise RuntimeError(
            f"weight sync check failed: servers' greedy log-probs differ from the actor's by "
            f"more than actor.weight_sync_check_tolerance={tolerance} ({detail})"
        )
    return stats


def _as_group(tokens: list[int]) -> dict[str, torch.Tensor]:
    ids = torch.tensor([tokens], dtype=torch.long)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
