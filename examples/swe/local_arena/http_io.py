"""Reading request bodies and writing JSON answers for the local Arena's routes.

Bodies are validated with pydantic; a bad one is an :class:`HTTPError` (400) naming each
bad field, which the app answers as ``{"error": {"code", "message"}}``.
"""

from __future__ import annotations

from typing import Annotated, Any

import orjson
from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field, StringConstraints, ValidationError

__all__ = [
    "MAX_PAGE",
    "HTTPError",
    "LaunchBody",
    "RouteEndpoint",
    "RouteRegistration",
    "error_response",
    "json_response",
    "page_args",
    "read_model",
    "read_object",
    "stopping_response",
]

MAX_PAGE = 1000
"""The largest ``limit`` of a paged listing."""


# A key read from a file keeps its newline; stripped, it works and is redacted as sent.
Key = Annotated[str, StringConstraints(strip_whitespace=True, min_length=1)]


class RouteEndpoint(BaseModel):
    model_config = ConfigDict(extra="ignore")
    endpoint_id: str = Field(min_length=1)
    upstream_model: str = Field(min_length=1)
    base_url: str = Field(min_length=1, pattern=r"^https?://")
    api_key: Key
    inbound_protos: list[str] = Field(default_factory=lambda: ["chat"])
    enabled: bool = True


class RouteRegistration(BaseModel):
    model_config = ConfigDict(extra="ignore")
    model_name: str = Field(min_length=1)
    endpoints: list[RouteEndpoint] = Field(min_length=1, max_length=1)
    enabled: bool = True
    metadata: dict[str, Any] = Field(default_factory=dict)


class LaunchBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    data_id: str = Field(min_length=1)
    model_name: str = Field(min_length=1)
    base_url: str = Field(min_length=1, pattern=r"^https?://")
    api_key: Key
    envs: dict[str, str] = Field(default_factory=dict)
    session_id: str = ""
    harness: str = ""


class HTTPError(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request"):
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def json_response(content: Any, status: int = 200, headers: dict | None = None) -> Response:
    return Response(orjson.dumps(content), status, headers, media_type="application/json")


def error_response(status: int, message: str, code: str, headers: dict | None = None) -> Response:
    return json_response({"error": {"code": code, "message": message}}, status, headers)


def stopping_response() -> Response:
    return error_response(503, "the local Arena is stopping", "stopping", {"Connection": "close"})


async def read_object(request: Request) -> dict[str, Any]:
    """The JSON object body (an empty body is ``{}``); 400 otherwise."""
    raw = await request.body()
    try:
        data = orjson.loads(raw) if raw else {}
    except orjson.JSONDecodeError:
        raise HTTPError(400, "the request body is not valid JSON", "malformed_json") from None
    if not isinstance(data, dict):
        raise HTTPError(400, "the request body must be a JSON object", "malformed_json")
    return data


async def read_model(request: Request, model: type[BaseModel]) -> Any:
    """The JSON body as ``model``; 400 naming each bad field otherwise."""
    data = await read_object(request)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'body'}: {err['msg']}" for err in e.errors()
        )
        raise HTTPError(400, f"invalid request body: {problems}", "invalid_body") from None


def page_args(request: Request, default_limit: int) -> tuple[int, int]:
    def number(name: str, default: int, low: int, high: int) -> int:
        text = request.query_params.get(name)
        if text is None:
            return default
        try:
            value = int(text)
        except ValueError:
            raise HTTPError(400, f"{name} must be an integer, got {text!r}") from None
        if not low <= value <= high:
            raise HTTPError(400, f"{name} must be between {low} and {high}, got {value}")
        return value

    return number("limit", default_limit, 1, MAX_PAGE), number("offset", 0, 0, 10**9)
