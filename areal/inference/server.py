"""Embedded inference server: the subset of SGLang's native HTTP API that AReaL uses.

``python -m areal.inference.server --model-path P --host H --port N [--dtype D]
[--device cpu|cuda]`` serves a ``transformers`` model with continuous batching (backend
``hf`` in allocation strings). ``RemoteSGLangEngine`` drives it exactly as it drives
SGLang: token ids in, token ids and log-probs out.

Endpoints: ``GET /health``, ``GET /get_model_info``, ``GET /get_server_info``,
``POST /generate``, ``POST /pause_generation``, ``POST /continue_generation``,
``POST /abort_request``, ``POST /update_weights_from_disk``, ``POST /flush_cache``,
``POST /release_memory_occupation``, ``POST /resume_memory_occupation``,
``POST /update_weight_version``, ``GET /get_weight_version`` (the weight version is also
in every ``/generate``'s ``meta_info``, as SGLang reports it),
``POST /init_weights_update_group``, ``POST /update_weights_from_distributed``,
``POST /begin_weight_update``, ``POST /update_weights_from_tensor`` (tensors handed over
by handle from a colocated process, read by :mod:`areal.inference.tensor_payloads`; only
inside a session, as SGLang 0.5.23 requires) and ``POST /end_weight_update``. Bad
requests get HTTP 400 with ``{"error": {"message", "type", "param"}}``, an oversized field
included (:mod:`areal.inference.bodies` bounds every string and list); the server keeps
serving. A request whose generation fails alone (see :mod:`areal.inference.engine`) gets
500.

A weight-update group join runs beside the generation loop and fails after
``--weight-update-group-timeout`` seconds with SGLang's answer to a failed join (400,
``{"success": false, "message"}``); on SIGTERM a pending join answers 503 at once, so it
never holds up the shutdown.

Authentication is SGLang's (:mod:`areal.inference.auth`): with the key in
``AREAL_INFERENCE_API_KEY`` every route but ``/health*`` needs ``Authorization: Bearer
<key>`` (401 otherwise). Without a key the server only listens on loopback. Transport
limits (:data:`LIMITS`, enforced by :mod:`areal.utils.http_limits`): a body over
``--max-body-bytes`` gets 413 and one that stalls ``--body-timeout`` seconds 408; headers
must arrive within ``--header-timeout`` seconds (408, or a silent close of a connection
that sent nothing) and fit ``--max-header-bytes`` (431); a request unanswered after
``--request-deadline`` seconds gets 504 and its generation is cancelled, which frees its
batch slot. Bodies are read in chunks as they arrive, so a slow or large upload never
holds the event loop; decoding a body costs the loop about 12 ms per MiB, which the size
cap bounds.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ipaddress
import os
import socket
import sys
import uuid
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from areal.inference.auth import API_KEY_ENV, APIKeyMiddleware
from areal.inference.bodies import (
    AbortBody,
    DistributedUpdateBody,
    GenerateBody,
    InitWeightsGroupBody,
    MemoryBody,
    PauseBody,
    TensorUpdateBody,
    UpdateFromDiskBody,
    WeightVersionBody,
)
from areal.inference.engine import GenerationEngine, GenerationRequest, RequestError
from areal.inference.sampling import SamplingParams
from areal.inference.weight_group import JOIN_TIMEOUT_S
from areal.utils import logging
from areal.utils.http_limits import (
    BodyLimitMiddleware,
    Headers,
    HttpLimits,
    LimitFlags,
    Refusal,
    Scope,
    uvicorn_settings,
)
from areal.utils.lifeline import exit_with_parent
from areal.utils.serving import GRACEFUL_SHUTDOWN_S

__all__ = ["LIMITS", "create_app", "main", "uvicorn_options"]

logger = logging.getLogger("inference.server")

LIMITS = HttpLimits(
    max_body_bytes=4 * 1024 * 1024,  # holds a prompt of ~500k token ids
    body_timeout=60.0,
    request_deadline=3600.0,
    header_timeout=10.0,
    max_header_bytes=64 * 1024,
    keep_alive_timeout=5.0,  # SGLang's default
)
"""The embedded server's request limits by default (its flags change them)."""
JOIN_ANSWER_SLACK_S = 5.0  # past the join's own timeout, before its answer gives up on it
LIMIT_FLAGS = LimitFlags(
    LIMITS,
    (
        "--max-body-bytes",
        "--max-header-bytes",
        "--header-timeout",
        "--body-timeout",
        "--keep-alive-timeout",
        "--request-deadline",
    ),
)


