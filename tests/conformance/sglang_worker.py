"""Runs inside one SGLang version's interpreter and answers the conformance tests' requests.

Started by :class:`tests.conformance.worker_client.SGLangWorker` as ``python -P -m
tests.conformance.sglang_worker`` with ``PYTHONPATH=<cache>/<version>:<cache>/torch-X:<repo>``,
so that version's SGLang comes first on ``sys.path`` and two versions never share an
interpreter. It imports SGLang's own HTTP app, argument parser, ``SamplingParams`` and
model-runner weight-update code once, then answers one JSON request per stdin line with one
JSON line on the protocol pipe (the original stdout; SGLang's own prints go to stderr).

Requests: ``info``, ``route`` (a body through SGLang's FastAPI app, recorded by a stub
tokenizer manager), ``sampling`` (``SamplingParams(**params)`` plus ``normalize``/``verify``),
``parse_args`` (SGLang's CLI parser), ``ranks_start``/``ranks_wait`` (forked processes that
join a weight-update group with SGLang's model-runner code and receive broadcasts), and the
parser requests of :mod:`tests.conformance.parser_probe`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib.metadata
import io
import json
import os
import sys
import time
import traceback
import types
from pathlib import Path
from typing import Any


def _skip_torchvision_fake_kernels() -> None:
    """torchvision's wheel links CUDA torch; with the venv's CPU torch its ``_C`` ops are
    missing, and only its fake-kernel registrations (torch.compile metadata) need them."""
    name = "torchvision._meta_registrations"
    sys.modules[name] = types.ModuleType(name)


_skip_torchvision_fake_kernels()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from sglang.srt.entrypoints import http_server  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402

from tests.conformance.group_ranks import TENSORS, digest, make_tensor  # noqa: E402
from tests.conformance.parser_probe import HANDLERS as PARSER_HANDLERS  # noqa: E402

VOCAB_SIZE = 151936  # any vocabulary larger than the token ids the tests send


# --- JSON view of what SGLang parsed ----------------------------------------------------------


def jsonable(value: Any) -> Any:
    """``value`` as JSON, keeping the Python type name of every scalar."""
    if isinstance(value, (bool, int, float, str)) or value is None:
        return {"value": value, "type": type(value).__name__}
    if isinstance(value, (list, tuple, set)):
        items = sorted(value) if isinstance(value, set) else value
        return {"value": [jsonable(v) for v in items], "type": type(value).__name__}
    if isinstance(value, dict):
        return {"value": {str(k): jsonable(v) for k, v in value.items()}, "type": "dict"}
    return {"value": repr(value), "type": type(value).__name__}


def fields_of(obj: Any) -> dict[str, Any]:
    """The fields of an SGLang request object (a dataclass or a msgspec Struct)."""
    if dataclasses.is_dataclass(obj):
        names = [f.name for f in dataclasses.fields(obj)]
    elif hasattr(type(obj), "__struct_fields__"):
        names = list(type(obj).__struct_fields__)
    else:
        names = [n for n in vars(obj) if not n.startswith("_")]
    return {name: jsonable(getattr(obj, name)) for name in names}


class _CharTokenizer:
    """What ``SamplingParams.normalize`` asks of a tokenizer: ``encode`` of stop strings."""

    eos_token_id = 0

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


def check_sampling(params: dict[str, Any], with_tokenizer: bool = True) -> dict[str, Any]:
    """What SGLang's tokenizer manager does with ``sampling_params`` for one request."""
    try:
        sampling = SamplingParams(**params)
        sampling.normalize(_CharTokenizer() if with_tokenizer else None)
        sampling.verify(VOCAB_SIZE)
    except Exception as error:  # reported to the test, which asserts on it
        return {"ok": False, "error": f"{type(error).__name__}: {error}"}
    return {"ok": True, "fields": fields_of(sampling)}


# --- the stub tokenizer manager behind SGLang's routes ----------------------------------------


