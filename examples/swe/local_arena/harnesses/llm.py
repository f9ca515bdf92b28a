"""LLM clients of the built-in harnesses, one wire format per protocol.

A wire (:class:`ChatWire`, :class:`ResponsesWire`, :class:`AnthropicWire`) builds request
bodies, parses replies, records tool results in the protocol's own shape, and adds up a
server-sent event stream into the reply it streams. :class:`LLMClient` sends them with the
run's auth and session headers and turns every failure into a redacted
:class:`HarnessError`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx

from examples.swe.local_arena.harnesses.session import excerpt, redact, session_headers
from examples.swe.local_arena.types import HarnessError, HarnessRun, HarnessSpec

__all__ = ["WIRES", "LLMClient", "Reply", "ToolCall", "ToolDef", "llm_client"]


@dataclass
class ToolCall:
    """One tool call of an assistant turn."""

    id: str
    name: str
    arguments: Any  # JSON text (chat, responses) or the decoded object (anthropic)


@dataclass
class Reply:
    """One assistant turn, protocol-neutral, plus the items that record it in history."""

    text: str
    calls: list[ToolCall]
    history: list[dict[str, Any]]


@dataclass
class ToolDef:
    """A tool offered to the model; ``parameters`` is its arguments' JSON schema."""

    name: str
    description: str
    parameters: dict[str, Any]


# --- wire protocols ---