def limit_error(refusal: Refusal, scope: Scope | None) -> tuple[Headers, bytes]:
    """A refusal by the request limits, in the server's error shape."""
    error = {"message": refusal.message, "type": "invalid_request_error", "param": None}
    return [(b"content-type", b"application/json")], orjson.dumps({"error": error})


def uvicorn_options(limits: HttpLimits = LIMITS) -> dict[str, Any]:
    """uvicorn settings of the server: the HTTP protocol with its header limits, keep-alive."""
    return uvicorn_settings(
        limits, error_shape=limit_error, header_timeout_reply="after_first_byte"
    )


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return JSONResponse(
        status_code=status, content={"error": {"message": message, "type": kind, "param": param}}
    )


def _join_failed(reason: str) -> JSONResponse:
    """SGLang's answer to a failed join (400, ``success: false``), with this server's error."""
    message = f"Failed to join the weight-update group: {reason}"
    error = {"message": message, "type": "invalid_request_error", "param": None}
    return JSONResponse(
        status_code=400, content={"success": False, "message": message, "error": error}
    )


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    first = exc.errors()[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return "the request body is not valid JSON", None
    field = ".".join(loc) or None
    return (f"{field}: {first.get('msg')}" if field else str(first.get("msg"))), field


def create_app(
    engine: GenerationEngine, *, api_key: str | None = None, limits: HttpLimits = LIMITS
) -> FastAPI:
    """The HTTP app over a started :class:`GenerationEngine` (stopped on shutdown).

    With ``api_key`` every route but ``/health*`` needs ``Authorization: Bearer
    <api_key>``; ``limits`` caps bodies and deadlines.
    """

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        engine.stop()

    app = FastAPI(title="AReaL embedded inference server", lifespan=lifespan)
    weight_version = {"value": "default"}  # SGLang's default weight version

    @app.exception_handler(RequestValidationError)
    async def on_validation_error(request: Request, exc: RequestValidationError):
        message, field = _validation_message(exc)
        return _error(400, message, field)

    @app.exception_handler(RequestError)
    async def on_request_error(request: Request, exc: RequestError):
        return _error(400, str(exc), exc.param)

    @app.exception_handler(HTTPException)
    async def on_http_error(request: Request, exc: HTTPException):
        # e.g. a body FastAPI cannot parse at all (too deeply nested, not UTF-8)
        message = "the request body could not be parsed" if exc.status_code == 400 else None
        response = _error(exc.status_code, message or str(exc.detail))
        response.headers.update(exc.headers or {})
        return response

    async def run_command(name: str, **kwargs: Any) -> dict[str, Any]:
        return await asyncio.wrap_future(engine.command(name, **kwargs))

    @app.get("/health")
    @app.get("/health_generate")
    async def health():
        # like SGLang's, health means the generation loop answers, not just the HTTP layer
        stalled = engine.stalled_for()
        if stalled is not None:
            return _error(503, f"the generation loop has not turned for {stalled:.0f} s")
        return {"status": "ok"}

    @app.get("/get_model_info")
    async def model_info() -> dict[str, Any]:
        return {
            "model_path": engine.model_path,
            "tokenizer_path": engine.model_path,
            "is_generation": True,
        }

    @app.get("/get_server_info")
    async def server_info() -> dict[str, Any]:
        return {
            "backend": "hf",
            "device": str(engine.device),
            "dtype": str(engine.dtype).replace("torch.", ""),
            "context_length": engine.context_length,
            "max_running_requests": engine.max_running,
            "paused": engine.paused,
            "memory_released": engine.memory_released,
            "tp_size": len(engine.tp_devices),
            **engine.load(),
            **dict(engine.stats),
        }

    @app.post("/generate")
    async def generate(body: GenerateBody):
        if body.stream:
            raise RequestError("stream=true is not supported by this server", "stream")
        if body.lora_path:
            raise RequestError("LoRA adapters are not supported by this server", "lora_path")
        p = body.sampling_params
        unsupported = p.unsupported()
        if unsupported:
            raise RequestError(
                f"sampling_params.{unsupported} is not supported by this server",
                f"sampling_params.{unsupported}",
            )
        stop = list(p.stop or [])
        params = SamplingParams(
            max_new_tokens=p.max_new_tokens,
            min_new_tokens=p.min_new_tokens,
            temperature=p.temperature,
            top_p=p.top_p,
            top_k=p.top_k,
            min_p=p.min_p,
            stop_token_ids=list(p.stop_token_ids or []),
            stop=stop,
            ignore_eos=p.ignore_eos,
            skip_special_tokens=p.skip_special_tokens,
            frequency_penalty=p.frequency_penalty,
            presence_penalty=p.presence_penalty,
            repetition_penalty=p.repetition_penalty,
            sampling_seed=p.sampling_seed,
        )
        rid = body.rid or uuid.uuid4().hex
        future = engine.submit(GenerationRequest(list(body.input_ids), params, rid))  # 400s
        try:
            result = await asyncio.wrap_future(future)
        except Exception as e:  # this request alone failed; the others go on
            return _error(500, f"generation of request {rid} failed: {e}")
        meta: dict[str, Any] = {
            "id": result.rid,
            "finish_reason": result.finish_reason,
            "prompt_tokens": result.prompt_tokens,
            "completion_tokens": len(result.output_ids),
            "cached_tokens": 0,
            "e2e_latency": result.latency,
            "weight_version": weight_version["value"],
        }
        if body.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tok, None] for lp, tok in zip(result.output_logprobs, result.output_ids)
            ]
        text = ""
        if engine.tokenizer is not None:
            text = engine.tokenizer.decode(
                result.output_ids, skip_special_tokens=params.skip_special_tokens
            )
        return {"text": text, "output_ids": result.output_ids, "meta_info": meta}

    @app.post("/pause_generation")
    async def pause(body: PauseBody | None = None) -> dict[str, Any]:
        mode = (body or PauseBody()).mode
        if mode not in ("abort", "in_place", "retract"):
            raise RequestError(f"unknown pause mode {mode!r}; use abort or in_place", "mode")
        return await run_command("pause", mode="in_place" if mode == "in_place" else "abort")

    @app.post("/continue_generation")
    async def resume_generation() -> dict[str, Any]:
        return await run_command("continue")

    @app.post("/update_weight_version")
    async def update_weight_version(body: WeightVersionBody) -> dict[str, Any]:
        if body.abort_all_requests:
            await run_command("abort", rid=None)
        weight_version["value"] = body.new_version
        return {"success": True, "message": f"weight version {body.new_version}"}

    @app.get("/get_weight_version")
    async def get_weight_version() -> dict[str, Any]:
        return {"weight_version": weight_version["value"]}

    @app.post("/abort_request")
    async def abort(body: AbortBody) -> dict[str, Any]:
        if not body.abort_all and not body.rid:
            raise RequestError("give a rid or abort_all=true", "rid")
        return await run_command("abort", rid=None if body.abort_all else body.rid)

    @app.post("/update_weights_from_disk")
    async def update_from_disk(body: UpdateFromDiskBody) -> dict[str, Any]:
        return await run_command(
            "update_weights", model_path=body.model_path, abort_all_requests=body.abort_all_requests
        )

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> dict[str, Any]:
        return {"success": True, "message": "no prefix cache to flush"}

    @app.post("/release_memory_occupation")
    async def release(body: MemoryBody | None = None) -> dict[str, Any]:
        return await run_command("release", tags=(body or MemoryBody()).tags)

    @app.post("/resume_memory_occupation")
    async def resume_memory(body: MemoryBody | None = None) -> dict[str, Any]:
        return await run_command("resume", tags=(body or MemoryBody()).tags)

    @app.post("/init_weights_update_group")
    async def init_weights_group(body: InitWeightsGroupBody) -> Any:
        if body.backend not in ("nccl", "gloo"):
            raise RequestError(
                f"backend must be nccl (GPU) or gloo (CPU), got {body.backend!r}", "backend"
            )
        if engine.closing:
            return _error(503, "the server is shutting down")
        answer = engine.join_weight_group(
            master_address=body.master_address,
            master_port=body.master_port,
            rank_offset=body.rank_offset,
            world_size=body.world_size,
            group_name=body.group_name,
            backend=body.backend,
        )
        # the join gives up after engine.weight_group_timeout; past that (a frozen
        # engine loop) or on a shutdown signal, this answer gives up on it
        waiting = asyncio.wrap_future(answer)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + engine.weight_group_timeout + JOIN_ANSWER_SLACK_S
        while not waiting.done():
            if engine.closing or loop.time() > deadline:
                answer.cancel()
                if engine.closing:
                    return _error(503, "the server is shutting down; the join was abandoned")
                return _join_failed(f"no answer in {engine.weight_group_timeout:g} s")
            await asyncio.wait({waiting}, timeout=0.1)
        error = waiting.exception()
        if isinstance(error, RequestError):
            raise error
        if error is not None:
            # c10d errors carry a C++ stack after their first line
            reason = (str(error).strip().splitlines() or [""])[0][:500]
            return _join_failed(f"{type(error).__name__}: {reason}")
        return waiting.result()

    @app.post("/update_weights_from_distributed")
    async def update_distributed(body: DistributedUpdateBody) -> dict[str, Any]:
        return await run_command(
            "update_weights_distributed",
            names=body.names,
            dtypes=body.dtypes,
            shapes=body.shapes,
            group_name=body.group_name,
            abort_all_requests=body.abort_all_requests,
        )

    @app.post("/begin_weight_update")
    async def begin_weight_update(body: dict[str, Any] | None = None) -> dict[str, Any]:
        return await run_command("begin_weight_update")

    @app.post("/end_weight_update")
    async def end_weight_update(body: dict[str, Any] | None = None) -> dict[str, Any]:
        return await run_command("end_weight_update")

    @app.post("/update_weights_from_tensor")
    async def update_from_tensor(body: TensorUpdateBody) -> dict[str, Any]:
        answer = await run_command(
            "update_weights_from_tensor",
            serialized_named_tensors=body.serialized_named_tensors,
            load_format=body.load_format,
            abort_all_requests=body.abort_all_requests,
        )
        if body.weight_version is not None:
            weight_version["value"] = body.weight_version
        return answer  # flush_cache: this server keeps no prefix cache across requests

    # the last added runs first: authentication before any body byte is read
    app.add_middleware(BodyLimitMiddleware, limits=limits, error_shape=limit_error)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


