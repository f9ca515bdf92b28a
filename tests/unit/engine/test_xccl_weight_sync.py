"""Weight sync over a weight-update group (``xccl``) on CPU: gloo, several servers, TP ranks.

The trainer is an FSDP engine in this process; each inference server is a real
``python -m areal.inference.server`` process that joins the group by SGLang's procedure
with ``--tp-size`` ranks. After an update every server must serve exactly the trainer's
weights, and a server that refuses a bucket must fail the update instead of hanging.
"""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

from areal.api.cli_args import InferenceEngineConfig
from areal.api.io_struct import WeightUpdateMeta
from areal.engine.sglang_remote import RemoteSGLangEngine
from areal.utils.network import find_free_port, wait_healthy
from tests.unit.engine.fsdp_worker import fixed_batch, token_mean_nll
from tests.unit.engine.test_fsdp_engine import count, make_engine

REPO = Path(__file__).resolve().parents[3]


def start_server(model: Path, tp_size: int) -> tuple[subprocess.Popen, str]:
    port = find_free_port()
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "areal.inference.server", "--model-path", str(model)),
            *("--host", "127.0.0.1", "--port", str(port), "--device", "cpu"),
            *("--dtype", "float32", "--tp-size", str(tp_size)),
        ],
        cwd=REPO,
    )
    address = f"127.0.0.1:{port}"
    wait_healthy(address, process, timeout=120, what="inference server")
    return process, address


@pytest.fixture(scope="module")
def servers(tiny_model_dir):
    """Two servers with TP 2, shared by the tests (each update rejoins the group)."""
    started = [start_server(tiny_model_dir, tp_size=2) for _ in range(2)]
    yield [address for _, address in started]
    for process, _ in started:
        process.terminate()
    for process, _ in started:
        process.wait(timeout=30)


def greedy(address: str, prompt: list[int]) -> tuple[list[int], list[float]]:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
        "return_logprob": True,
    }
    out = httpx.post(f"http://{address}/generate", json=body, timeout=60).json()
    pairs = out["meta_info"]["output_token_logprobs"]
    return [p[1] for p in pairs], [p[0] for p in pairs]


@pytest.mark.parametrize("n_servers", [1, 2])
def test_every_server_serves_the_trainers_weights(servers, n_servers, tiny_model_dir):
    addresses, tp = servers[:n_servers], 2
    engine = make_engine(tiny_model_dir)
    rollout = RemoteSGLangEngine(InferenceEngineConfig(backend=f"hf:d{len(addresses)}t{tp}"))
    try:
        rollout.initialize(addr=addresses)
        meta = WeightUpdateMeta(type="xccl", gen_tp_size=tp, gen_n_servers=len(addresses))
        engine.connect_engine(rollout, meta)
        assert meta.comm_backend == "gloo"  # chosen by the CPU trainer
        for address in addresses:
            info = httpx.get(f"http://{address}/get_server_info").json()
            assert info["tp_size"] == tp
        prompt = fixed_batch()["input_ids"][0, :6].tolist()

        def check_served() -> list[int]:
            served = [greedy(a, prompt) for a in addresses]
            sequence = torch.tensor([prompt + served[0][0]])
            trainer = engine.forward_batch(
                {"input_ids": sequence, "attention_mask": torch.ones_like(sequence)}
            )[0, len(prompt) - 1 : -1]
            for tokens, logprobs in served:
                assert tokens == served[0][0]
                torch.testing.assert_close(
                    torch.tensor(logprobs), trainer.float(), rtol=0, atol=1e-4
                )
            return served[0][0]

        engine.update_weights(meta)  # the servers are shared: start from the trainer's
        before = check_served()
        for _ in range(6):  # move the weights far enough to change greedy choices
            engine.train_batch(fixed_batch(), token_mean_nll, count)
        for version in (1, 2):  # the group serves more than one update
            engine.set_version(version)
            engine.update_weights(meta)
            after = check_served()
            engine.train_batch(fixed_batch(), token_mean_nll, count)
        assert after != before, "the updates did not change the served model"
    finally:
        rollout.destroy()
        engine.destroy()


def test_a_refused_bucket_fails_the_update_at_once(servers, tiny_model_dir, monkeypatch):
    addresses = servers[:1]
    engine = make_engine(tiny_model_dir)
    rollout = RemoteSGLangEngine(InferenceEngineConfig(backend="hf:d1t2"))
    try:
        rollout.initialize(addr=addresses)
        meta = WeightUpdateMeta(type="xccl", gen_tp_size=2, gen_n_servers=1)
        engine.connect_engine(rollout, meta)
        real = engine._weights_for_inference

        def renamed():  # a tensor the served model does not have: the server refuses
            for i, (name, tensor) in enumerate(real()):
                yield ("model.no_such.weight" if i == 0 else name), tensor

        monkeypatch.setattr(engine, "_weights_for_inference", renamed)
        begin = time.monotonic()
        with pytest.raises(RuntimeError, match="refused a weight bucket"):
            engine.update_weights(meta)
        assert time.monotonic() - begin < 30  # not the group's 600 s timeout
    finally:
        rollout.destroy()
        engine.destroy()


def test_a_server_failing_to_join_fails_the_trainer_fast():
    from areal.engine import weight_sync

    # a group of two whose second rank never arrives: the trainer's store would wait
    meta = WeightUpdateMeta(
        type="xccl", comm_backend="gloo", nccl_master_port=find_free_port(), gen_n_servers=1
    )
    failed: concurrent.futures.Future = concurrent.futures.Future()
    threading.Timer(
        0.5, lambda: failed.set_exception(RuntimeError("HTTP 400: needs a CUDA server"))
    ).start()
    begin = time.monotonic()
    with pytest.raises(RuntimeError, match="failed to join the weight-update group"):
        weight_sync._join_weight_group(meta, failed)
    assert time.monotonic() - begin < 10
