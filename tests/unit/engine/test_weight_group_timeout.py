"""``rollout.weight_update_group_timeout`` bounds a weight-update group join, end to end.

The client launches the embedded server as production does (the setting becomes the
server's ``--weight-update-group-timeout``), then asks it to join a group whose trainer
is gone (no listener at the rendezvous address). ``init_weights_update_group`` must fail
after about that timeout, naming the HTTP 400 the server answered, and the server must
still generate.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, SGLangConfig
from areal.api.io_struct import ModelRequest, WeightUpdateMeta
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.infra import workflow_context
from areal.utils.network import find_free_port

TIMEOUT_S = 2.0


def test_a_join_the_trainer_never_answers_fails_after_the_configured_timeout(tiny_model_dir):
    config = InferenceEngineConfig(
        backend="hf:d1", setup_timeout=120, weight_update_group_timeout=TIMEOUT_S
    )
    engine = RemoteSGLangEngine(config)
    args = engine.backend.server_args(
        SGLangConfig(model_path=str(tiny_model_dir), dtype="float32", context_length=512),
        host="127.0.0.1",
        port=None,
    )
    engine.launch_server(args)
    try:
        engine.initialize()
        meta = WeightUpdateMeta(
            type="xccl",
            nccl_master_address="127.0.0.1",
            nccl_master_port=find_free_port(),  # nobody listens: the trainer is gone
            nccl_group_name="gone-trainer",
            comm_backend="gloo",
        )
        begin = time.monotonic()
        with pytest.raises(RuntimeError, match="HTTP 400") as failed:
            engine.init_weights_update_group(meta).result(timeout=60)
        took = time.monotonic() - begin
        assert f"after {TIMEOUT_S:g}" in str(failed.value), failed.value
        assert TIMEOUT_S * 0.75 < took < TIMEOUT_S + 5, took

        async def generate():
            try:
                g = GenerationHyperparameters(max_new_tokens=4, max_tokens=511, ignore_eos=True)
                return await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=g))
            finally:
                await workflow_context.close_clients()

        assert len(asyncio.run(generate()).output_tokens) == 4
    finally:
        engine.destroy()


def test_the_timeout_must_be_positive():
    with pytest.raises(ValueError, match="weight_update_group_timeout"):
        InferenceEngineConfig(backend="hf:d1", weight_update_group_timeout=0).validate()