def _is_loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m areal.inference.server",
        description="Serve a transformers model over SGLang's native HTTP API.",
    )
    parser.add_argument("--model-path", required=True, help="HF model directory")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"]
    )
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument(
        "--context-length",
        type=int,
        default=None,
        help="prompt + completion limit (default: the model's max positions)",
    )
    parser.add_argument(
        "--max-running-requests", type=int, default=64, help="requests decoded together at most"
    )
    parser.add_argument(
        "--max-prefill-tokens",
        type=int,
        default=16384,
        help="padded prompt tokens prefilled in one forward pass at most",
    )
    parser.add_argument("--random-seed", type=int, default=0)
    parser.add_argument(
        "--tp-size",
        type=int,
        default=1,
        help="ranks this server joins a weight-update group with (the model runs on one "
        "device; TP ranks beyond the first receive every broadcast and drop it)",
    )
    parser.add_argument(
        "--weight-update-group-timeout",
        type=_positive_seconds,
        default=JOIN_TIMEOUT_S,
        help="seconds a /init_weights_update_group join may take before it fails (default "
        f"{JOIN_TIMEOUT_S:g}; rollout.weight_update_group_timeout); generation goes on "
        "meanwhile",
    )
    parser.add_argument("--log-level", default="warning")
    LIMIT_FLAGS.add_arguments(
        parser, f"the API key is read from {API_KEY_ENV}, never from the command line"
    )
    return parser


