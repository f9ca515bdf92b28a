"""``/update_weights_from_tensor`` on the embedded server: tensors handed over by handle.

The payloads are built by the trainer's side (:mod:`areal.engine.tensor_share`: a
``flattened_bucket`` in CPU shared memory, pickled by ``ForkingPickler``) in a separate
process, as an actor rank colocated with the server builds them, and read by the server's
own reader (:mod:`areal.inference.tensor_payloads`). The route runs only inside a
``/begin_weight_update`` .. ``/end_weight_update`` session, as in SGLang 0.5.23, takes one
entry per TP rank, and refuses a pickle that names anything but tensor machinery.
"""

from __future__ import annotations

import base64
import os
import pickle
import subprocess
import sys
import textwrap

import httpx
import pytest
import torch
from transformers import AutoModelForCausalLM

from areal.engine.tensor_share import SharedBuckets, serialize
from areal.inference.engine import GenerationEngine
from areal.inference.server import create_app
from tests.fakes.live_server import serve

PROMPT = {
    "input_ids": [1, 2, 3, 4],
    "sampling_params": {"max_new_tokens": 3, "temperature": 0.0},
    "return_logprob": True,
}


def shifted_state(model_dir, delta: float) -> dict[str, torch.Tensor]:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    return {name: t + delta for name, t in model.state_dict().items()}


class Sender:
    """A process that shares ``state`` (HF names) as one flattened bucket per call and
    keeps it alive until told to stop, printing each payload on a line."""

    def __init__(self, model_dir, delta: float, copies: int = 1):
        code = textwrap.dedent(
            f"""
            import sys, torch
            from transformers import AutoModelForCausalLM
            from areal.engine.tensor_share import SharedBuckets
            model = AutoModelForCausalLM.from_pretrained({str(model_dir)!r}, dtype=torch.float32)
            named = [(n, t + {delta}) for n, t in model.state_dict().items()]
            shared = SharedBuckets()
            for _ in range({copies}):
                print(shared.share(named, torch.device("cpu")), flush=True)
            sys.stdin.readline()  # alive until the server has answered
            shared.release()
            """
        )
        env = {**os.environ, "PYTHONPATH": os.getcwd()}
        self.process = subprocess.Popen(
            [sys.executable, "-c", code],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.payloads = [self.process.stdout.readline().strip() for _ in range(copies)]
        assert all(self.payloads), "the sender printed no payload"

    def close(self) -> None:
        self.process.stdin.write("\n")
        self.process.stdin.flush()
        assert self.process.wait(timeout=30) == 0


@pytest.fixture
def server(tiny_model_dir):
    engine = GenerationEngine(str(tiny_model_dir), device="cpu", tp_size=2).start()
    try:
        with serve(create_app(engine)) as url:
            yield url, engine
    finally:
        engine.stop()


def update(url: str, entries: list[str], **extra) -> httpx.Response:
    body = {"serialized_named_tensors": entries, "load_format": "flattened_bucket", **extra}
    return httpx.post(f"{url}/update_weights_from_tensor", json=body, timeout=60)


def test_tensors_from_another_process_are_loaded_inside_a_session(server, tiny_model_dir):
    url, engine = server
    expected = shifted_state(tiny_model_dir, 0.25)
    before = httpx.post(f"{url}/generate", json=PROMPT, timeout=30).json()
    sender = Sender(tiny_model_dir, 0.25, copies=2)  # one entry per TP rank
    try:
        outside = update(url, sender.payloads)
        assert outside.status_code == 400
        assert "between begin_weight_update() and end_weight_update()" in outside.text
        assert httpx.post(f"{url}/begin_weight_update", json={}).status_code == 200
        again = httpx.post(f"{url}/begin_weight_update", json={})
        assert again.status_code == 400 and "already open" in again.text
        answer = update(url, sender.payloads, weight_version="7", flush_cache=True)
        assert answer.status_code == 200, answer.text
        assert answer.json()["success"] is True
        assert httpx.post(f"{url}/end_weight_update", json={}).status_code == 200
    finally:
        sender.close()
    # the copy outlives the sender's memory
    for name, tensor in engine.model.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    after = httpx.post(f"{url}/generate", json=PROMPT, timeout=30).json()
    assert after["meta_info"]["weight_version"] == "7"
    assert (
        after["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
    )


def test_one_entry_per_tp_rank_and_nothing_but_tensors(server, tiny_model_dir):
    url, engine = server
    weights = {n: t.clone() for n, t in engine.model.state_dict().items()}
    shared = SharedBuckets()
    entry = shared.share([("model.embed_tokens.weight", weights["model.embed_tokens.weight"])],
                         torch.device("cpu"))  # fmt: skip
    unknown = shared.share([("no.such.weight", torch.zeros(2))], torch.device("cpu"))
    evil = base64.b64encode(pickle.dumps(os.system)).decode()
    httpx.post(f"{url}/begin_weight_update", json={})
    try:
        short = update(url, [entry])
        assert short.status_code == 400 and "one per TP rank" in short.text
        refused = update(url, [evil, evil])
        assert refused.status_code == 400
        assert "may hold tensors only" in refused.text and "system" in refused.text
        missing = update(url, [unknown, unknown])
        assert missing.status_code == 400 and "no.such.weight" in missing.text
        bad_format = update(url, [entry, entry], load_format="safetensors")
        assert bad_format.status_code == 400 and "load_format" in bad_format.text
        pairs = serialize([("model.embed_tokens.weight", weights["model.embed_tokens.weight"])])
        direct = update(url, [pairs, pairs], load_format="direct")
        assert direct.status_code == 200, direct.text
    finally:
        httpx.post(f"{url}/end_weight_update", json={})
        shared.release()
    for name, tensor in engine.model.state_dict().items():  # nothing was half-loaded
        assert torch.equal(tensor, weights[name]), name
    assert httpx.post(f"{url}/generate", json=PROMPT, timeout=30).status_code == 200
