"""Every route of the embedded server answers odd and oversized fields with a 4xx, never a 500.

Generated cases: for each POST route, each field of its body in turn gets values of the
wrong type, out of range, with a NUL, or far too large (a 100,000-character string, a
list past its bound), and each route gets bodies that are not JSON objects at all. Every
answer must be an HTTP status below 500 on a connection that was not reset, an oversized
field must get a 400 naming that field, and the server must still generate afterwards.

The server runs in this process under uvicorn (the same app ``python -m
areal.inference.server`` serves). Its ``/init_weights_update_group`` base body asks for an
NCCL group from this CPU server, so no case starts a real join (joins are covered by
``test_weight_group_join.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from areal.inference.engine import GenerationEngine
from areal.inference.server import create_app
from tests.fakes.live_server import serve

HUGE = "x" * 100_000

# route: (a valid body, its string fields, its list fields with one valid item and a count
# past the server's bound); nested fields are dotted
ROUTES: dict[str, tuple[dict[str, Any], list[str], dict[str, tuple[Any, int]]]] = {
    "/generate": (
        {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}, "rid": "r1"},
        ["rid", "lora_path", "sampling_params.stop"],
        {
            "input_ids": (1, 5000),  # past the context length (2048)
            "sampling_params.stop": ("</s>", 1025),
            "sampling_params.stop_token_ids": (2, 300_000),
        },
    ),
    "/update_weights_from_disk": ({"model_path": "/nonexistent/ckpt"}, ["model_path"], {}),
    "/init_weights_update_group": (
        {
            "master_address": "127.0.0.1",
            "master_port": 29500,
            "rank_offset": 1,
            "world_size": 2,
            "group_name": "g",
            "backend": "nccl",  # refused on this CPU server before any join starts
        },
        ["master_address", "group_name", "backend"],
        {},
    ),
    "/update_weights_from_distributed": (
        {"names": ["lm_head.weight"], "dtypes": ["float32"], "shapes": [[2, 2]], "group_name": "g"},
        ["group_name"],
        {"names": ("a", 70_000), "dtypes": ("float32", 70_000), "shapes": ([1], 70_000)},
    ),
    "/update_weights_from_tensor": (
        {"serialized_named_tensors": ["AAAA"], "load_format": "direct", "weight_version": "1"},
        ["load_format", "weight_version"],
        {},
    ),
    "/update_weight_version": (
        {"new_version": "7", "abort_all_requests": False},
        ["new_version"],
        {},
    ),
    "/abort_request": ({"rid": "r1"}, ["rid"], {}),
    "/pause_generation": ({"mode": "in_place"}, ["mode"], {}),
    "/release_memory_occupation": ({"tags": ["weights"]}, [], {"tags": ("weights", 100)}),
    "/resume_memory_occupation": ({"tags": ["weights"]}, [], {"tags": ("weights", 100)}),
}

OPTIONAL_BODY = ("/pause_generation", "/release_memory_occupation", "/resume_memory_occupation")

ODD_VALUES: list[Any] = [
    None,
    True,
    -1,
    10**30,
    1e308,
    "",
    "a\x00b",
    HUGE,
    [],
    [HUGE],
    [[-(10**30)]],
    {"nested": {"deeper": [1, "two", None]}},
]

# bodies that are no JSON object (a 400 on every route that needs one), then odd objects
NOT_OBJECTS: list[bytes] = [
    b"",
    b"null",
    b"[]",
    b'"a string"',
    b"{not json",
    b"\xff\xfe\x00 not utf-8",
    b"[" * 100_000 + b"]" * 100_000,  # nesting deeper than any JSON parser recurses
]
ODD_OBJECTS: list[bytes] = [
    b'{"x": ' + b"[" * 50_000 + b"]" * 50_000 + b"}",
    b'{"input_ids": [' + b"9" * 5_000 + b"]}",  # an integer past Python's digit limit
    b'{"input_ids": [1], "sampling_params": {"temperature": NaN, "top_p": Infinity}}',
]


def with_value(body: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    out = json.loads(json.dumps(body))
    *parents, leaf = dotted.split(".")
    node = out
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value
    return out


def fields_of(body: dict[str, Any], prefix: str = "") -> Iterator[str]:
    for key, value in body.items():
        yield f"{prefix}{key}"
        if isinstance(value, dict):
            yield from fields_of(value, f"{prefix}{key}.")


def generated_cases() -> Iterator[tuple[str, str, Any]]:
    """(route, field or "<body>", value): every field of every route, each odd value."""
    for route, (body, _, _) in ROUTES.items():
        for field in fields_of(body):
            for value in ODD_VALUES:
                if field == "sampling_params.max_new_tokens" and value is None:
                    continue  # valid: generates up to the context length (slow, not odd)
                yield route, field, value
        for extra in ("max_new_tokens", "temperature", "sampling_seed", "top_k", "min_new_tokens"):
            if route == "/generate":
                for value in (-1, 10**30, 1e308, HUGE):
                    yield route, f"sampling_params.{extra}", value


@pytest.fixture(scope="module")
def url(tiny_model_dir) -> Iterator[str]:
    engine = GenerationEngine(str(tiny_model_dir), device="cpu", context_length=2048).start()
    try:
        with serve(create_app(engine)) as base:
            yield base
    finally:
        engine.stop()


@pytest.fixture(scope="module")
def client(url) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=30) as client:
        yield client


def post(client: httpx.Client, route: str, content: bytes) -> httpx.Response | str:
    """The answer, or the transport error's name (a reset or closed connection)."""
    try:
        answer = client.post(route, content=content, headers={"content-type": "application/json"})
    except httpx.TransportError as e:
        return type(e).__name__
    if answer.status_code < 300:  # undo a pause or a release: the next case needs a server
        if route == "/pause_generation":
            client.post("/continue_generation", json={})
        if route == "/release_memory_occupation":
            client.post("/resume_memory_occupation", json={})
    return answer