def _positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 seconds, got {text}")
    return value


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE

    class Server(uvicorn.Server):
        """uvicorn's server, which also tells the engine at once that a signal came in."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            engine.begin_shutdown()  # pending weight-group joins answer 503 now
            super().handle_exit(sig, frame)

    parser = _parser()
    args = parser.parse_args(argv)
    limits = LIMIT_FLAGS.parse(parser, args)
    # read once and dropped from the environment, so nothing this process starts inherits it
    api_key = os.environ.pop(API_KEY_ENV, "").strip()
    if not api_key and not _is_loopback(args.host):
        parser.error(
            f"set {API_KEY_ENV}: without an API key this server only listens on loopback, "
            f"and {args.host!r} can be reached from other machines"
        )
    logging.register_secret(api_key)
    exit_with_parent()  # stop with the rollout worker that launched this server
    engine = GenerationEngine(
        args.model_path,
        device=args.device,
        dtype=args.dtype,
        context_length=args.context_length,
        max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens,
        seed=args.random_seed,
        tp_size=args.tp_size,
        weight_group_timeout=args.weight_update_group_timeout,
    ).start()
    if not api_key:
        logger.warning("no %s: serving %s without authentication", API_KEY_ENV, args.host)
    logger.info("serving %s on %s:%d (%s)", args.model_path, args.host, args.port, engine.device)
    config = uvicorn.Config(
        create_app(engine, api_key=api_key or None, limits=limits),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **uvicorn_options(limits),
    )
    server = Server(config)
    with contextlib.suppress(KeyboardInterrupt):  # uvicorn re-raises a captured Ctrl-C
        server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)


if __name__ == "__main__":
    main()
