"""The rollout proxy's command line: ``python -m areal.proxy.server [flags]``.

Flags, the admin key (``SWE_RL_ADMIN_API_KEY``, never argv), the engine client, the
inference server's context length (``--context-length``, else asked from the server) and
uvicorn with the proxy's request limits; :mod:`areal.proxy.server` documents the routes.
The process stops with the rollout worker that launched it.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from typing import Any

from areal.proxy.keys import validate_admin_key
from areal.proxy.server import (
    DEFAULT_EXPORT_TIMEOUT_S,
    LIMIT_FLAGS,
    ProxyServer,
    uvicorn_options,
)
from areal.proxy.sessions import SessionStore
from areal.utils import logging
from areal.utils.lifeline import exit_with_parent

__all__ = ["main", "server_context_length"]

logger = logging.getLogger("proxy.server")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m areal.proxy.server",
        description="Rollout proxy: OpenAI/Anthropic-compatible endpoints that record tokens. "
        "The admin key is read from SWE_RL_ADMIN_API_KEY.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--engine-addr", required=True, help="HOST:PORT of the inference server")
    parser.add_argument("--tokenizer-path", required=True)
    parser.add_argument("--tool-call-parser", default="qwen25")
    parser.add_argument("--reasoning-parser", default="qwen3")
    parser.add_argument("--chat-template-type", default="hf", choices=["hf", "concat"])
    parser.add_argument("--engine-max-tokens", type=int, default=None)
    parser.add_argument(
        "--context-length",
        type=_positive(int),
        default=None,
        help="the inference server's context window in tokens (default: asked from the server)",
    )
    parser.add_argument("--session-timeout", type=float, default=3600.0)
    parser.add_argument("--request-timeout", type=float, default=3600.0)
    parser.add_argument("--log-level", default="warning")
    parser.add_argument(
        "--expected-temperature",
        type=float,
        default=None,
        help="actor.temperature: requests sampled otherwise are counted and warned about once",
    )
    parser.add_argument(
        "--deterministic-sampling",
        action="store_true",
        help="rollout.deterministic_sampling: seed requests without a seed per session turn",
    )
    parser.add_argument(
        "--message-preprocessor",
        action="append",
        default=[],
        metavar="DOTTED.PATH",
        help="a preprocessor class (repeatable, applied in order)",
    )
    parser.add_argument(
        "--prefix-matcher", default=None, metavar="DOTTED.PATH", help="parent matcher function"
    )
    parser.add_argument(
        "--barrier-state",
        default=None,
        metavar="PATH",
        help="the rollout worker's weight-update barrier file: generation is held while it "
        "is closed and tokens carry its version (default: none, version 0, never held)",
    )
    limits = LIMIT_FLAGS.add_arguments(parser)
    limits.add_argument(
        "--export-timeout",
        type=_positive(float),
        default=DEFAULT_EXPORT_TIMEOUT_S,
        help="seconds an export waits for its session to be ended before 409 (default %(default)s)",
    )
    limits.add_argument(
        "--session-id-nonce",
        default=None,
        metavar="NONCE",
        help="1-32 letters or digits that end every session id (default: random per start)",
    )
    return parser


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def server_context_length(address: str, headers: dict[str, str]) -> int | None:
    """The context length the inference server at ``address`` reports, if any.

    The embedded server and SGLang report ``context_length`` in ``/get_server_info``
    (SGLang's is null where the model's own window applies); SGLang's ``/v1/models``
    gives the window it serves as ``max_model_len``.
    """
    import httpx

    reads = (
        ("/get_server_info", lambda info: info.get("context_length")),
        ("/v1/models", lambda info: (info.get("data") or [{}])[0].get("max_model_len")),
    )
    with httpx.Client(timeout=30, trust_env=False) as client:
        for path, read in reads:
            try:
                response = client.get(f"http://{address}{path}", headers=headers)
                value = read(response.json()) if response.status_code == 200 else None
            except (httpx.HTTPError, ValueError, AttributeError, IndexError, TypeError):
                continue
            if isinstance(value, int) and not isinstance(value, bool) and value >= 2:
                return value
    return None


def main(argv: list[str] | None = None) -> None:
    import uvicorn
    from transformers import AutoTokenizer

    from areal.api.cli_args import InferenceEngineConfig
    from areal.engine.sglang_remote import RemoteSGLangEngine
    from areal.proxy.parsers import get_reasoning_parser_or_none, get_tool_call_parser_or_none
    from areal.proxy.plugins import load_message_preprocessors, load_prefix_matcher
    from areal.utils.secrets import reveal

    parser = _parser()
    args = parser.parse_args(argv)
    limits = LIMIT_FLAGS.parse(parser, args)
    admin_key = os.environ.get("SWE_RL_ADMIN_API_KEY", "")
    if not admin_key.strip():
        print(
            "areal.proxy.server: error: set SWE_RL_ADMIN_API_KEY (the admin key is never "
            "taken from the command line)",
            file=sys.stderr,
        )
        sys.exit(2)
    try:
        SessionStore(admin_key, run_nonce=args.session_id_nonce)  # a bad nonce fails here
        tool_parser = get_tool_call_parser_or_none(args.tool_call_parser)
        reasoning_parser = get_reasoning_parser_or_none(args.reasoning_parser)
        preprocessors = load_message_preprocessors(args.message_preprocessor)
        prefix_matcher = load_prefix_matcher(args.prefix_matcher)
        validate_admin_key(admin_key, args.host)
    except ValueError as e:
        print(f"areal.proxy.server: error: {e}", file=sys.stderr)
        sys.exit(2)
    engine = RemoteSGLangEngine(
        InferenceEngineConfig(backend="sglang:d1", request_timeout=args.request_timeout)
    )
    if args.barrier_state:  # pause and version come from the rollout worker, never by call
        engine.attach_barrier(args.barrier_state)
    engine.initialize(addr=args.engine_addr)
    context_length = args.context_length
    if context_length is None:
        key = reveal(engine.api_key)
        auth = {"Authorization": f"Bearer {key}"} if key else {}
        context_length = server_context_length(args.engine_addr, auth)
        if context_length is None:
            logger.warning(
                "%s does not report its context length: prompts are limited to the default "
                "(pass --context-length)",
                args.engine_addr,
            )
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path)
    server = ProxyServer(
        engine,
        tokenizer,
        admin_key,
        host=args.host,
        tool_call_parser=tool_parser,
        reasoning_parser=reasoning_parser,
        chat_template_type=args.chat_template_type,
        engine_max_tokens=args.engine_max_tokens,
        context_length=context_length,
        session_timeout=args.session_timeout,
        preprocessors=preprocessors,
        prefix_matcher=prefix_matcher,
        expected_temperature=args.expected_temperature,
        deterministic=args.deterministic_sampling,
        max_body_bytes=limits.max_body_bytes,
        body_timeout=limits.body_timeout,
        export_timeout=args.export_timeout,
        run_nonce=args.session_id_nonce,
    )
    server.chat.warm_up()
    # Everything loaded so far (torch, transformers, the tokenizer) lives as long as the
    # process: keep it out of the cyclic collector's scans, which otherwise stall every
    # request for ~100 ms at each full collection.
    gc.collect()
    gc.freeze()
    logger.info("proxy on %s:%d in front of %s", args.host, args.port, args.engine_addr)
    from areal.utils.serving import GRACEFUL_SHUTDOWN_S

    exit_with_parent()  # a rollout worker killed outright does not leave its proxy behind

    uvicorn.run(
        server.app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=False,
        proxy_headers=False,
        backlog=4096,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        **uvicorn_options(limits),
    )