def describe(answer: httpx.Response | str) -> str:
    if isinstance(answer, str):
        return answer
    return f"{answer.status_code} {answer.text[:160]}"


def test_odd_field_values_and_bodies_never_get_a_5xx_or_a_reset(client):
    failures = []
    for route, field, value in generated_cases():
        body = with_value(ROUTES[route][0], field, value)
        answer = post(client, route, json.dumps(body).encode())
        if isinstance(answer, str) or answer.status_code >= 500:
            failures.append(f"{route} {field}={str(value)[:30]!r}: {describe(answer)}")
    for route in ROUTES:
        for raw in NOT_OBJECTS + ODD_OBJECTS:
            answer = post(client, route, raw)
            optional = route in OPTIONAL_BODY and raw in (b"", b"null")
            refused = raw in NOT_OBJECTS and not optional  # a 400 in the server's error shape
            if isinstance(answer, str) or answer.status_code >= 500:
                failures.append(f"{route} body {raw[:30]!r}: {describe(answer)}")
            elif refused and (answer.status_code != 400 or "error" not in answer.json()):
                failures.append(f"{route} body {raw[:30]!r}: {describe(answer)} (wanted a 400)")
    assert not failures, "\n".join(failures)
    ok = client.post("/generate", json=ROUTES["/generate"][0])
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 2


def oversized_cases() -> Iterator[tuple[str, str, Any]]:
    for route, (_, strings, lists) in ROUTES.items():
        for field in strings:
            yield route, field, HUGE
        for field, (item, count) in lists.items():
            yield route, field, [item] * count


def case_id(value: Any) -> str:
    return value if isinstance(value, str) and len(value) < 60 else "huge"


@pytest.mark.parametrize(("route", "field", "value"), list(oversized_cases()), ids=case_id)
def test_an_oversized_field_gets_a_400_naming_it(client, route: str, field: str, value: Any):
    body = with_value(ROUTES[route][0], field, value)
    answer = post(client, route, json.dumps(body).encode())
    assert not isinstance(answer, str), answer
    assert answer.status_code == 400, describe(answer)
    error = answer.json()["error"]
    named = (error.get("param") or "").startswith(field) or error["message"].startswith(field)
    assert named, error
    assert len(answer.content) < 2_000, "the answer echoes the oversized value"


@pytest.mark.parametrize(
    ("model_path", "reason"),
    [
        ("/" + "a" * 300, "cannot be read: File name too long"),  # ENAMETOOLONG
        ("/nonexistent/checkpoint", "does not exist"),
        ("/etc/hostname", "is not a directory"),
        ("/proc/self/fd/0/x", "is not a directory"),
        ("a\x00b", "embedded null byte"),
    ],
)
def test_a_model_path_that_cannot_be_a_checkpoint_is_a_400(client, model_path: str, reason: str):
    answer = client.post("/update_weights_from_disk", json={"model_path": model_path})
    assert answer.status_code == 400, describe(answer)
    error = answer.json()["error"]
    assert error["param"] == "model_path" and reason in error["message"], error
    assert len(error["message"]) < 400
