"""train_swe_rl: Arena mixture datasets, JSONL datasets, worker econfig, the local Arena.

The Stream mixture and the workers' Streams as docs/arena_training.md describes them. The
Arena is a ``httpx.MockTransport`` serving the three read routes training uses (list, get, dataset
pages); the local-Arena tests start the real local Arena in-process. Training itself
(``main`` with the real PPOTrainer, workers and inference server against the local Arena)
runs in tests/integration/test_arena_training_e2e.py.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import yaml
from datasets import Dataset

from areal.api.cli_args import load_expr_config
from areal.trainer.dataloader import StatefulDataLoader
from areal.utils import logging as areal_logging
from examples.swe import train_swe_rl
from examples.swe.arena_client import ArenaAPIError, ArenaOpenAPIClient
from examples.swe.arena_types import ArenaRewardRefConfig, ArenaStreamConfig
from examples.swe.train_swe_rl import (
    ARENA_WORKFLOW,
    build_training_inputs,
    get_arena_dataset,
    get_arena_mixture_dataset,
    get_swe_dataset,
    group_filter,
    local_arena_if_requested,
    main,
)
from examples.swe.utils import SWEEnvConfig, SWEPPOConfig
from tests.conftest import SECRET_SENTINEL, SWE_DIR

BASE = "https://arena.test"
TOKEN = f"tok-{SECRET_SENTINEL}"
API = "/openapi/v1/streams"
ARENA_ENV = ("ARENA_OPENAPI_BASE", "ARENA_OPENAPI_TOKEN", "ARENA_LLM_API_KEY")


class FakeArena:
    """Streams and their dataset ids behind E1 (list), E2 (get) and E3 (dataset pages)."""

    def __init__(self) -> None:
        self.streams: dict[str, dict[str, Any]] = {}
        self.ids: dict[str, list[str]] = {}

    def add(
        self,
        stream_id: str,
        n_rows: int,
        *,
        harness: str = "swe-agent",
        reward: tuple[str, str] | None = None,
        status: str = "ACTIVE",
    ) -> FakeArena:
        self.streams[stream_id] = {
            "stream_id": stream_id,
            "status": status,
            "default_harness_ref": {"key": harness, "version": "1"},
            "default_reward_ref": {"key": reward[0], "version": reward[1]} if reward else None,
        }
        self.ids[stream_id] = [f"{stream_id}-{i}" for i in range(n_rows)]
        return self

    def handler(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if request.method == "GET" and path == API:
            status = request.url.params.get("status")
            items = [s for s in self.streams.values() if status in (None, s["status"])]
            return httpx.Response(200, json={"items": items, "total": len(items)})
        stream_id = path.removeprefix(API + "/").removesuffix("/dataset")
        if stream_id not in self.streams:
            return httpx.Response(404, json={"error": "no such Stream"})
        if request.method == "GET":
            return httpx.Response(200, json=self.streams[stream_id])
        limit, offset = int(request.url.params["limit"]), int(request.url.params["offset"])
        ids = self.ids[stream_id][offset : offset + limit]
        page = {"total": len(self.ids[stream_id]), "offset": offset, "limit": limit}
        return httpx.Response(200, json={**page, "count": len(ids), "data_ids": ids})

    def client(self) -> ArenaOpenAPIClient:
        return ArenaOpenAPIClient(
            base_url=BASE, api_token=TOKEN, transport=httpx.MockTransport(self.handler)
        )


def stream(name: str, weight: float = 1.0, **fields: Any) -> ArenaStreamConfig:
    return ArenaStreamConfig(
        name=name, stream_id=f"stream-{name}", sampling_weight=weight, **fields
    )


def mixture(sizes: dict[str, tuple[float, int]], epoch: int = 0, size_multiple: int = 1):
    """Mixture rows (by data id) for Streams ``name -> (weight, rows)`` on a fake Arena."""
    arena = FakeArena()
    for name, (_, n_rows) in sizes.items():
        arena.add(f"stream-{name}", n_rows)
    econfig = {
        "arena_streams": [stream(name, weight) for name, (weight, _) in sizes.items()],
        "arena_mixture_epoch_size": epoch,
    }
    rows, _ = get_arena_mixture_dataset(econfig, size_multiple=size_multiple, client=arena.client())
    return [row["data_id"] for row in rows]


def names(ids: list[str]) -> list[str]:
    """``stream-a-3`` -> ``a``."""
    return [i.split("-")[1] for i in ids]


def astra_tbench_arena() -> FakeArena:
    return (
        FakeArena()
        .add("stream-a", 6, harness="default-harness", reward=("reward-a", "1.0.0"))
        .add("stream-b", 6, harness="default-harness", reward=("reward-b", "2.0.0"))
    )


def astra_tbench_streams() -> list[ArenaStreamConfig]:
    return [
        ArenaStreamConfig(
            name="astra",
            stream_id="stream-a",
            sampling_weight=2,
            harness="claude-code@1.0.0",
            expected_reward_ref=ArenaRewardRefConfig("reward-a", "1.0.0"),
        ),
        ArenaStreamConfig(
            name="tbench",
            stream_id="stream-b",
            sampling_weight=1,
            harness="codex@2.0.0",
            expected_reward_ref=ArenaRewardRefConfig("reward-b", "2.0.0"),
        ),
    ]


# --- case 54 / M7: the trainer mixture ---


def test_mixture_splits_by_weight_and_fills_stream_columns():
    econfig = SWEEnvConfig(
        dataset_source="arena", arena_streams=astra_tbench_streams(), arena_mixture_epoch_size=9
    )
    rows, streams = get_arena_mixture_dataset(econfig, client=astra_tbench_arena().client())

    # mass astra = 6 x 2 = 12, tbench = 6 x 1 = 6; astra's share 9 x 12/18 = 6 fills it,
    # so tbench gets the remaining 3.
    counts = {
        name: sum(r["arena_stream_name"] == name for r in rows) for name in ("astra", "tbench")
    }
    assert counts == {"astra": 6, "tbench": 3}
    assert {r["reward_ref_key"] for r in rows} == {"reward-a", "reward-b"}
    assert [s.llm_protocol for s in streams] == ["anthropic", "responses"]
    by_stream = {r["arena_stream_name"]: r for r in rows}
    assert by_stream["astra"]["llm_protocol"] == "anthropic"
    assert by_stream["tbench"]["reward_ref_version"] == "2.0.0"
    assert set(rows[0]) == {
        "data_id",
        "stream_id",
        "llm_protocol",
        "arena_task_type",
        "arena_stream_name",
        "reward_ref_key",
        "reward_ref_version",
    }


def test_mixture_is_a_datasets_dataset_with_indexable_columns():
    econfig = {"arena_streams": astra_tbench_streams(), "arena_mixture_epoch_size": 9}
    dataset, _ = get_arena_mixture_dataset(econfig, client=astra_tbench_arena().client())
    assert isinstance(dataset, Dataset)
    assert dataset.column_names == [
        "data_id",
        "stream_id",
        "llm_protocol",
        "arena_task_type",
        "arena_stream_name",
        "reward_ref_key",
        "reward_ref_version",
    ]
    # Weighted round-robin 2:1 over astra's 6 and tbench's 3 rows.
    assert list(dataset["arena_stream_name"]) == ["astra", "astra", "tbench"] * 3
    assert dataset[1] == {
        "data_id": "stream-a-1",
        "stream_id": "stream-a",
        "llm_protocol": "anthropic",
        "arena_task_type": "unknown",
        "arena_stream_name": "astra",
        "reward_ref_key": "reward-a",
        "reward_ref_version": "1.0.0",
    }


def test_the_trainer_dataloader_hands_out_the_mixture_rows():
    # The dataloader indexes the Dataset by int and hands out its rows as plain dicts.
    econfig = {"arena_streams": astra_tbench_streams(), "arena_mixture_epoch_size": 9}
    dataset, _ = get_arena_mixture_dataset(econfig, client=astra_tbench_arena().client())
    loader = StatefulDataLoader(dataset, batch_size=3, shuffle=True, seed=5)
    batches = list(loader.tracked())
    assert len(batches) == 3
    drawn = [key for batch in batches for key, _ in batch]
    assert sorted(index for _, index in drawn) == list(range(9))  # each row once
    for batch in batches:
        for (_, index), row in batch:
            assert type(row) is dict and row == dataset[index]
    resumed = StatefulDataLoader(dataset, batch_size=3, shuffle=True, seed=5)
    resumed.load_state_dict(json.loads(json.dumps(loader.state_dict())))
    (first, *_) = resumed.tracked()  # the unsettled rows come back first, as dicts
    assert [row for _, row in first] == [row for _, row in batches[0]]


def test_mixture_pins_unpinned_streams_and_rejects_drift():
    arena = FakeArena().add("stream-a", 2, harness="claude-code", reward=("reward-a", "3"))
    rows, (resolved,) = get_arena_mixture_dataset(
        {"arena_streams": [stream("a")]}, client=arena.client()
    )
    assert resolved.expected_reward_ref == ArenaRewardRefConfig("reward-a", "3")
    assert resolved.llm_protocol == "anthropic"  # from the Stream's default Harness
    assert len(rows) == 2

    pinned = stream("a", expected_reward_ref=ArenaRewardRefConfig("reward-a", "2"))
    with pytest.raises(ArenaAPIError, match="reward_ref drifted"):
        get_arena_mixture_dataset({"arena_streams": [pinned]}, client=arena.client())


# --- case 55 / M8: the legacy single-Stream helper ---


def test_legacy_single_stream_helper():
    arena = FakeArena().add("stream-a", 1).add("stream-b", 1)
    econfig = {"stream_id": "stream-a", "arena_reward_threshold": "0.98"}
    rows, stream_id = get_arena_dataset(econfig, client=arena.client())
    assert (len(rows), stream_id) == (1, "stream-a")
    assert isinstance(rows, Dataset) and list(rows["data_id"]) == ["stream-a-0"]

    two = {"arena_streams": [stream("a"), stream("b")]}
    with pytest.raises(ValueError, match="exactly one Arena Stream"):
        get_arena_dataset(two, client=arena.client())


def test_legacy_empty_stream_id_takes_the_first_active_stream():
    arena = FakeArena().add("stream-p", 1, status="PAUSED").add("stream-x", 3)
    rows, stream_id = get_arena_dataset({"stream_id": ""}, client=arena.client())
    assert stream_id == "stream-x"
    assert [r["data_id"] for r in rows] == ["stream-x-0", "stream-x-1", "stream-x-2"]


# --- case 56: mixing vectors ---


def test_mixture_three_to_one_subset():
    ids = mixture({"a": (3, 9), "b": (1, 9)}, epoch=12)
    # mass a = 27, b = 9: a's share 12 x 27/36 = 9 fills it; b gets 3.
    assert names(ids).count("a") == 9 and names(ids).count("b") == 3
    assert len(set(ids)) == 12
    assert names(ids[:4]) == ["a", "a", "a", "b"]


def test_mixture_equal_weights_concatenate_large_then_small():
    ids = mixture({"large": (1, 4), "small": (1, 1)})
    assert len(ids) == 5 and len(set(ids)) == 5
    assert names(ids[:2]) == ["large", "small"]


def test_mixture_full_union_is_never_padded(areal_logs):
    ids = mixture({"a": (1, 56), "b": (1, 441), "c": (1, 20)}, size_multiple=4)
    assert len(ids) == 517 and len(set(ids)) == 517
    assert names(ids[:4]) == ["a", "b", "c", "a"]
    assert "last 1 rows" in areal_logs.text  # 517 = 4 x 129 + 1


def test_mixture_weight_two_never_repeats_rows():
    ids = mixture({"a": (2, 2), "b": (1, 3)})
    assert sorted(ids) == sorted({*ids}) and len(ids) == 5


def test_mixture_is_invariant_to_weight_scale():
    assert mixture({"a": (0.5, 5), "b": (1, 7)}, epoch=6) == mixture(
        {"a": (1, 5), "b": (2, 7)}, epoch=6
    )


def test_mixture_one_seven_with_batch_four_is_not_padded():
    ids = mixture({"a": (1, 1), "b": (1, 5), "c": (1, 1)}, size_multiple=4)
    assert len(ids) == 7 and len(set(ids)) == 7


@pytest.mark.parametrize(
    ("sizes", "epoch", "size_multiple", "message"),
    [
        ({"a": (1e308, 2), "b": (1e308, 2)}, 0, 1, "overflowed the mixture mass"),
        ({"a": (1e308, 1), "b": (1e308, 1)}, 0, 1, "overflowed the mixture mass"),
        ({"a": (1, 2), "b": (1, 3)}, 6, 1, "cannot exceed the 5 unique source rows"),
        ({"a": (1, 4), "b": (1, 4)}, 6, 4, "divisible by the training batch size 4"),
        ({"a": (1, 4), "b": (1, 4)}, -1, 1, "non-negative"),
        ({"a": (1, 4), "b": (1, 0)}, 0, 1, "contains no dataset rows"),
    ],
    ids=[
        "mass-overflow",
        "mass-sum-overflow",
        "epoch-too-large",
        "epoch-not-divisible",
        "negative",
        "empty-stream",
    ],
)
def test_mixture_rejects(sizes, epoch, size_multiple, message):
    with pytest.raises((ValueError, ArenaAPIError), match=message):
        mixture(sizes, epoch=epoch, size_multiple=size_multiple)


# --- case 57: what the workers receive ---


@pytest.fixture
def arena_config(profile_env) -> SWEPPOConfig:
    config, _ = load_expr_config(
        ["--config", str(SWE_DIR / "arena_multi_stream.yaml")], SWEPPOConfig
    )
    return config


def _streams_document() -> str:
    return yaml.safe_dump(
        {
            "streams": [
                # astra is pinned; tbench is not and gets pinned to the live grader.
                {
                    "name": "astra",
                    "stream_id": "stream-a",
                    "sampling_weight": 2,
                    "harness": "claude-code@1.0.0",
                    "expected_reward_ref": {"key": "reward-a", "version": "1.0.0"},
                },
                {"name": "tbench", "stream_id": "stream-b", "harness": "codex@2.0.0"},
            ]
        }
    )


@pytest.mark.parametrize("source", ["arena_streams_file", "arena_streams_yaml_b64"])
def test_arena_mode_hands_workers_the_resolved_streams(arena_config, tmp_path, source):
    econfig = arena_config.econfig
    econfig.arena_streams = []
    if source == "arena_streams_file":
        path = tmp_path / "streams.yaml"
        path.write_text(_streams_document())
        econfig.arena_streams_file = str(path)
    else:
        econfig.arena_streams_yaml_b64 = base64.b64encode(_streams_document().encode()).decode()
    econfig.timeout = 900.0
    gconfig = arena_config.gconfig
    gconfig.top_p, gconfig.top_k = 0.9, 40

    inputs = build_training_inputs(arena_config, arena_client=astra_tbench_arena().client())

    assert inputs.workflow == ARENA_WORKFLOW == "examples.swe.arena_agent.ArenaStreamAgentWorkflow"
    assert inputs.valid_dataset is inputs.train_dataset
    assert len(inputs.train_dataset) == 12  # the full union of 6 + 6 rows
    worker_econfig = inputs.workflow_kwargs["econfig"]
    assert isinstance(worker_econfig, dict)
    assert worker_econfig["arena_streams_file"] == ""
    assert worker_econfig["arena_streams_yaml_b64"] == ""
    streams = worker_econfig["arena_streams"]
    assert [s["name"] for s in streams] == ["astra", "tbench"]
    assert [s["stream_id"] for s in streams] == ["stream-a", "stream-b"]
    assert [s["llm_protocol"] for s in streams] == ["anthropic", "responses"]
    assert [s["expected_reward_ref"] for s in streams] == [
        {"key": "reward-a", "version": "1.0.0"},
        {"key": "reward-b", "version": "2.0.0"},
    ]
    assert inputs.workflow_kwargs["gen_args"] == {
        "temperature": gconfig.temperature,
        "top_p": 0.9,
        "top_k": 40,
        "max_completion_tokens": gconfig.max_new_tokens,
    }
    assert inputs.workflow_kwargs["timeout"] == 900.0
    assert inputs.eval_workflow_kwargs["gen_args"] == {
        "temperature": 0.0,
        "max_completion_tokens": gconfig.max_new_tokens,
    }
    assert inputs.eval_workflow_kwargs["econfig"] is worker_econfig  # a shallow copy
    assert inputs.eval_workflow_kwargs["timeout"] == 900.0


# --- case 58: unsupported sources ---


def test_unsupported_dataset_source_is_a_value_error(arena_config, profile_env):
    with pytest.raises(ValueError, match="parquet"):
        load_expr_config(
            ["--config", str(SWE_DIR / "arena_grpo.yaml"), "econfig.dataset_source=parquet"],
            SWEPPOConfig,
        )
    arena_config.econfig.dataset_source = "parquet"  # past the loader's choice check
    with pytest.raises(ValueError, match="'parquet' is not supported"):
        build_training_inputs(arena_config)


# --- case 59: JSONL datasets ---


def write_jsonl(path: Path, records: list[Any]) -> str:
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n\n")
    return str(path)


def test_jsonl_pads_small_datasets_and_keeps_every_key(tmp_path, areal_logs):
    path = write_jsonl(
        tmp_path / "train.jsonl",
        [
            {"instance_id": "i1", "problem_statement": "p1", "repo": "r1"},
            {"instance_id": "i2", "problem_statement": "p2", "image": "img2"},
            {"instance_id": "skipped"},  # no problem_statement
            {"instance_id": "i3", "problem_statement": "p3"},
        ],
    )
    rows = get_swe_dataset(path)
    assert isinstance(rows, Dataset)
    assert len(rows) == 66  # 3 valid records repeated 22 times: the first count >= 64
    assert {r["instance_id"] for r in rows} == {"i1", "i2", "i3"}
    # "image" is missing from the first record, yet kept as a column (None where absent).
    assert rows.column_names == ["instance_id", "problem_statement", "repo", "image"]
    assert list(rows["image"][:3]) == [None, "img2", None]
    first = {rows[i]["instance_id"]: rows[i] for i in range(3)}
    assert first["i1"]["image"] is None and first["i2"]["image"] == "img2"
    assert first["i3"]["repo"] is None
    assert "skipped a record" in areal_logs.text


def test_jsonl_errors(tmp_path):
    with pytest.raises(FileNotFoundError):
        get_swe_dataset(str(tmp_path / "missing.jsonl"))
    path = write_jsonl(tmp_path / "bad.jsonl", [{"instance_id": "x"}])
    with pytest.raises(ValueError, match="no record"):
        get_swe_dataset(path)


def test_jsonl_mode_is_not_trained(arena_config):
    # its agent (examples.swe.agent) is not shipped; the loader refuses it as well
    arena_config.econfig.dataset_source = "jsonl"  # past the loader's check
    with pytest.raises(ValueError, match="'jsonl' is not supported; use 'arena'"):
        build_training_inputs(arena_config)


def test_group_filter_keeps_groups_up_to_mean_095():
    assert group_filter({"rewards": [1.0, 0.9]})  # mean 0.95
    assert not group_filter({"rewards": [1.0, 1.0, 0.9]})  # mean 0.9667


# --- the local Arena (embedded default) ---


@pytest.fixture
def raw_log_messages(areal_logs):
    """Every areal log message as formatted, before any handler masks secrets."""
    messages: list[str] = []

    class Raw(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    root = areal_logging.getLogger()
    handler = Raw()
    root.handlers.insert(0, handler)
    try:
        yield messages
    finally:
        root.removeHandler(handler)


def local_config(tmp_path: Path, base_url: str = "local") -> Any:
    return SimpleNamespace(
        econfig=SimpleNamespace(arena_base_url=base_url),
        cluster=SimpleNamespace(fileroot=str(tmp_path)),
        experiment_name="exp",
        trial_name="trial",
    )


def test_local_arena_exports_credentials_and_restores_the_environment(
    tmp_path, monkeypatch, areal_logs, raw_log_messages
):
    monkeypatch.setenv("ARENA_OPENAPI_BASE", "https://previous.example")
    monkeypatch.delenv("ARENA_OPENAPI_TOKEN", raising=False)
    monkeypatch.setenv("ARENA_LLM_API_KEY", "previous-llm-key")
    config = local_config(tmp_path)

    with local_arena_if_requested(config) as arena:
        token = os.environ["ARENA_OPENAPI_TOKEN"]
        assert token == arena.token and len(token) > 20
        assert os.environ["ARENA_OPENAPI_BASE"] == arena.base_url == config.econfig.arena_base_url
        assert os.environ["ARENA_LLM_API_KEY"] == token  # the gateway accepts the API token
        with ArenaOpenAPIClient() as client:  # credentials from the environment only
            assert client.resolve_stream_id("arith-easy") == "arith-easy"
        # The gateway takes the exported key: an unknown model is a 404, not a 401.
        reply = httpx.post(
            f"{arena.gateway_url}/v1/chat/completions",
            headers={"Authorization": f"Bearer {os.environ['ARENA_LLM_API_KEY']}"},
            json={"model": "stream-areal-none", "messages": []},
        )
        assert reply.status_code == 404
        state = tmp_path / "local_arena" / "exp" / "trial"
        assert (state / "arena.db").is_file()

    assert os.environ["ARENA_OPENAPI_BASE"] == "https://previous.example"
    assert "ARENA_OPENAPI_TOKEN" not in os.environ
    assert os.environ["ARENA_LLM_API_KEY"] == "previous-llm-key"
    assert config.econfig.arena_base_url == "local"
    assert any("local Arena at" in m for m in raw_log_messages)
    assert not any(token in m for m in raw_log_messages)
    assert token not in areal_logs.text


def test_remote_arena_starts_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("ARENA_OPENAPI_BASE", BASE)
    config = local_config(tmp_path, base_url=BASE)
    with local_arena_if_requested(config) as arena:
        assert arena is None
        assert os.environ["ARENA_OPENAPI_BASE"] == BASE
    assert not (tmp_path / "local_arena").exists()


class RecordingTrainer:
    """Stands in for PPOTrainer (nothing trains): records what main hands it, what it can
    reach, and the first batch its real dataloader would draw."""

    last: RecordingTrainer | None = None

    def __init__(self, config, train_dataset=None, valid_dataset=None):
        self.config = config
        self.train_dataset = train_dataset
        self.valid_dataset = valid_dataset
        self.env = {name: os.environ.get(name) for name in ARENA_ENV}
        loader = StatefulDataLoader(
            train_dataset,
            batch_size=config.train_dataset.batch_size,
            shuffle=config.train_dataset.shuffle,
            drop_last=config.train_dataset.drop_last,
        )
        self.first_batch = next(iter(loader))
        self.closed = False
        RecordingTrainer.last = self

    def __enter__(self) -> RecordingTrainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.closed = True

    def train(self, **kwargs: Any) -> None:
        self.train_kwargs = kwargs
        with ArenaOpenAPIClient() as client:  # as a worker would: credentials from env
            self.active_streams = [s["stream_id"] for s in client.list_streams()]


def test_main_hands_the_trainer_the_local_arena_mixture(
    profile_env, monkeypatch, raw_log_messages, areal_logs
):
    # main up to PPOTrainer, with a recorder in its place: nothing trains here (the
    # integration tests train for real against the local Arena).
    monkeypatch.delenv("ARENA_OPENAPI_TOKEN", raising=False)
    monkeypatch.delenv("ARENA_LLM_API_KEY", raising=False)
    monkeypatch.setattr(train_swe_rl, "PPOTrainer", RecordingTrainer)
    main(
        [
            "--config",
            str(SWE_DIR / "arena_multi_stream.yaml"),
            "econfig.arena_base_url=local",
            "econfig.arena_streams=[{name:arith,stream_id:arith-easy,sampling_weight:2},"
            "{name:code,stream_id:py-funcs}]",
            "should_accept_fn=examples.swe.filter_function.filter_function",
        ]
    )

    trainer = RecordingTrainer.last
    assert trainer is not None and trainer.closed
    kwargs = trainer.train_kwargs
    assert kwargs["workflow"] == ARENA_WORKFLOW
    assert kwargs["eval_workflow"] is None
    assert kwargs["dynamic_filter_fn"] == "examples.swe.filter_function.filter_function"
    assert kwargs["eval_workflow_kwargs"]["gen_args"]["temperature"] == 0.0
    assert isinstance(trainer.train_dataset, Dataset)
    assert len(trainer.train_dataset) == 56  # arith-easy 40 + py-funcs 16
    assert trainer.valid_dataset is trainer.train_dataset
    # The profile does not shuffle: the first batch is the start of the 2:1 round-robin.
    batch = trainer.first_batch
    assert len(batch) == trainer.config.train_dataset.batch_size
    assert [row["arena_stream_name"] for row in batch[:3]] == ["arith", "arith", "code"]
    assert batch[0] == trainer.train_dataset[0]
    assert {"arith-easy", "py-funcs"} <= set(trainer.active_streams)

    # Workers started by the trainer inherit the local Arena's URL and token.
    url = trainer.env["ARENA_OPENAPI_BASE"]
    token = trainer.env["ARENA_OPENAPI_TOKEN"]
    assert url.startswith("http://127.0.0.1:") and token
    assert trainer.env["ARENA_LLM_API_KEY"] == token
    econfig = kwargs["workflow_kwargs"]["econfig"]
    assert econfig["arena_base_url"] == url
    assert [(s["stream_id"], s["expected_reward_ref"]) for s in econfig["arena_streams"]] == [
        ("arith-easy", {"key": "exact-match", "version": "1.0.0"}),
        ("py-funcs", {"key": "python-tests", "version": "1.0.0"}),
    ]

    # Afterwards: the environment is as before and the token was never logged or saved.
    assert os.environ["ARENA_OPENAPI_BASE"] == profile_env["ARENA_OPENAPI_BASE"]
    assert "ARENA_OPENAPI_TOKEN" not in os.environ and "ARENA_LLM_API_KEY" not in os.environ
    fileroot = Path(profile_env["AREAL_FILEROOT"])
    assert (fileroot / "local_arena" / "arena-grpo" / "smoke" / "arena.db").is_file()
    assert not any(token in m for m in raw_log_messages)
    assert token not in areal_logs.text
    for saved in fileroot.rglob("config.yaml"):
        assert token not in saved.read_text()


@pytest.mark.parametrize(
    ("schedule", "valid", "expected"),
    [
        ({}, [{"id": 0}], False),  # no evaluator frequency: no eval workers start
        ({"freq_steps": 10}, [{"id": 0}], True),
        ({"eval_before_train": True}, [{"id": 0}], True),
        ({"freq_steps": 10}, None, False),  # nothing to evaluate
        ({"freq_steps": 10}, [], False),
    ],
)
def test_evaluation_runs_only_when_scheduled_with_valid_rows(schedule, valid, expected):
    evaluator = {"freq_epochs": None, "freq_steps": None, "freq_secs": None}
    evaluator.update({"eval_before_train": False, **schedule})
    config = SimpleNamespace(evaluator=SimpleNamespace(**evaluator))
    inputs = SimpleNamespace(valid_dataset=valid)
    assert train_swe_rl.evaluation_scheduled(config, inputs) is expected


# --- held-out evaluation Streams ---


def test_held_out_streams_are_the_validation_rows(arena_config):
    arena = astra_tbench_arena().add("stream-h", 4, harness="default-harness")
    econfig = arena_config.econfig
    econfig.arena_streams = astra_tbench_streams()
    econfig.arena_eval_streams = [ArenaStreamConfig(name="held", stream_id="stream-h")]

    inputs = build_training_inputs(arena_config, arena_client=arena.client())

    assert len(inputs.train_dataset) == 12  # training rows only
    assert {r["arena_stream_name"] for r in inputs.train_dataset} == {"astra", "tbench"}
    assert [r["data_id"] for r in inputs.valid_dataset] == [f"stream-h-{i}" for i in range(4)]
    assert set(inputs.valid_dataset["arena_stream_name"]) == {"held"}
    # the workers can launch tasks of both: the held-out Stream is pinned beside the others
    pinned = inputs.workflow_kwargs["econfig"]["arena_streams"]
    assert [s["name"] for s in pinned] == ["astra", "tbench", "held"]
    assert inputs.eval_workflow_kwargs["gen_args"]["temperature"] == 0.0


@pytest.mark.parametrize(
    "held", [{"name": "astra", "stream_id": "stream-h"}, {"name": "h", "stream_id": "stream-b"}]
)
def test_a_held_out_stream_must_not_be_trained_on(arena_config, held):
    arena = astra_tbench_arena().add("stream-h", 4, harness="default-harness")
    econfig = arena_config.econfig
    econfig.arena_streams = astra_tbench_streams()
    econfig.arena_eval_streams = [ArenaStreamConfig(**held)]
    with pytest.raises(ValueError, match=r"arena_eval_streams.*also a training Stream"):
        build_training_inputs(arena_config, arena_client=arena.client())


def test_the_local_arena_runs_every_task_the_rollout_side_may_have_in_flight():
    """Groups in flight (the staleness bound, max_concurrent_rollouts) times n_samples
    tasks, within the server's [64, 1024]; fewer slots queue tasks inside the Arena."""
    from types import SimpleNamespace

    from examples.swe.train_swe_rl import local_arena_task_slots

    def slots(eta: int, batch: int, samples: int, concurrent: int | None) -> int:
        rollout = SimpleNamespace(
            consumer_batch_size=batch,
            max_head_offpolicyness=eta,
            max_concurrent_rollouts=concurrent,
        )
        return local_arena_task_slots(
            SimpleNamespace(rollout=rollout, gconfig=SimpleNamespace(n_samples=samples))
        )

    assert slots(2, 8, 8, 100) == 3 * 8 * 8  # the staleness bound: (eta + 1) batches
    assert slots(2, 8, 8, 10) == 10 * 8  # max_concurrent_rollouts counts groups
    assert slots(0, 2, 8, None) == 64  # at least the server's default
    assert slots(10, 64, 16, None) == 1024  # at most its limit