class ChatWire:
    path = "/v1/chat/completions"

    def auth(self, api_key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {api_key}"}

    def start(self, system: str, prompt: str) -> list[dict]:
        return [{"role": "system", "content": system}, {"role": "user", "content": prompt}]

    def body(self, model: str, system: str, history: list, tools: list[ToolDef], opts: dict):
        body = {"model": model, "messages": history, **_sampling(opts, "max_tokens")}
        if tools:
            body["tools"] = [{"type": "function", "function": {**vars(t)}} for t in tools]
        return body

    def parse(self, data: dict) -> Reply:
        choices = data.get("choices") or [{}]
        message = choices[0].get("message") or {}
        text = _flatten_text(message.get("content"))
        calls = [
            ToolCall(
                call.get("id") or f"call_{i}",
                call["function"].get("name", ""),
                call["function"].get("arguments", ""),
            )
            for i, call in enumerate(message.get("tool_calls") or [])
        ]
        record: dict[str, Any] = {"role": "assistant", "content": text}
        if calls:
            record["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in calls
            ]
        return Reply(text, calls, [record])

    def tool_results(self, results: list[tuple[ToolCall, str]]) -> list[dict]:
        return [{"role": "tool", "tool_call_id": c.id, "content": out} for c, out in results]

    def assemble(self, events: list[dict]) -> dict:
        """The completion that a stream of chunks adds up to."""
        text, calls = [], {}
        for chunk in events:
            for choice in chunk.get("choices") or []:
                delta = choice.get("delta") or {}
                text.append(delta.get("content") or "")
                for part in delta.get("tool_calls") or []:
                    call = calls.setdefault(
                        part.get("index", 0), {"id": "", "function": {"name": "", "arguments": ""}}
                    )
                    call["id"] = part.get("id") or call["id"]
                    fn = part.get("function") or {}
                    call["function"]["name"] += fn.get("name") or ""
                    call["function"]["arguments"] += fn.get("arguments") or ""
        message = {"content": "".join(text), "tool_calls": [calls[i] for i in sorted(calls)]}
        return {"choices": [{"message": message}]}


class ResponsesWire:
    path = "/v1/responses"

    def auth(self, api_key: str) -> dict[str, str]:
        return {"Authorization": f"Bearer {api_key}"}

    def start(self, system: str, prompt: str) -> list[dict]:
        return [{"role": "user", "content": prompt}]

    def body(self, model: str, system: str, history: list, tools: list[ToolDef], opts: dict):
        body = {
            "model": model,
            "instructions": system,
            "input": history,
            **_sampling(opts, "max_output_tokens"),
        }
        if tools:
            body["tools"] = [{"type": "function", **vars(t)} for t in tools]
        return body

    def parse(self, data: dict) -> Reply:
        output = data.get("output") or []
        text = data.get("output_text")
        if not isinstance(text, str) or not text:
            text = "".join(
                part.get("text") or ""
                for item in output
                if item.get("type") == "message"
                for part in item.get("content") or []
                if part.get("type") == "output_text"
            )
        calls = [
            ToolCall(
                item.get("call_id") or item.get("id") or "",
                item.get("name", ""),
                item.get("arguments", ""),
            )
            for item in output
            if item.get("type") == "function_call"
        ]
        return Reply(text, calls, list(output))

    def tool_results(self, results: list[tuple[ToolCall, str]]) -> list[dict]:
        return [
            {"type": "function_call_output", "call_id": c.id, "output": out} for c, out in results
        ]

    def assemble(self, events: list[dict]) -> dict:
        """The ``response.completed`` response; items and deltas when a server omits it."""
        response: dict[str, Any] = {}
        items, deltas = [], []
        for event in events:
            kind = event.get("type")
            if kind == "response.output_text.delta":
                deltas.append(event.get("delta") or "")
            elif kind == "response.output_item.done":
                items.append(event.get("item") or {})
            elif kind in ("response.completed", "response.incomplete"):
                response = dict(event.get("response") or {})
            elif kind in ("response.failed", "error"):
                raise HarnessError(f"stream error event {excerpt(json.dumps(event))}")
        if not response.get("output"):
            text = {"type": "output_text", "text": "".join(deltas)}
            response["output"] = items or [
                {"type": "message", "role": "assistant", "content": [text]}
            ]
        return response


class AnthropicWire:
    path = "/v1/messages"

    def auth(self, api_key: str) -> dict[str, str]:
        return {"x-api-key": api_key, "anthropic-version": "2023-06-01"}

    def start(self, system: str, prompt: str) -> list[dict]:
        return [{"role": "user", "content": prompt}]

    def body(self, model: str, system: str, history: list, tools: list[ToolDef], opts: dict):
        body = {"model": model, "system": system, "messages": history}
        body.update(_sampling(opts, "max_tokens"))
        if tools:
            body["tools"] = [
                {"name": t.name, "description": t.description, "input_schema": t.parameters}
                for t in tools
            ]
        return body

    def parse(self, data: dict) -> Reply:
        content = data.get("content") or []
        # Thinking blocks stay in history (the API wants them back) but never in the answer.
        text = "".join(b.get("text") or "" for b in content if b.get("type") == "text")
        calls = [
            ToolCall(b.get("id", ""), b.get("name", ""), b.get("input", {}))
            for b in content
            if b.get("type") == "tool_use"
        ]
        return Reply(text, calls, [{"role": "assistant", "content": content}])

    def tool_results(self, results: list[tuple[ToolCall, str]]) -> list[dict]:
        blocks = [
            {"type": "tool_result", "tool_use_id": c.id, "content": out} for c, out in results
        ]
        return [{"role": "user", "content": blocks}]

    def assemble(self, events: list[dict]) -> dict:
        """The message that a stream of events adds up to."""
        message: dict[str, Any] = {}
        blocks: dict[int, dict] = {}
        partial_json: dict[int, str] = {}
        for event in events:
            kind = event.get("type")
            index = event.get("index", 0)
            if kind == "message_start":
                message = dict(event.get("message") or {})
            elif kind == "content_block_start":
                blocks[index] = dict(event.get("content_block") or {})
            elif kind == "content_block_delta":
                block = blocks.setdefault(index, {"type": "text", "text": ""})
                delta = event.get("delta") or {}
                dtype = delta.get("type")
                if dtype == "text_delta":
                    block["text"] = block.get("text", "") + delta.get("text", "")
                elif dtype == "thinking_delta":
                    block["thinking"] = block.get("thinking", "") + delta.get("thinking", "")
                elif dtype == "signature_delta":
                    block["signature"] = delta.get("signature", "")
                elif dtype == "input_json_delta":
                    partial_json[index] = partial_json.get(index, "") + delta.get(
                        "partial_json", ""
                    )
            elif kind == "message_delta":
                message.update(event.get("delta") or {})
            elif kind == "error":
                raise HarnessError(f"stream error event {excerpt(json.dumps(event))}")
        for index, raw in partial_json.items():
            try:
                blocks[index]["input"] = json.loads(raw) if raw.strip() else {}
            except json.JSONDecodeError:
                blocks[index]["input"] = raw  # reported to the model as bad arguments
        message["content"] = [blocks[i] for i in sorted(blocks)]
        return message


WIRES = {"chat_completions": ChatWire(), "responses": ResponsesWire(), "anthropic": AnthropicWire()}


def _sampling(options: dict[str, Any], max_tokens_field: str) -> dict[str, Any]:
    return {
        "temperature": float(options.get("temperature", 1.0)),
        max_tokens_field: int(options.get("max_tokens", 256)),
    }


def _flatten_text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict))
    return content or ""


