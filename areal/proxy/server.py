"""The rollout proxy server: OpenAI, Responses and Anthropic endpoints over one engine.

``python -m areal.proxy.server --host H --port N --engine-addr HOST:PORT
--tokenizer-path PATH [--tool-call-parser NAME] [--reasoning-parser NAME]
[--chat-template-type hf|concat] [--engine-max-tokens N] [--context-length N] [limits, see
below]`` reads the admin key from ``SWE_RL_ADMIN_API_KEY`` (never from argv) and refuses to
start without one.

Session endpoints (admin key): ``POST /grant_capacity``, ``/rl/start_session``,
``/export_trajectories``, ``/rl/stats``
(the metrics recorded here since the last call, in ``stats_tracker``'s mergeable form, for
the rollout worker's ``export_stats``). Session-key
endpoints: ``POST /rl/end_session``, ``/rl/set_reward``. Generation (session key, or the
gateway key with ``X-Session-Id``/``X-Session-Token``): ``POST /chat/completions``,
``/v1/chat/completions``, ``/responses``, ``/v1/responses``, ``/v1/messages`` (streaming
and not). ``GET /health``; ``HEAD /``.

Status codes: 401 no/unknown key or bad session headers, 403 a key without the needed
capability (not admin on admin endpoints, the gateway key on reward/end), 410 a key or
session token whose session has ended (no more generation or rewards) or was exported,
400 a malformed request naming the field (``context_length_exceeded``, naming the token
limit, when the prompt leaves no room), 408 a request whose headers or body stall, 409 an
export of a session that was not ended within ``--export-timeout``, 413 a body over
``--max-body-bytes``, 431 headers over ``--max-header-bytes``, 422 a non-JSON content
type, 429 no session capacity, 500 a failure inside the proxy (reported to the session's
diagnostics). A client error never marks the session as having seen a system failure.

Limits (flags; defaults in parentheses): ``--max-body-bytes`` (16 MiB) for every
endpoint, checked against ``Content-Length`` first and while reading; ``--body-timeout``
(60 s without body bytes); ``--header-timeout`` (30 s for a request's headers);
``--max-header-bytes`` (64 KiB); ``--idle-timeout`` (300 s for a kept-alive connection
between requests); ``--export-timeout`` (300 s for a session to end before its export
fails). Requests of 64 KiB or more are parsed and tokenized on worker threads, so one
large prompt does not stall the other sessions; those of 1 MiB or more run one at a time.

Session ids are ``<task_id>-<n>.<nonce>`` with a random nonce per start
(``--session-id-nonce`` to choose it), so no id repeats across exports or resumed runs.

Prompt size: a call's tokens (prompt + completion) stay within ``--engine-max-tokens``,
else under the inference server's context length (``--context-length``; by default asked
from the server's ``/get_server_info``, then SGLang's ``/v1/models``; 32,768 if it does
not say). A prompt whose text alone cannot fit (more bytes than that limit times the most
bytes one token of the tokenizer stands for, computed at start) gets the 400
``context_length_exceeded`` before it is rendered or tokenized (see
:mod:`areal.proxy.prompt_size`): tokenizing costs 100-150 bytes of memory per byte of
text, and a 15 MB prompt used to take this process past 2.6 GB before its token count
refused it. Prompts under that bound are tokenized. A call refused for its length is
counted in its session (``interaction_count``) but keeps none of its prompt.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import dataclasses
import math
from collections.abc import AsyncIterator, Iterable
from typing import Any

import numpy as np
import orjson

from areal.infra import workflow_context
from areal.proxy.adapters.protocols import (
    SSE_HEADERS,
    Translated,
    error_body,
    from_chat,
    sse_chunks,
    stream_events,
    to_chat,
)
from areal.proxy.asgi import JSON, App, Endpoint, Request, Response, StreamingResponse
from areal.proxy.chat import PROXY_TRACKER, ChatGenerator
from areal.proxy.errors import ContextLengthExceededError, InvalidRequestError
from areal.proxy.interaction import COLUMN_DTYPES, Interaction, PrefixMatcher
from areal.proxy.keys import candidate_tokens, derive_gateway_key, same_secret, validate_admin_key
from areal.proxy.memory import MemoryReleaser
from areal.proxy.messages import MessagePreprocessor
from areal.proxy.sessions import ProxyAuthError, Session, SessionStore
from areal.utils import logging, stats_tracker
from areal.utils.http_limits import (
    BodyLimitMiddleware,
    Headers,
    HttpLimits,
    LimitFlags,
    Refusal,
    Scope,
    uvicorn_settings,
)

__all__ = [
    "LIMITS",
    "ProxyServer",
    "main",
    "serialize_interactions",
    "uvicorn_options",
]

logger = logging.getLogger("proxy.server")


def json_response(content: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(content), status)


def error(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    anthropic: bool = False,
    param: str | None = None,
    **extra: Any,
) -> Response:
    protocol = "anthropic" if anthropic else "chat_completions"
    return json_response(error_body(protocol, message, kind, param, **extra), status)


def _packed(values: Any, dtype: str, shape: list[int]) -> dict[str, Any]:
    data = np.asarray(values, dtype=dtype).tobytes()
    return {"dtype": dtype, "shape": shape, "data": base64.b64encode(data).decode("ascii")}


def serialize_interactions(interactions: Iterable[Interaction], session_id: str) -> list[dict]:
    """Exported interactions as JSON: tensors travel as base64 of their raw bytes."""
    out = []
    for interaction in interactions:
        cols = interaction.columns()
        n = len(cols["input_ids"])
        tensors = {
            key: _packed(cols[key], str(dtype).removeprefix("torch."), [1, n])
            for key, dtype in COLUMN_DTYPES
        }
        tensors["attention_mask"] = _packed(np.ones(n, dtype=bool), "bool", [1, n])
        reward, original = interaction.rewards()
        tensors["rewards"] = _packed([reward], "float32", [1])
        tensors["original_rewards"] = _packed([original], "float32", [1])
        out.append(
            {
                "id": interaction.id,
                "reward": interaction.reward,
                "tensors": tensors,
                "metadata": {"session_id": session_id, **interaction.metadata},
            }
        )
    return out


class _Endpoint:
    """One handler, with proxy errors mapped to statuses (and Anthropic's error shape)."""

    __slots__ = ("anthropic", "handler")

    def __init__(self, handler: Endpoint, anthropic: bool):
        self.handler, self.anthropic = handler, anthropic

    async def __call__(self, request: Request) -> Response:
        return await self.respond(request)

    async def respond(self, request: Request) -> Response:
        anthropic = self.anthropic
        try:
            return await self.handler(request)
        except ProxyAuthError as e:
            kind = {
                401: "authentication_error",
                403: "permission_error",
                404: "not_found_error",
                429: "rate_limit_error",
            }.get(e.status, "invalid_request_error")
            return error(e.status, e.message, kind, anthropic)
        except ContextLengthExceededError as e:
            detail = {"type": "context_length_exceeded", "message": str(e)}
            return error(400, str(e), "context_length_exceeded", anthropic, detail=detail)
        except InvalidRequestError as e:
            return error(400, str(e), "invalid_request_error", anthropic, e.param)
        except Exception as e:
            return error(500, f"{type(e).__name__}: {e}", "api_error", anthropic)


def limit_error(refusal: Refusal, scope: Scope | None) -> tuple[Headers, bytes]:
    """A refusal by the request limits in the caller's protocol; a 413 names the cap."""
    anthropic = scope is not None and scope["path"].rstrip("/") == "/v1/messages"
    extra = {"limit": refusal.limit} if refusal.status == 413 else {}
    body = error_body(
        "anthropic" if anthropic else "chat_completions", refusal.message, refusal.kind, **extra
    )
    return [(b"content-type", JSON)], orjson.dumps(body)


def _number(body: dict[str, Any], name: str, default: float | None) -> float | None:
    value = body.get(name, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", name)
    return float(value)


OFFLOAD_BYTES = 64 * 1024  # bodies this large are parsed and tokenized on worker threads
LARGE_BYTES = 1024 * 1024  # bodies this large are prepared at most LARGE_SLOTS at a time
# One: tokenizing takes ~100 bytes per byte of text, and a body this large that passes the
# prompt-size bound hardly ever fits the context (a fitting prompt is ~4 bytes a token)
LARGE_SLOTS = 1
DEFAULT_EXPORT_TIMEOUT_S = 300.0
LIMITS = HttpLimits(
    max_body_bytes=16 * 1024 * 1024,
    body_timeout=60.0,
    header_timeout=30.0,
    max_header_bytes=64 * 1024,
    keep_alive_timeout=300,
    changed_by={"max_body_bytes": "the proxy's --max-body-bytes, rollout.agent.max_body_bytes"},
)
"""The proxy's request limits by default (its flags change them)."""
LIMIT_FLAGS = LimitFlags(
    LIMITS,
    (
        "--max-body-bytes",
        "--body-timeout",
        "--header-timeout",
        "--max-header-bytes",
        "--idle-timeout",
    ),
)


class ProxyServer:
    """Sessions, keys and the generation endpoints around one :class:`ChatGenerator`."""

    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        admin_api_key: str,
        *,
        host: str = "127.0.0.1",
        tool_call_parser: Any = None,
        reasoning_parser: Any = None,
        chat_template_type: str = "hf",
        engine_max_tokens: int | None = None,
        context_length: int | None = None,
        session_timeout: float = 3600.0,
        preprocessors: list[MessagePreprocessor] | None = None,
        prefix_matcher: PrefixMatcher | None = None,
        expected_temperature: float | None = None,
        deterministic: bool = False,
        role: str = "proxy",
        worker_index: int = 0,
        max_body_bytes: int = LIMITS.max_body_bytes,
        body_timeout: float = LIMITS.body_timeout,
        export_timeout: float = DEFAULT_EXPORT_TIMEOUT_S,
        run_nonce: str | None = None,
    ):
        limits = dataclasses.replace(
            LIMITS, max_body_bytes=max_body_bytes, body_timeout=body_timeout
        )
        if export_timeout <= 0:
            raise ValueError("export_timeout must be positive seconds")
        self.admin_key = validate_admin_key(admin_api_key, host)
        self.gateway_key = derive_gateway_key(self.admin_key)
        self.engine = engine
        self.role, self.worker_index = role, worker_index
        self.export_timeout = export_timeout
        self.store = SessionStore(self.admin_key, session_timeout, prefix_matcher, run_nonce)
        self.chat = ChatGenerator(
            engine,
            tokenizer,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
            engine_max_tokens=engine_max_tokens,
            context_length=context_length,
            chat_template_type=chat_template_type,
            preprocessors=preprocessors,
            expected_temperature=expected_temperature,
            deterministic=deterministic,
        )
        self._large = asyncio.Semaphore(LARGE_SLOTS)
        self._memory = MemoryReleaser()
        logging.register_secret(self.admin_key)
        logging.register_secret(self.gateway_key)
        self.app = BodyLimitMiddleware(App(self._routes(), self._lifespan), limits, limit_error)

    @contextlib.asynccontextmanager
    async def _lifespan(self) -> AsyncIterator[None]:
        yield
        await workflow_context.close_clients()  # this loop's engine HTTP clients

    # --- auth ---

    def _require_admin(self, request: Request) -> None:
        tokens = candidate_tokens(request.headers)
        if not tokens:
            raise ProxyAuthError(401, "missing API key")
        if not any(same_secret(t, self.admin_key) for t in tokens):
            raise ProxyAuthError(403, "this endpoint needs the admin key")

    def _session(
        self, request: Request, allow_gateway: bool = True, allow_ended: bool = False
    ) -> Session:
        """The request's session; 410 once it has ended, unless ``allow_ended``."""
        session = self._lookup_session(request, allow_gateway)
        if session.finished and not allow_ended:
            raise ProxyAuthError(
                410, f"session {session.session_id!r} has ended: no more generation or rewards"
            )
        return session

    def _lookup_session(self, request: Request, allow_gateway: bool) -> Session:
        tokens = candidate_tokens(request.headers)
        if not tokens:
            raise ProxyAuthError(401, "missing API key")
        for token in tokens:
            session = self.store.by_key(token)
            if session is not None:
                return session
        for token in tokens:
            if same_secret(token, self.gateway_key):
                if not allow_gateway:
                    raise ProxyAuthError(403, "the gateway key can only generate")
                return self.store.by_gateway_headers(
                    request.headers.get("x-session-id"), request.headers.get("x-session-token")
                )
        raise ProxyAuthError(401, "unknown API key")

    @staticmethod
    def _require_json(request: Request) -> None:
        if "json" not in request.headers.get("content-type", ""):
            raise ProxyAuthError(422, "Content-Type must be application/json")

    @staticmethod
    def _parse(raw: bytes) -> dict[str, Any]:
        if not raw:
            return {}
        try:
            body = orjson.loads(raw)
        except ValueError:
            raise InvalidRequestError(
                "the request body is not valid JSON (UTF-8 text of one JSON object)"
            ) from None
        if not isinstance(body, dict):
            raise InvalidRequestError("the request body must be a JSON object")
        return body

    async def _body(self, request: Request, require_json: bool = True) -> dict[str, Any]:
        if require_json:
            self._require_json(request)
        return self._parse(await request.body())

    # --- management ---

    async def health(self, request: Request) -> Response:
        return json_response(
            {
                "status": "ok",
                "initialized": self.engine is not None,
                "role": self.role,
                "worker_index": self.worker_index,
                "sessions": len(self.store),
            }
        )

    async def root(self, request: Request) -> Response:
        return json_response({"status": "ok"})

    async def grant_capacity(self, request: Request) -> Response:
        self._require_admin(request)
        return json_response({"capacity": self.store.grant_capacity()})

    async def start_session(self, request: Request) -> Response:
        self._require_admin(request)
        body = await self._body(request, require_json=False)
        session = self.store.start(body.get("task_id"), body.get("api_key"), body.get("metadata"))
        return json_response({"session_id": session.session_id, "api_key": session.api_key})

    async def end_session(self, request: Request) -> Response:
        # idempotent while the session is still here: a retried end gets the same answer
        session = self._session(request, allow_gateway=False, allow_ended=True)
        session.finish()
        return json_response({"message": "success", **session.diagnostics()})

    async def set_reward(self, request: Request) -> Response:
        session = self._session(request, allow_gateway=False)
        body = await self._body(request, require_json=False)
        reward = body.get("reward")
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise InvalidRequestError("reward must be a number", "reward")
        if not math.isfinite(reward):
            raise InvalidRequestError(f"reward must be finite, got {reward!r}", "reward")
        interaction_id = body.get("interaction_id")
        if interaction_id is not None and not isinstance(interaction_id, str):
            raise InvalidRequestError("interaction_id must be a string or null", "interaction_id")
        session.touch()
        try:
            target = session.cache.set_reward(interaction_id, float(reward))
        except KeyError as e:
            raise InvalidRequestError(str(e.args[0]), "interaction_id") from None
        return json_response({"message": "success", "interaction_id": target.id})

    async def export_trajectories(self, request: Request) -> Response:
        self._require_admin(request)
        body = await self._body(request, require_json=False)
        session_id = body.get("session_id")
        if not isinstance(session_id, str):
            raise ProxyAuthError(422, "session_id is required")
        discount = _number(body, "discount", 1.0)
        if discount is None or discount < 0:
            raise InvalidRequestError(f"discount must be >= 0, got {discount!r}", "discount")
        style = body.get("style", "individual")
        if style not in ("individual", "concat"):
            raise InvalidRequestError(
                f"style must be 'individual' or 'concat', got {style!r}", "style"
            )
        drop_orphans = body.get("drop_retry_orphans", False)
        if not isinstance(drop_orphans, bool):
            raise InvalidRequestError("drop_retry_orphans must be a boolean", "drop_retry_orphans")
        last_reward = _number(body, "last_reward", None)
        session = self.store.get(session_id)
        if session is None:
            raise ProxyAuthError(404, f"unknown session {session_id!r}")
        try:
            await asyncio.wait_for(session.finished_event().wait(), self.export_timeout)
        except TimeoutError:
            raise ProxyAuthError(
                409,
                f"session {session_id!r} was not ended within {self.export_timeout:g} s of the "
                "export request (--export-timeout); end it with POST /rl/end_session first",
            ) from None
        if self.store.get(session_id) is not session:
            raise ProxyAuthError(410, f"session {session_id!r} was exported by another request")
        if last_reward is not None and len(session.cache):
            session.cache.set_reward(None, last_reward)
        if drop_orphans:
            session.cache.drop_retry_orphans()
        session.cache.apply_reward_discount(discount)
        try:
            exported = session.cache.export(style)
        except ValueError as e:
            raise InvalidRequestError(str(e), "style") from None
        self.store.remove(session_id)
        response = json_response(
            {
                "interactions": serialize_interactions(exported.values(), session_id),
                **session.diagnostics(),
            }
        )
        del exported, session
        self._memory.soon()  # hand the freed heap back to the OS
        return response

    async def stats(self, request: Request) -> Response:
        """This process's ``proxy/*`` metrics since the last call (and resets them)."""
        self._require_admin(request)
        stats = stats_tracker.get(PROXY_TRACKER).export(mergeable=True)
        return json_response({"stats": stats})

    # --- generation ---

    async def _generate(self, session: Session, chat_body: dict[str, Any], offload: bool):
        session.touch()
        try:
            return await self.chat.create(
                chat_body,
                cache=session.cache,
                seed_key=session.task_id,
                request_index=session.next_request_index(),
                offload=offload,
                validated=True,
            )
        except ContextLengthExceededError as e:
            session.context_overflow, session.context_overflow_message = True, str(e)
            raise
        except InvalidRequestError:
            raise  # the client's error: never a system failure of the session
        except Exception as e:
            logger.exception("generation failed in session %s", session.session_id)
            session.system_error, session.system_error_message = True, f"{type(e).__name__}: {e}"
            raise

    def _translate(self, protocol: str, raw: bytes) -> Translated:
        return to_chat(protocol, self._parse(raw))

    async def _serve(self, protocol: str, request: Request) -> Response:
        session = self._session(request)
        self._require_json(request)
        raw = await request.body()
        size = len(raw)
        if size < OFFLOAD_BYTES:
            return await self._respond(session, self._translate(protocol, raw), offload=False)
        # a large body: parse, check and tokenize it on worker threads, a few at a time
        async with self._large if size >= LARGE_BYTES else contextlib.nullcontext():
            try:
                translated = await asyncio.to_thread(self._translate, protocol, raw)
                del raw
                return await self._respond(session, translated, offload=True)
            finally:
                self._memory.soon()  # hand the freed heap back to the OS

    async def _respond(self, session: Session, translated: Translated, offload: bool) -> Response:
        result = await self._generate(session, translated.chat, offload)
        reply = from_chat(translated, result.completion)
        if translated.stream:
            return StreamingResponse(
                sse_chunks(stream_events(translated, reply)), headers=SSE_HEADERS
            )
        return json_response(reply)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve("chat_completions", request)

    async def responses(self, request: Request) -> Response:
        return await self._serve("responses", request)

    async def messages(self, request: Request) -> Response:
        return await self._serve("anthropic", request)

    # --- wiring ---

    def _guard(self, handler, anthropic: bool = False) -> _Endpoint:
        return _Endpoint(handler, anthropic)

    def _routes(self) -> dict[str, dict[str, _Endpoint]]:
        g = self._guard
        chat, responses = g(self.chat_completions), g(self.responses)
        return {
            "/health": {"GET": g(self.health)},
            "/": {"GET": g(self.root), "HEAD": g(self.root)},
            "/grant_capacity": {"POST": g(self.grant_capacity)},
            "/rl/start_session": {"POST": g(self.start_session)},
            "/rl/end_session": {"POST": g(self.end_session)},
            "/rl/set_reward": {"POST": g(self.set_reward)},
            "/export_trajectories": {"POST": g(self.export_trajectories)},
            "/rl/stats": {"POST": g(self.stats)},
            "/chat/completions": {"POST": chat},
            "/v1/chat/completions": {"POST": chat},
            "/responses": {"POST": responses},
            "/v1/responses": {"POST": responses},
            "/v1/messages": {"POST": g(self.messages, anthropic=True)},
        }


def uvicorn_options(limits: HttpLimits = LIMITS) -> dict[str, Any]:
    """uvicorn settings of the proxy: the HTTP protocol with its header limits, the idle timeout."""
    return uvicorn_settings(limits, error_shape=limit_error)


def main(argv: list[str] | None = None) -> None:
    """Run the proxy as a process (the command line of :mod:`areal.proxy.cli`)."""
    from areal.proxy.cli import main as run

    run(argv)


if __name__ == "__main__":
    main()