class RecordingTokenizerManager:
    """Stands where SGLang's ``TokenizerManager`` stands; records what each route parsed."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        # 0.5.10's /update_weight_version sets the version here; 0.5.23 calls the method
        self.server_args = types.SimpleNamespace(weight_version="default")

    def _record(self, method: str, obj: Any, **extra: Any) -> None:
        entry = {"method": method, "class": type(obj).__name__, "fields": fields_of(obj)}
        self.calls.append(entry | extra)

    async def generate_request(self, obj: Any, request: Any = None):
        # the checks SGLang runs before tokenizing: request normalization, then sampling
        obj.normalize_batch_and_arguments()
        sampling = check_sampling(obj.sampling_params)
        self._record("generate_request", obj, sampling=sampling)
        if not sampling["ok"]:
            raise ValueError(sampling["error"])  # SGLang's route turns this into a 400
        yield {
            "text": "",
            "output_ids": [],
            "meta_info": {"id": obj.rid, "finish_reason": {"type": "length", "length": 0}},
        }

    async def update_weights_from_disk(self, obj: Any, request: Any = None):
        self._record("update_weights_from_disk", obj)
        return True, "recorded", 0

    async def init_weights_update_group(self, obj: Any, request: Any = None):
        self._record("init_weights_update_group", obj)
        return True, "recorded"

    async def update_weights_from_distributed(self, obj: Any, request: Any = None):
        self._record("update_weights_from_distributed", obj)
        return True, "recorded"

    async def pause_generation(self, obj: Any):
        self._record("pause_generation", obj)

    async def continue_generation(self, obj: Any):
        self._record("continue_generation", obj)

    async def update_weight_version(self, obj: Any):
        self._record("update_weight_version", obj)

    def abort_request(self, rid: str = "", abort_all: bool = False):
        # the route passes the parsed AbortReq's two fields, not the object
        self.calls.append(
            {
                "method": "abort_request",
                "class": "AbortReq",
                "fields": {"rid": jsonable(rid), "abort_all": jsonable(abort_all)},
            }
        )

    async def release_memory_occupation(self, obj: Any, request: Any = None):
        self._record("release_memory_occupation", obj)

    async def resume_memory_occupation(self, obj: Any, request: Any = None):
        self._record("resume_memory_occupation", obj)


_MANAGER = RecordingTokenizerManager()
http_server.set_global_state(
    http_server._GlobalState(tokenizer_manager=_MANAGER, template_manager=None, scheduler_info={})
)
_CLIENT = TestClient(http_server.app, raise_server_exceptions=False)


def route(method: str, path: str, body: Any) -> dict[str, Any]:
    """One request through SGLang's own app; what its route parsed, and its answer."""
    _MANAGER.calls.clear()
    response = _CLIENT.request(method, path, json=body)
    return {"status": response.status_code, "text": response.text[:2000], "calls": _MANAGER.calls}


# --- SGLang's launch-flag parser --------------------------------------------------------------


_PARSER: argparse.ArgumentParser | None = None


def _parser() -> argparse.ArgumentParser:
    global _PARSER
    if _PARSER is None:  # parse_args leaves the parser unchanged, so one serves every call
        _PARSER = argparse.ArgumentParser(prog="sglang serve")
        ServerArgs.add_cli_args(_PARSER)
    return _PARSER


def parse_args(argv: list[str]) -> dict[str, Any]:
    """``argv`` (after ``-m sglang.launch_server``) through the parser ``sglang serve`` builds,
    then ``ServerArgs.from_cli_args``."""
    parser = _parser()
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            namespace = parser.parse_args(argv)
    except SystemExit as exit_:
        error = [line for line in stderr.getvalue().splitlines() if "error:" in line]
        return {"ok": False, "exit_code": exit_.code, "error": "\n".join(error)}
    values = {key: jsonable(value) for key, value in vars(namespace).items()}
    # the field each flag we passed lands in (argparse's dest, e.g. --dp-size -> dp_size)
    actions = parser._option_string_actions
    dests = {arg: actions[arg].dest for arg in argv if arg in actions}
    result: dict[str, Any] = {"ok": True, "values": values, "dests": dests}
    try:
        ServerArgs.from_cli_args(namespace)
        result["from_cli_args"] = {"ok": True}
    except Exception as error:  # reported: some versions' __post_init__ probe the accelerator
        result["from_cli_args"] = {"ok": False, "error": f"{type(error).__name__}: {error}"[:800]}
    return result