# --- client ---


async def _sse_events(response: httpx.Response) -> AsyncIterator[dict]:
    """The JSON ``data`` of each server-sent event, until ``[DONE]`` or the end."""
    data: list[str] = []

    def decode(payload: str) -> dict:
        try:
            return json.loads(payload)
        except json.JSONDecodeError:
            raise HarnessError(f"unparsable stream event: {excerpt(payload, 200)}") from None

    async for line in response.aiter_lines():
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            payload, data = "\n".join(data), []
            if payload.strip() == "[DONE]":
                return
            yield decode(payload)
    if data and "\n".join(data).strip() != "[DONE]":
        yield decode("\n".join(data))


class LLMClient:
    """Calls one endpoint in one protocol, with the run's auth and session headers."""

    def __init__(self, spec: HarnessSpec, run: HarnessRun, http: httpx.AsyncClient):
        self.wire = WIRES[spec.protocol]
        self.options = spec.options
        self.run = run
        self.http = http
        self.url = run.base_url.rstrip("/") + self.wire.path
        self.headers = {**session_headers(run.envs), **self.wire.auth(run.api_key)}

    async def call(self, system: str, history: list, tools: list[ToolDef]) -> Reply:
        body = self.wire.body(self.run.model, system, history, tools, self.options)
        try:
            if self.options.get("stream"):
                data = await self._streamed({**body, "stream": True})
            else:
                response = await self.http.post(self.url, json=body, headers=self.headers)
                self._check(response)
                data = response.json()
        except httpx.HTTPError as e:
            raise HarnessError(self._message(f"{type(e).__name__}: {e}")) from None
        except json.JSONDecodeError:
            raise HarnessError(self._message("the reply is not JSON")) from None
        try:
            return self.wire.parse(data)
        except (AttributeError, KeyError, TypeError) as e:
            raise HarnessError(self._message(f"unexpected reply shape ({e!r})")) from None

    async def _streamed(self, body: dict) -> dict:
        async with self.http.stream("POST", self.url, json=body, headers=self.headers) as r:
            if r.status_code >= 400:
                await r.aread()
                self._check(r)
            events = [event async for event in _sse_events(r)]
        try:
            return self.wire.assemble(events)
        except HarnessError as e:
            raise HarnessError(self._message(str(e))) from None

    def _check(self, response: httpx.Response) -> None:
        if response.status_code >= 400:
            detail = f"HTTP {response.status_code}: {excerpt(response.text, 500)}"
            raise HarnessError(self._message(detail))

    def _message(self, detail: str) -> str:
        return redact(f"LLM call to {self.wire.path} failed: {detail}", self.run)


@contextlib.asynccontextmanager
async def llm_client(spec: HarnessSpec, run: HarnessRun) -> AsyncIterator[LLMClient]:
    """An :class:`LLMClient` for ``spec.protocol`` with its own HTTP connection pool."""
    # trust_env=False: the endpoint is the gateway or rollout proxy; an HTTP(S)_PROXY meant
    # for the outside world must not capture it.
    async with httpx.AsyncClient(timeout=run.timeout, trust_env=False) as http:
        yield LLMClient(spec, run, http)
