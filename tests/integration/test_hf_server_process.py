"""The embedded server launched as its own process, as production launches it."""

from __future__ import annotations

import asyncio

from areal.api.cli_args import GenerationHyperparameters, InferenceEngineConfig, SGLangConfig
from areal.api.io_struct import ModelRequest
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.infra import workflow_context


def test_launch_generate_teardown(tiny_model_dir):
    engine = RemoteSGLangEngine(InferenceEngineConfig(backend="hf:d1", setup_timeout=120))
    args = engine.backend.server_args(
        SGLangConfig(model_path=str(tiny_model_dir), dtype="float32", context_length=512),
        host="127.0.0.1",
        port=None,
    )
    info = engine.launch_server(args)
    try:
        engine.initialize()  # finds the locally launched server
        assert engine.addresses == [info.address]

        async def generate():
            try:
                g = GenerationHyperparameters(
                    greedy=True, max_new_tokens=8, max_tokens=511, ignore_eos=True
                )
                return await engine.agenerate(ModelRequest(input_ids=[1, 2, 3], gconfig=g))
            finally:
                await workflow_context.close_clients()

        response = asyncio.run(generate())
        assert len(response.output_tokens) == 8 and response.stop_reason == "length"
    finally:
        engine.destroy()
    assert info.process.poll() is not None  # torn down with the engine
