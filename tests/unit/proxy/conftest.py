"""Proxy test fixtures: scripted and real engines, and a running proxy."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import pytest
import uvicorn
from transformers import AutoTokenizer

from areal.api.cli_args import InferenceEngineConfig
from areal.api.io_struct import ModelRequest, ModelResponse
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.inference.engine import GenerationEngine
from areal.inference.server import create_app
from areal.proxy.parsers import get_reasoning_parser, get_tool_call_parser
from areal.proxy.server import ProxyServer, uvicorn_options
from areal.utils.serving import GRACEFUL_SHUTDOWN_S
from tests.fakes.live_server import free_port, serve

ADMIN = "admin-key-for-tests-3f9"


class ScriptedEngine:
    """An engine whose replies are scripted texts; records every request it receives."""

    def __init__(
        self, tokenizer: Any, replies: list[str] | Callable[[ModelRequest], str] | None = None
    ):
        self.tokenizer = tokenizer
        self.replies = replies if replies is not None else ["scripted reply"]
        self.requests: list[ModelRequest] = []
        self.responses: list[ModelResponse] = []
        self.version = 0

    def _text(self, req: ModelRequest) -> str:
        if callable(self.replies):
            return self.replies(req)
        index = min(len(self.requests) - 1, len(self.replies) - 1)
        return self.replies[index]

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        self.requests.append(req)
        await asyncio.sleep(0)
        tokens = self.tokenizer(self._text(req), add_special_tokens=False)["input_ids"]
        tokens = [*tokens[: req.gconfig.max_new_tokens - 1], self.tokenizer.eos_token_id]
        response = ModelResponse(
            input_tokens=list(req.input_ids),
            output_tokens=tokens,
            output_logprobs=[-0.25 - 0.01 * i for i in range(len(tokens))],
            output_versions=[self.version] * len(tokens),
            stop_reason="stop",
            latency=0.0,
            ttft=0.0,
            tokenizer=self.tokenizer,
        )
        self.responses.append(response)
        return response

    def set_version(self, version: int) -> None:
        self.version = version

    def get_version(self) -> int:
        return self.version


class RecordingEngine:
    """Wraps a real engine and keeps what went in and came out."""

    def __init__(self, inner: Any):
        self.inner = inner
        self.calls: list[tuple[list[int], ModelResponse]] = []

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        response = await self.inner.agenerate(req)
        self.calls.append((list(req.input_ids), response))
        return response

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="session")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def real_engine(tiny_model_dir):
    generation = GenerationEngine(
        str(tiny_model_dir), device="cpu", max_running_requests=32
    ).start()
    with serve(create_app(generation)) as url:
        remote = RemoteSGLangEngine(InferenceEngineConfig(backend="hf:d1", request_timeout=60))
        remote.initialize(addr=url.removeprefix("http://"))
        yield remote
        remote.destroy()


@contextmanager
def serve_like_the_proxy(app: Any, **limits: Any) -> Iterator[str]:
    """Serve ``app`` on loopback with the HTTP stack of ``python -m areal.proxy.server``."""
    port = free_port()
    config = uvicorn.Config(
        app,
        host="127.0.0.1",
        port=port,
        log_level="warning",
        lifespan="auto",
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **uvicorn_options(**limits),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            server.should_exit = True
            raise RuntimeError(f"proxy on port {port} did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


@contextmanager
def running_proxy(
    engine: Any, tokenizer: Any, http_limits: dict[str, Any] | None = None, **options: Any
) -> Iterator[tuple[str, ProxyServer]]:
    """A :class:`ProxyServer` over ``engine``, served as the real proxy process serves it."""
    options.setdefault("tool_call_parser", get_tool_call_parser("qwen25"))
    options.setdefault("reasoning_parser", get_reasoning_parser("qwen3"))
    options.setdefault("engine_max_tokens", 1800)
    server = ProxyServer(engine, tokenizer, ADMIN, **options)
    with serve_like_the_proxy(server.app, **(http_limits or {})) as url:
        yield url, server


def start_session(url: str, task_id: str = "task", api_key: str | None = None) -> tuple[str, str]:
    admin = {"Authorization": f"Bearer {ADMIN}"}
    httpx.post(f"{url}/grant_capacity", headers=admin).raise_for_status()
    response = httpx.post(
        f"{url}/rl/start_session", headers=admin, json={"task_id": task_id, "api_key": api_key}
    )
    response.raise_for_status()
    body = response.json()
    return body["session_id"], body["api_key"]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}