def cuda_graph_config(argv: list[str]) -> dict[str, Any] | None:
    """The per-phase CUDA-graph settings SGLang's own resolution step derives from ``argv``
    (versions with per-phase graphs, 0.5.14 and later); None where there is no such step."""
    try:
        from sglang.srt.arg_groups.cuda_graph_hook import parse_cuda_graph_config
        from sglang.srt.arg_groups.overrides import resolving_view
    except ImportError:
        return None
    server_args = ServerArgs.from_cli_args(_parser().parse_args(argv))
    parse_cuda_graph_config(server_args)
    config = resolving_view(server_args).cuda_graph_config
    return {
        phase: {key: jsonable(getattr(getattr(config, phase), key)) for key in ("max_bs", "bs")}
        for phase in ("decode", "prefill")
    }


# --- SGLang's side of the weight-update group -------------------------------------------------


class _RecordingModel:
    """Receives ``load_weights`` from SGLang's update code."""

    def __init__(self) -> None:
        self.loaded: list[tuple[str, torch.Tensor]] = []

    def load_weights(self, weights) -> None:
        self.loaded.extend(weights)


def _sglang_server_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """One TP scheduler rank of an SGLang server: default TP group, then SGLang's own
    ``init_weights_update_group`` and ``update_weights_from_distributed`` code."""
    # SGLang asserts its TP default group exists before it joins (init_distributed_environment)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{spec['tp_group_port']}",
        world_size=spec["tp_size"],
        rank=spec["tp_rank"],
    )
    join = dict(
        master_address=spec["master_address"],
        master_port=spec["master_port"],
        rank_offset=spec["rank_offset"],
        world_size=spec["world_size"],
        group_name=spec["group_name"],
        backend=spec["backend"],
    )
    names, dtypes, shapes = spec["names"], spec["dtypes"], spec["shapes"]  # as SGLang parsed them
    model = _RecordingModel()
    runner = _weight_update_runner(spec["tp_rank"], model)
    begin = time.monotonic()
    ok, message = runner.init_weights_update_group(**join)
    out: dict[str, Any] = {"joined": ok, "message": message, "join_s": time.monotonic() - begin}
    if not ok:
        return out
    group = runner._model_update_group[spec["group_name"]]
    out["group_rank"] = group.rank()
    out["group_size"] = group.size()
    if hasattr(runner, "receive_weights_from_distributed"):  # 0.5.23: receive, then load
        received = runner.receive_weights_from_distributed(
            names=names, dtypes=dtypes, shapes=shapes, group_name=spec["group_name"]
        )
        model.load_weights(received)
        ok, message = True, "received"
    else:
        ok, message = runner.update_weights_from_distributed(
            names, dtypes, shapes, spec["group_name"]
        )
    out |= {"updated": ok, "update_message": message}
    out["received"] = {name: digest(tensor) for name, tensor in model.loaded}
    dist.destroy_process_group(group)
    dist.destroy_process_group()
    return out


def _sglang_trainer_rank(spec: dict[str, Any]) -> dict[str, Any]:
    """A trainer side built from SGLang's own code: its ``init_custom_process_group`` as rank 0
    (the store host), then ``torch.distributed.broadcast(tensor, src=0, group=group)``."""
    from sglang.srt.utils import init_custom_process_group

    group = init_custom_process_group(
        backend=spec["backend"],
        init_method=f"tcp://{spec['master_address']}:{spec['master_port']}",
        world_size=spec["world_size"],
        rank=0,
        group_name=spec["group_name"],
    )
    sent = {}
    for name, dtype, shape in TENSORS:
        tensor = make_tensor(name, dtype, shape)
        dist.broadcast(tensor, src=0, group=group)
        sent[name] = digest(tensor)
    dist.destroy_process_group(group)
    return {"sent": sent, "group_rank": 0}


