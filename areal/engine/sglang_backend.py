"""Request builders for servers that speak SGLang's native HTTP API.

``SGLangBackend`` builds and parses the SGLang calls the client uses (generation, pause,
weight updates, memory release) and the ``sglang.launch_server`` command; ``HFBackend`` is
the same API served by this port's embedded server, with its own launch command.
"""

from __future__ import annotations

import sys
from typing import Any

from areal.api.cli_args import SGLangConfig
from areal.api.io_struct import (
    HttpGenerationResult,
    HttpRequest,
    ModelRequest,
    ParamSpec,
    WeightUpdateMeta,
    WeightUpdateRequests,
)
from areal.utils.command import get_py_cmd

__all__ = ["ABORT_BEFORE_PREFILL", "HFBackend", "SGLangBackend"]

ABORT_BEFORE_PREFILL = "Abort before prefill"


class SGLangBackend:
    """Builds SGLang HTTP requests and parses their responses."""

    name = "sglang"

    def build_generation_request(
        self, req: ModelRequest, max_new_tokens: int, version: int, with_lora: bool = False
    ) -> HttpRequest:
        g = req.gconfig
        params: dict[str, Any] = {
            "top_p": g.top_p,
            "top_k": g.top_k,
            "max_new_tokens": max_new_tokens,
            "temperature": 0.0 if g.greedy else g.temperature,
            "stop_token_ids": list(g.stop_token_ids),
            "ignore_eos": g.ignore_eos,
            "skip_special_tokens": g.skip_special_tokens,
            "frequency_penalty": g.frequency_penalty,
        }
        if g.min_new_tokens:
            params["min_new_tokens"] = g.min_new_tokens
        if g.stop:
            params["stop"] = list(g.stop)
        if g.seed is not None:
            params["sampling_seed"] = g.seed
        payload: dict[str, Any] = {
            "input_ids": list(req.input_ids),
            "sampling_params": params,
            "return_logprob": True,
            "stream": False,
        }
        if req.image_data:
            payload["image_data"] = req.image_data
        if with_lora:
            payload["lora_path"] = f"{g.lora_name}-v{version}"
        return HttpRequest("/generate", payload)

    def parse_generation_response(self, response: dict[str, Any]) -> HttpGenerationResult:
        meta = response["meta_info"]
        finish = meta["finish_reason"]
        reason = finish["type"]
        if reason == "abort" and str(finish.get("message", "")).startswith(ABORT_BEFORE_PREFILL):
            return HttpGenerationResult([], [], "abort")
        pairs = meta.get("output_token_logprobs") or []
        tokens = [int(p[1]) for p in pairs]
        logprobs = [float(p[0]) for p in pairs]
        output_ids = response.get("output_ids")
        if output_ids is not None and list(output_ids) != tokens:
            raise RuntimeError("server output_ids and output_token_logprobs disagree")
        if any(lp != lp or lp in (float("inf"), float("-inf")) for lp in logprobs):
            raise RuntimeError("server returned non-finite log-probs")
        return HttpGenerationResult(tokens, logprobs, reason)

    def build_disk_weight_update_requests(self, meta: WeightUpdateMeta) -> WeightUpdateRequests:
        return WeightUpdateRequests(
            [
                HttpRequest(
                    "/update_weights_from_disk",
                    {"model_path": meta.path, "abort_all_requests": True},
                )
            ]
        )

    def build_init_weights_group_request(
        self, server_idx: int, meta: WeightUpdateMeta
    ) -> HttpRequest:
        """Server ``server_idx`` joins with ranks ``rank_offset + tp_rank`` (SGLang's rule)."""
        return HttpRequest(
            "/init_weights_update_group",
            {
                "master_address": meta.nccl_master_address,
                "master_port": int(meta.nccl_master_port),
                "rank_offset": meta.rank_offset(server_idx),
                "world_size": meta.group_world_size,
                "group_name": meta.nccl_group_name,
                "backend": meta.comm_backend,
            },
        )

    def build_distributed_weight_update_requests(
        self, meta: WeightUpdateMeta, param_specs: list[ParamSpec], group_name: str | None = None
    ) -> WeightUpdateRequests:
        payload = {
            "names": [p.name for p in param_specs],
            "dtypes": [p.dtype for p in param_specs],
            "shapes": [list(p.shape) for p in param_specs],
            "group_name": group_name or meta.nccl_group_name,
            "abort_all_requests": True,
        }
        return WeightUpdateRequests([HttpRequest("/update_weights_from_distributed", payload)])

    def begin_weight_update_request(self) -> HttpRequest:
        """Open a weight-update session (SGLang 0.5.23 loads tensors, by handle or by
        broadcast, only inside one; 0.5.10.post1 has no such route)."""
        return HttpRequest("/begin_weight_update", {})

    def end_weight_update_request(self) -> HttpRequest:
        return HttpRequest("/end_weight_update", {})

    def build_tensor_weight_update_request(
        self, serialized_named_tensors: list[str], *, flush_cache: bool, weight_version: str | None
    ) -> HttpRequest:
        """One bucket handed over by handle: one serialized ``flattened_bucket`` per TP rank
        of the server (see :mod:`areal.engine.tensor_share`)."""
        payload: dict[str, Any] = {
            "serialized_named_tensors": list(serialized_named_tensors),
            "load_format": "flattened_bucket",
            "flush_cache": flush_cache,
            "abort_all_requests": False,  # the weight-update barrier paused the server
        }
        if weight_version is not None:
            payload["weight_version"] = weight_version
        return HttpRequest("/update_weights_from_tensor", payload)

    def pause_requests(self) -> list[HttpRequest]:
        return [
            HttpRequest("/pause_generation", {}),
            HttpRequest("/pause_generation", {"mode": "in_place"}),
        ]

    def continue_request(self) -> HttpRequest:
        return HttpRequest("/continue_generation", {})

    def weight_version_request(self, version: int) -> HttpRequest:
        """The server's weight version (reported in each ``/generate``'s ``meta_info``);
        nothing runs when it is set, so nothing needs aborting."""
        return HttpRequest(
            "/update_weight_version", {"new_version": str(version), "abort_all_requests": False}
        )

    def abort_all_request(self) -> HttpRequest:
        return HttpRequest("/abort_request", {"abort_all": True})

    def offload_request(self, tags: list[str] | None) -> HttpRequest:
        return HttpRequest("/release_memory_occupation", {"tags": tags} if tags else {})

    def onload_request(self, tags: list[str] | None) -> HttpRequest:
        return HttpRequest("/resume_memory_occupation", {"tags": tags} if tags else {})

    def launch_command(
        self, server_args: dict[str, Any], api_key_from_env: bool = False
    ) -> list[str]:
        """argv of one server (``host``/``port`` included in ``server_args``).

        With ``api_key_from_env``, SGLang starts through :mod:`areal.engine.sglang_launch`,
        which hands SGLang the API key from ``AREAL_INFERENCE_API_KEY`` instead of argv.
        """
        from areal.api.config.inference import spell_for_sglang, target_sglang_version

        module = "areal.engine.sglang_launch" if api_key_from_env else "sglang.launch_server"
        # spelled for the SGLang installed here, where the server runs (the controller that
        # built the arguments may have another version, or none)
        args = spell_for_sglang(server_args, target_sglang_version())
        return get_py_cmd(module, args, python=sys.executable)

    def server_args(
        self, sglang: SGLangConfig, host: str, port: int, tp_size: int = 1, base_gpu_id: int = 0
    ) -> dict[str, Any]:
        return SGLangConfig.build_args(
            sglang, tp_size=tp_size, base_gpu_id=base_gpu_id, host=host, port=port
        )


class HFBackend(SGLangBackend):
    """The embedded ``transformers`` server (``python -m areal.inference.server``)."""

    name = "hf"

    def launch_command(
        self, server_args: dict[str, Any], api_key_from_env: bool = False
    ) -> list[str]:
        # the embedded server reads AREAL_INFERENCE_API_KEY itself
        return get_py_cmd("areal.inference.server", server_args, python=sys.executable)

    def server_args(
        self, sglang: SGLangConfig, host: str, port: int, tp_size: int = 1, base_gpu_id: int = 0
    ) -> dict[str, Any]:
        # the model runs on one device; t sets the ranks it joins weight-update groups with
        return {
            "model_path": sglang.model_path,
            "host": host,
            "port": port,
            "dtype": sglang.dtype if sglang.dtype in ("float32", "bfloat16", "float16") else "auto",
            "context_length": sglang.context_length,
            "max_running_requests": sglang.max_running_requests,
            "random_seed": sglang.random_seed,
            "tp_size": tp_size,
        }