def _weight_update_runner(tp_rank: int, model: _RecordingModel) -> Any:
    """The object whose methods SGLang's scheduler calls for weight updates, for one TP rank."""
    try:  # 0.5.23: a WeightUpdater component of the model runner
        from sglang.srt.model_executor.model_runner_components.weight_updater import (
            WeightUpdater,
        )
    except ImportError:  # 0.5.10.post1: methods of ModelRunner itself
        from sglang.srt.model_executor.model_runner import ModelRunner

        return _BoundMethods(
            ModelRunner, tp_rank=tp_rank, device="cpu", model=model, _model_update_group={}
        )
    unused = lambda *a, **k: None  # noqa: E731 - callbacks weight updates from a group never use
    return WeightUpdater(
        tp_rank=tp_rank,
        device="cpu",
        gpu_id=0,
        model_config=None,
        custom_weight_loaders={},
        get_model=lambda: model,
        update_model_fields=unused,
        recapture_cuda_graph=unused,
        get_model_runner=unused,
    )


class _BoundMethods:
    """``ModelRunner``'s weight-update methods bound to just the attributes they read."""

    def __init__(self, cls: type, **attributes: Any):
        vars(self).update(attributes)
        self._cls = cls

    def __getattr__(self, name: str) -> Any:
        function = getattr(self._cls, name)
        return function.__get__(self)


_ROLES = {"sglang_server_rank": _sglang_server_rank, "sglang_trainer": _sglang_trainer_rank}


def ranks_start(specs: list[dict[str, Any]], result_dir: str) -> list[int]:
    """Fork one process per rank spec; each writes ``<result_dir>/<spec name>.json``."""
    pids = []
    for spec in specs:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the rank process
            code = 0
            try:
                result = {"ok": True} | _ROLES[spec["role"]](spec)
            except BaseException:
                result = {"ok": False, "error": traceback.format_exc()[-4000:]}
                code = 1
            path = Path(result_dir) / f"{spec['name']}.json"
            path.write_text(json.dumps(result))
            os._exit(code)
        pids.append(pid)
    return pids


def ranks_wait(pids: list[int], result_dir: str, names: list[str], wait_s: float) -> dict:
    """Wait for the rank processes (killing stragglers) and collect their results."""
    deadline = time.monotonic() + wait_s
    pending = set(pids)
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done:
                pending.discard(pid)
        time.sleep(0.05)
    for pid in pending:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    results = {}
    for name in names:
        path = Path(result_dir) / f"{name}.json"
        results[name] = json.loads(path.read_text()) if path.exists() else {"ok": False}
        if not path.exists():
            results[name]["error"] = f"no result within {wait_s} s (killed)"
    return results


def info() -> dict[str, Any]:
    import sgl_kernel
    import sglang

    return {
        "sglang_version": importlib.metadata.version("sglang"),
        "sglang_file": sglang.__file__,
        "torch_version": torch.__version__,
        "torch_file": torch.__file__,
        "kernel_standin": getattr(sgl_kernel, "STANDIN", False),
        "kernel_file": sgl_kernel.__file__,
        "sys_path_head": sys.path[:3],
    }


_HANDLERS = {
    "info": info,
    "route": route,
    "sampling": check_sampling,
    "parse_args": parse_args,
    "cuda_graph_config": cuda_graph_config,
    "ranks_start": ranks_start,
    "ranks_wait": ranks_wait,
    **PARSER_HANDLERS,
}


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever SGLang prints must not corrupt the protocol
    sys.stdout = sys.stderr
    try:  # the model-runner module (0.5.10.post1) is imported once, before any fork
        _weight_update_runner(0, _RecordingModel())
    except Exception:
        traceback.print_exc()
    protocol.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        request = json.loads(line)
        try:
            reply = {"ok": True, "result": _HANDLERS[request["op"]](**request.get("args", {}))}
        except Exception:
            reply = {"ok": False, "error": traceback.format_exc()[-4000:]}
        protocol.write(json.dumps(reply) + "\n")
    protocol.flush()
    os._exit(0)  # stdin closed: skip interpreter teardown, which takes seconds after SGLang


if __name__ == "__main__":
    main()
