"""``awex`` weight updates speak SGLang's ``/update_weights_from_tensor`` contract, per version.

What a rollout worker sends (:class:`SGLangBackend`'s session and tensor requests, with real
payloads from :mod:`areal.engine.tensor_share`) goes, once per tested SGLang version, to a
probe process on that version's ``sys.path`` (as the tier's workers are started; the probe
reuses :mod:`tests.conformance.sglang_worker`'s app and stub tokenizer manager, adding the
three methods these routes call). One round trip per version checks:

* HTTP: each body parses through SGLang's own FastAPI app into its request model
  (``UpdateWeightsFromTensorReqInput``; ``Begin``/``EndWeightUpdateReqInput`` in 0.5.23) with
  every field we send kept; the routes are POST routes of its app. 0.5.10.post1 has no
  session routes: it answers 404, which ``open_weight_session`` skips.
* Loading: what the route parsed goes down SGLang's own path for a TP rank (0.5.23's
  tokenizer-manager payload normalization; ``monkey_patch_torch_reductions`` and
  ``MultiprocessingSerializer.deserialize`` of that rank's entry through ``SafeUnpickler``;
  the model runner's flattened-bucket load, which builds ``FlattenedTensorMetadata`` from
  each record and ``FlattenedTensorBucket.reconstruct_tensors``) and must hand the model
  exactly our tensors: names, order, dtypes, shapes, bytes. The CPU payloads here name
  their storage by file (torch's ``file_system`` strategy); both versions' unpicklers
  admit every global they refer to (0.5.23's exact allowlist lists
  ``rebuild_storage_filename`` too). Such a payload is read once: each unpickling drops
  the reference its pickling took, and the last reader unlinks the file, so every
  version gets payloads of its own. The same dict pickled by value (plain ``pickle``:
  ``_rebuild_tensor_v2``, storages by bytes through 0.5.23's safe storage loader) loads
  the same way too.
* CUDA payloads (no GPU here): the payload our sender builds for a CUDA tensor is made by
  the real :func:`tensor_share.serialize` and ``_reduce_tensor`` with torch's CUDA branch of
  ``reduce_tensor`` stood in (same rebuild function, same argument layout, fake IPC
  handles). Every global it names is admitted by each version's ``SafeUnpickler`` (on
  0.5.23's ``ALLOWED_GLOBALS``), and the device UUID at index 6 of ``rebuild_cuda_tensor``'s
  arguments reaches SGLang's ``_device_from_maybe_uuid``. That matters because the payload
  names ``torch.multiprocessing.reductions.rebuild_cuda_tensor``, which SGLang's scheduler
  rebinds (``monkey_patch_torch_reductions``, called before every deserialize) to
  ``_rebuild_cuda_tensor_modified``: that wrapper maps a UUID to the index the *server*
  process gives that GPU. The index stock torch sends would name the wrong GPU whenever
  the two processes see different ``CUDA_VISIBLE_DEVICES`` (a TP server spanning several
  actor ranks' GPUs), and a UUID reaching an unpatched ``rebuild_cuda_tensor`` would not
  rebuild at all.
* A pickle naming ``os.system`` is refused, by SGLang's unpickler and by the embedded
  server's reader, and runs nothing.
* The embedded server's ``TensorUpdateBody`` has SGLang's field names and defaults for the
  fields we send, and its three routes are POST routes as in SGLang 0.5.23.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib
import inspect
import io
import json
import os
import pickle
import subprocess
import sys
import traceback
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.multiprocessing import reductions

from areal.engine.sglang_backend import SGLangBackend
from areal.engine.tensor_share import SharedBuckets, flatten_bucket, serialize
from areal.inference.bodies import TensorUpdateBody
from areal.inference.errors import RequestError
from areal.inference.tensor_payloads import read_named_tensors
from tests.conformance.install_sglang import REPO_ROOT, VERSIONS, SGLangSite
from tests.conformance.worker_client import type_tree, type_tree_of, unwrap

pytestmark = pytest.mark.sglang

BACKEND = SGLangBackend()
TP = 2  # one serialized entry per TP rank of a server
CPU = torch.device("cpu")
OLD, NEW = VERSIONS  # 0.5.10.post1 (no session routes), 0.5.23
PROBE_TIMEOUT_S = 300.0
TENSOR_ROUTE = "/update_weights_from_tensor"
SESSION_ROUTES = ("/begin_weight_update", "/end_weight_update")
REQUEST_MODELS = {
    TENSOR_ROUTE: "UpdateWeightsFromTensorReqInput",
    "/begin_weight_update": "BeginWeightUpdateReqInput",
    "/end_weight_update": "EndWeightUpdateReqInput",
}
# the fields of UpdateWeightsFromTensorReqInput our client sends and the embedded server reads
FIELDS_WE_USE = (
    "serialized_named_tensors",
    "load_format",
    "flush_cache",
    "abort_all_requests",
    "weight_version",
)
FAKE_GPU_UUID = "GPU-3f0c2a1e-5b7d-4c9e-8a6f-0123456789ab"
# rebuild_cuda_tensor's parameters, in order: the device is the 7th (index 6)
REBUILD_CUDA_PARAMS = (
    "tensor_cls",
    "tensor_size",
    "tensor_stride",
    "tensor_offset",
    "storage_cls",
    "dtype",
    "storage_device",
    "storage_handle",
    "storage_size_bytes",
    "storage_offset_bytes",
    "requires_grad",
    "ref_counter_handle",
    "ref_counter_offset",
    "event_handle",
    "event_sync_required",
)
DEVICE_ARG = REBUILD_CUDA_PARAMS.index("storage_device")
REBUILD_CUDA = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")


def rank_tensors(rank: int) -> list[tuple[str, torch.Tensor]]:
    """One TP rank's bucket: every dtype family, odd byte sizes (padding), 0-d and 3-d."""
    g = torch.Generator().manual_seed(1000 + rank)
    return [
        ("model.embed_tokens.weight", torch.randn(5, 3, generator=g)),
        ("model.layers.0.self_attn.qkv_proj.weight", torch.randn(6, 4, generator=g).bfloat16()),
        ("model.layers.0.mlp.down_proj.weight", torch.randn(3, 5, generator=g).half()),
        ("model.norm.weight", torch.randn(7, generator=g, dtype=torch.float64)),
        (
            "model.layers.0.mlp.gate.e_score_correction_bias",
            torch.randint(-9, 9, (3,), generator=g),
        ),
        ("model.layers.0.attn_mask", torch.rand(3, generator=g) > 0.5),
        ("model.logit_scale", torch.tensor(0.5 + rank)),
        ("lm_head.weight", torch.randn(2, 3, 4, generator=g)),
    ]


# --- what the sender emits, seen on this side ---------------------------------------------


class _GlobalsRecorder(pickle.Unpickler):
    """Unpickles a payload, recording every global it names; ``rebuild_cuda_tensor`` is not
    called (no GPU) but returns its arguments."""

    def __init__(self, payload: str):
        super().__init__(io.BytesIO(base64.b64decode(payload)))
        self.globals: list[tuple[str, str]] = []

    def find_class(self, module: str, name: str) -> Any:
        self.globals.append((module, name))
        if (module, name) == REBUILD_CUDA:
            return lambda *args: args
        return super().find_class(module, name)


def globals_of(payload: str) -> tuple[list[tuple[str, str]], Any]:
    recorder = _GlobalsRecorder(payload)
    data = recorder.load()
    return sorted(set(recorder.globals)), data


def _cuda_branch_of_reduce_tensor(tensor: torch.Tensor):
    """torch's ``reduce_tensor`` for a tensor on GPU 0 (its CUDA branch, with stand-in IPC
    handles): the same rebuild function and the same arguments, built the same way."""
    storage = tensor._typed_storage()
    return reductions.rebuild_cuda_tensor, (
        type(tensor),
        tensor.size(),
        tensor.stride(),
        tensor.storage_offset(),
        type(storage),
        tensor.dtype,
        0,  # storage._share_cuda_()'s device: an index
        b"cuda-ipc-mem-handle",
        tensor.untyped_storage().nbytes(),
        0,
        tensor.requires_grad,
        b"ref-counter-handle",
        0,
        b"cuda-ipc-event-handle",
        True,
    )


def _device_properties(device: int) -> types.SimpleNamespace:
    assert device == 0, device
    return types.SimpleNamespace(uuid=FAKE_GPU_UUID)


def cuda_payload(named: list[tuple[str, torch.Tensor]]) -> str:
    """``serialize`` of a flattened bucket as our sender pickles it on GPU 0."""
    bucket = flatten_bucket(named, torch.device("cpu"))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(reductions, "reduce_tensor", _cuda_branch_of_reduce_tensor)
        patch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
        patch.setattr(torch.cuda, "get_device_properties", _device_properties)
        return serialize(bucket)


def _evil_pickle(module: str, marker: Path) -> str:
    """A protocol-0 pickle that calls ``<module>.system("touch <marker>")`` when loaded."""
    raw = f"c{module}\nsystem\n(S'touch {marker}'\ntR.".encode()
    return base64.b64encode(raw).decode("ascii")


@dataclasses.dataclass
class Sent:
    named: list[list[tuple[str, torch.Tensor]]]  # per TP rank
    # per version, label -> {"endpoint", "payload"}: a file_system payload is read once
    # (each unpickling drops the reference its pickling took), so each version gets its own
    bodies: dict[str, dict[str, dict[str, Any]]]
    by_value: list[str]
    cuda: str
    cuda_globals: list[tuple[str, str]]
    cuda_data: Any
    cpu_globals: list[tuple[str, str]]
    by_value_globals: list[tuple[str, str]]
    evil: dict[str, str]
    markers: dict[str, str]


def session_bodies(shared: SharedBuckets, named: list[list[tuple[str, torch.Tensor]]]) -> dict:
    """What a rollout worker sends one server for a two-bucket update (each bucket: one
    serialized entry per TP rank; flush_cache and weight_version on the last)."""
    requests = {"begin": BACKEND.begin_weight_update_request()}
    for label, last in (("first-bucket", False), ("last-bucket", True)):
        payloads = [shared.share(tensors, torch.device("cpu")) for tensors in named]
        requests[label] = BACKEND.build_tensor_weight_update_request(
            payloads, flush_cache=last, weight_version="7" if last else None
        )
    requests["end"] = BACKEND.end_weight_update_request()
    return {k: {"endpoint": r.endpoint, "payload": r.payload} for k, r in requests.items()}


@pytest.fixture(scope="module")
def sent(tmp_path_factory: pytest.TempPathFactory):
    strategy = torch.multiprocessing.get_sharing_strategy()
    shared = SharedBuckets()  # alive until the probes have read the payloads
    named = [rank_tensors(rank) for rank in range(TP)]
    bodies = {version: session_bodies(shared, named) for version in VERSIONS}
    by_value = []
    for tensors in named:
        bucket = flatten_bucket(tensors, torch.device("cpu"))
        bucket["flattened_tensor"] = bucket["flattened_tensor"].clone()  # private memory
        by_value.append(base64.b64encode(pickle.dumps(bucket)).decode("ascii"))
    cuda = cuda_payload(named[0])
    cuda_globals, cuda_data = globals_of(cuda)
    cpu_globals = sorted({g for t in named for g in globals_of(shared.share(t, CPU))[0]})
    marker_dir = tmp_path_factory.mktemp("awex-evil")
    markers = {m: str(marker_dir / f"{m}-ran") for m in ("os", "posix")}
    evil = {m: _evil_pickle(m, Path(path)) for m, path in markers.items()}
    by_value_globals = sorted({g for payload in by_value for g in globals_of(payload)[0]})
    yield Sent(
        named,
        bodies,
        by_value,
        cuda,
        cuda_globals,
        cuda_data,
        cpu_globals,
        by_value_globals,
        evil,
        markers,
    )
    shared.release()
    torch.multiprocessing.set_sharing_strategy(strategy)


# --- the probe: one process per SGLang version --------------------------------------------


@pytest.fixture(scope="module")
def probes(sglang_sites: dict[str, SGLangSite], sent: Sent, tmp_path_factory) -> dict[str, Any]:
    """Every version's probe answer (the probes run concurrently, one round trip each)."""
    work = tmp_path_factory.mktemp("awex-probes")
    common = {
        "tp_size": TP,
        "by_value": sent.by_value,
        "cuda": sent.cuda,
        "cuda_uuid": FAKE_GPU_UUID,
        "globals": {
            "cuda": sent.cuda_globals,
            "cpu": sent.cpu_globals,
            "by_value": sent.by_value_globals,
        },
        "evil": sent.evil,
        "markers": sent.markers,
    }
    running = {}
    for version, site in sglang_sites.items():
        request = work / f"request-{version}.json"
        request.write_text(json.dumps(common | {"bodies": sent.bodies[version]}))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*map(str, site.paths), str(REPO_ROOT)])
        env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONWARNINGS="ignore")
        log = (work / f"probe-{version}.log").open("w")
        code = "from tests.conformance.test_awex_conformance import probe_main; probe_main()"
        process = subprocess.Popen(
            [sys.executable, "-P", "-c", code, str(request), str(work / version)],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            env=env,
        )
        running[version] = (process, log)
    answers = {}
    for version, (process, log) in running.items():
        try:
            process.wait(timeout=PROBE_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
        result = work / version
        tail = (work / f"probe-{version}.log").read_text(errors="replace")[-4000:]
        if not result.exists():
            pytest.fail(f"sglang {version} probe gave no answer ({process.returncode}):\n{tail}")
        answer = json.loads(result.read_text())
        if not answer["ok"]:
            pytest.fail(f"sglang {version} probe failed:\n{answer['error']}\n{tail}")
        answers[version] = answer["result"]
    return answers


def probe_main() -> None:
    """Entry of the probe process (SGLang's version first on ``sys.path``)."""
    request_path, result_path = sys.argv[1:3]
    try:
        result = {"ok": True, "result": _probe(json.loads(Path(request_path).read_text()))}
    except BaseException:
        result = {"ok": False, "error": traceback.format_exc()[-6000:]}
    Path(result_path).write_text(json.dumps(result))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # skip interpreter teardown, which takes seconds after SGLang


def _probe(request: dict[str, Any]) -> dict[str, Any]:
    # first: SGLang's app behind the tier's stub tokenizer manager (it stubs torchvision's
    # fake kernels before SGLang imports torchvision)
    worker = importlib.import_module("tests.conformance.sglang_worker")
    import msgspec
    from sglang.srt.managers import io_struct
    from sglang.srt.utils import common, patch_torch
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    parsed: list[tuple[str, Any]] = []

    def recording(method: str):
        async def handler(obj: Any, request: Any = None) -> tuple[bool, str]:
            parsed.append((method, obj))
            return True, "recorded"

        return handler

    for method in ("update_weights_from_tensor", "begin_weight_update", "end_weight_update"):
        setattr(worker._MANAGER, method, recording(method))

    def fields(obj: Any) -> dict[str, Any]:
        out = {}
        for name, value in worker.fields_of(obj).items():
            if name == "serialized_named_tensors":  # bytes (0.5.23) or str: keep them exact
                raw = getattr(obj, name)
                value = [
                    {"type": type(e).__name__, "b64": e if isinstance(e, str) else _b64(e)}
                    for e in raw
                ]
            out[name] = value
        return out

    def load_like_sglang(obj: Any, tp_rank: int) -> dict[str, Any]:
        """What one TP rank's scheduler does with the parsed request."""
        payloads = list(obj.serialized_named_tensors)
        normalize = getattr(common, "normalize_serialized_named_tensor_payloads", None)
        if normalize is not None:  # 0.5.23's tokenizer manager, before the scheduler
            payloads = normalize(payloads)
        patch_torch.monkey_patch_torch_reductions()  # the tp worker's, before deserializing
        data = common.MultiprocessingSerializer.deserialize(payloads[tp_rank])
        model = worker._RecordingModel()
        runner = worker._weight_update_runner(tp_rank, model)
        if isinstance(runner, worker._BoundMethods):  # 0.5.10.post1: ModelRunner's method
            ok, message = runner.update_weights_from_tensor(
                named_tensors=data, load_format=obj.load_format
            )
        else:  # 0.5.23: the branch WeightUpdater.update_weights_from_tensor takes for it
            assert obj.load_format == "flattened_bucket", obj.load_format
            ok, message = runner._update_weights_from_flattened_bucket(
                flattened_tensor_bucket_dict=data
            )
        own = FlattenedTensorBucket(named_tensors=[(n, t.clone()) for n, t in model.loaded])
        return {
            "ok": ok,
            "message": message,
            "payload": {
                "type": type(data).__name__,
                "keys": sorted(data) if isinstance(data, dict) else None,
                "record_types": sorted({type(m).__name__ for m in data["metadata"]}),
            },
            "loaded": [_tensor_json(n, t) for n, t in model.loaded],
            "sglang_numel": {m.name: m.numel for m in own.get_metadata()},
        }

    out: dict[str, Any] = {"posts": {}, "loaded": {}}
    paths = {TENSOR_ROUTE, *SESSION_ROUTES}
    out["routes"] = {
        route.path: sorted(route.methods)
        for route in worker.http_server.app.routes
        if getattr(route, "path", None) in paths
    }
    out["models"] = {
        name: _model_fields(getattr(io_struct, name), msgspec)
        for name in REQUEST_MODELS.values()
        if hasattr(io_struct, name)
    }
    for label, body in request["bodies"].items():
        parsed.clear()
        response = worker._CLIENT.post(body["endpoint"], json=body["payload"])
        calls = [
            {"method": method, "class": type(obj).__name__, "fields": fields(obj)}
            for method, obj in parsed
        ]
        out["posts"][label] = {"status": response.status_code, "text": response.text[:2000]}
        out["posts"][label]["calls"] = calls
        if body["endpoint"] == TENSOR_ROUTE and len(parsed) == 1:
            obj = parsed[0][1]
            out["loaded"][label] = [load_like_sglang(obj, r) for r in range(request["tp_size"])]

    # the same bucket pickled by value
    out["by_value"] = []
    for payload in request["by_value"]:
        data = common.MultiprocessingSerializer.deserialize(payload)
        bucket = FlattenedTensorBucket(
            flattened_tensor=data["flattened_tensor"], metadata=data["metadata"]
        )
        out["by_value"].append([_tensor_json(n, t) for n, t in bucket.reconstruct_tensors()])

    # the globals our payloads name, through this version's unpickler
    allowlist = getattr(common.SafeUnpickler, "ALLOWED_GLOBALS", None)
    out["allowlist_kind"] = "exact" if allowlist is not None else "module prefixes"
    out["globals"] = {}
    for kind, names in request["globals"].items():
        out["globals"][kind] = []
        for module, name in names:
            entry: dict[str, Any] = {"global": f"{module}.{name}"}
            if allowlist is not None:
                entry["on_allowlist"] = (module, name) in allowlist
            try:
                value = common.SafeUnpickler(io.BytesIO(b"")).find_class(module, name)
            except Exception as error:
                entry["admitted"] = False
                entry["error"] = f"{type(error).__name__}: {error}"
            else:
                entry["admitted"] = True
                entry["resolved"] = _qualified(value)
            out["globals"][kind].append(entry)

    # a CUDA payload: its UUID at index 6 reaches SGLang's _device_from_maybe_uuid
    patch_torch.monkey_patch_torch_reductions()
    reached: list[Any] = []

    class ReachedError(Exception):
        pass

    def device_from_maybe_uuid(device: Any) -> int:
        reached.append(device)
        raise ReachedError

    original = patch_torch._device_from_maybe_uuid
    patch_torch._device_from_maybe_uuid = device_from_maybe_uuid
    try:
        common.MultiprocessingSerializer.deserialize(request["cuda"])
        outcome = "loaded"
    except ReachedError:
        outcome = "reached _device_from_maybe_uuid"
    finally:
        patch_torch._device_from_maybe_uuid = original
    try:  # unstubbed: this host has no GPU of that UUID
        common.MultiprocessingSerializer.deserialize(request["cuda"])
        unstubbed = "loaded"
    except Exception as error:
        unstubbed = f"{type(error).__name__}: {error}"
    out["cuda"] = {
        "outcome": outcome,
        "reached": reached,
        "unstubbed": unstubbed,
        "gpus": torch.cuda.device_count(),
        "rebuild_cuda_tensor_resolves_to": _qualified(
            common.SafeUnpickler(io.BytesIO(b"")).find_class(*REBUILD_CUDA)
        ),
    }

    # a pickle that would run a command
    out["evil"] = {}
    for module, payload in request["evil"].items():
        try:
            common.MultiprocessingSerializer.deserialize(payload)
            refusal = None
        except Exception as error:
            refusal = f"{type(error).__name__}: {error}"
        ran = os.path.exists(request["markers"][module])
        out["evil"][module] = {"refusal": refusal, "ran": ran}
    return out


def _b64(raw: bytes) -> str:
    return base64.b64encode(bytes(raw)).decode("ascii")


def _tensor_json(name: str, tensor: torch.Tensor) -> list[Any]:
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return [name, str(tensor.dtype), list(tensor.shape), _b64(raw)]


def _qualified(value: Any) -> str:
    module = getattr(value, "__module__", None)
    qualname = getattr(value, "__qualname__", None)
    return f"{module}.{qualname}" if module and qualname else repr(value)


def _model_fields(cls: type, msgspec: Any) -> dict[str, dict[str, Any]]:
    """Each field of an SGLang request model: required, and its default (JSON)."""
    from tests.conformance.sglang_worker import jsonable

    out = {}
    if dataclasses.is_dataclass(cls):  # 0.5.10.post1
        for field in dataclasses.fields(cls):
            required = (
                field.default is dataclasses.MISSING
                and field.default_factory is dataclasses.MISSING
            )
            default = None if field.default is dataclasses.MISSING else field.default
            out[field.name] = {"required": required, "default": jsonable(default)}
    else:  # 0.5.23: msgspec Structs
        for field in msgspec.structs.fields(cls):
            default = None if field.default is msgspec.NODEFAULT else field.default
            out[field.name] = {"required": field.required, "default": jsonable(default)}
    return out


# --- what each version's HTTP layer parsed ------------------------------------------------


def tensors_of(entries: list[list[Any]]) -> list[tuple[str, torch.Tensor]]:
    out = []
    for name, dtype, shape, b64 in entries:
        dtype = getattr(torch, dtype.removeprefix("torch."))
        raw = bytearray(base64.b64decode(b64))
        flat = (
            torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
        )
        out.append((name, flat.view(dtype).reshape(shape)))
    return out


def assert_same_tensors(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]):
    assert [n for n, _ in got] == [n for n, _ in want]
    for (name, a), (_, b) in zip(got, want, strict=True):
        assert a.dtype == b.dtype, name
        assert a.shape == b.shape, name
        assert torch.equal(a, b), name


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("label", ["first-bucket", "last-bucket"])
def test_tensor_update_body_parses_with_every_field_kept(
    probes: dict, sent: Sent, version: str, label: str
):
    answer = probes[version]
    body = sent.bodies[version][label]["payload"]
    post = answer["posts"][label]
    assert post["status"] == 200, post["text"]
    [call] = post["calls"]
    assert call["method"] == "update_weights_from_tensor"
    assert call["class"] == REQUEST_MODELS[TENSOR_ROUTE]
    model = answer["models"][REQUEST_MODELS[TENSOR_ROUTE]]
    parsed = call["fields"]
    for key, value in body.items():
        assert key in model, f"{call['class']} has no field {key!r}: SGLang would drop it"
        assert key in parsed, key
        if key == "serialized_named_tensors":  # 0.5.23's HTTP layer decodes the base64
            got = [base64.b64decode(entry["b64"]) for entry in parsed[key]]
            assert got == [base64.b64decode(entry) for entry in value]
        else:
            assert unwrap(parsed[key]) == value, key
            assert type_tree(parsed[key]) == type_tree_of(value), key
    assert body["load_format"] == "flattened_bucket"
    assert len(body["serialized_named_tensors"]) == TP
    if label == "last-bucket":
        assert (body["flush_cache"], body["weight_version"]) == (True, "7")
    else:
        assert body["flush_cache"] is False and "weight_version" not in body


@pytest.mark.parametrize("version", VERSIONS)
def test_routes_exist_as_post_where_the_version_has_them(probes: dict, sent: Sent, version: str):
    answer = probes[version]
    assert answer["routes"][TENSOR_ROUTE] == ["POST"]
    for label, endpoint in (("begin", "/begin_weight_update"), ("end", "/end_weight_update")):
        post = answer["posts"][label]
        if version == OLD:  # no session: a stock server answers 404, which the client skips
            assert endpoint not in answer["routes"]
            assert post["status"] == 404, post
            assert REQUEST_MODELS[endpoint] not in answer["models"]
            continue
        assert answer["routes"][endpoint] == ["POST"]
        assert post["status"] == 200, post["text"]
        [call] = post["calls"]
        assert call["method"] == endpoint.removeprefix("/")
        assert call["class"] == REQUEST_MODELS[endpoint]
        body = sent.bodies[version][label]["payload"]
        assert set(body) <= set(answer["models"][REQUEST_MODELS[endpoint]])
        if endpoint == "/begin_weight_update":  # {}: every runner, target and draft
            assert unwrap(call["fields"]["selector"]) == "all"


@pytest.mark.parametrize("version", VERSIONS)
def test_sglang_loads_exactly_our_tensors_per_tp_rank(probes: dict, sent: Sent, version: str):
    answer = probes[version]
    for label in ("first-bucket", "last-bucket"):
        ranks = answer["loaded"][label]
        assert len(ranks) == TP
        for rank, loaded in enumerate(ranks):
            assert loaded["ok"], loaded["message"]
            assert loaded["payload"] == {
                "type": "dict",
                "keys": ["flattened_tensor", "metadata"],
                "record_types": ["SimpleNamespace"],
            }
            assert_same_tensors(tensors_of(loaded["loaded"]), sent.named[rank])
            # a record's numel is its byte count, as in SGLang's own FlattenedTensorBucket
            records = flatten_bucket(sent.named[rank], CPU)["metadata"]
            assert {r.name: r.numel for r in records} == loaded["sglang_numel"]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_bucket_pickled_by_value_loads_the_same(probes: dict, sent: Sent, version: str):
    for rank, entries in enumerate(probes[version]["by_value"]):
        assert_same_tensors(tensors_of(entries), sent.named[rank])


def test_the_embedded_reader_reads_what_sglang_reads(sent: Sent):
    shared = SharedBuckets()
    try:
        for tensors in sent.named:
            got = read_named_tensors(shared.share(tensors, CPU), "flattened_bucket")
            assert_same_tensors([(n, t.clone()) for n, t in got], tensors)
    finally:
        shared.release()


# --- the globals a payload names ----------------------------------------------------------


def test_the_cuda_payload_names_what_torchs_cuda_branch_names(sent: Sent):
    """The stand-in reduces as torch's CUDA branch does, and our ``_reduce_tensor`` puts the
    device's UUID where ``rebuild_cuda_tensor`` takes its device."""
    params = tuple(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
    assert params == REBUILD_CUDA_PARAMS
    source = inspect.getsource(reductions.reduce_tensor)
    assert "rebuild_cuda_tensor," in source and "type(storage)," in source
    args = sent.cuda_data["flattened_tensor"]
    assert len(args) == len(REBUILD_CUDA_PARAMS)
    assert args[DEVICE_ARG] == FAKE_GPU_UUID
    assert args[0] is torch.Tensor
    assert args[4] is torch.storage.TypedStorage
    assert args[5] is torch.uint8
    dtypes = {("torch", str(t.dtype).removeprefix("torch.")) for _, t in sent.named[0]}
    assert set(sent.cuda_globals) == {
        REBUILD_CUDA,
        ("torch", "Tensor"),  # type(tensor)
        ("torch.storage", "TypedStorage"),  # type(tensor._typed_storage())
        ("torch", "uint8"),  # the flat tensor's dtype
        ("torch", "Size"),  # tensor.size(), and each record's shape
        ("types", "SimpleNamespace"),  # the records
        *dtypes,  # each record's dtype
    }


# torch.storage._load_from_bytes (a storage pickled by value) is not on 0.5.23's allowlist:
# its find_class swaps in a loader of its own (torch.load with weights_only)
SAFE_STORAGE_LOADER = {
    "torch.storage._load_from_bytes": "sglang.srt.utils.common._safe_load_torch_storage"
}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("kind", ["cuda", "cpu", "by_value"])
def test_every_global_a_payload_names_is_admitted(probes: dict, version: str, kind: str):
    """CUDA: what our sender names on GPUs (SGLang serves on GPUs only); CPU: the
    ``file_system`` payloads of this tier (0.5.23 admits ``rebuild_storage_filename`` too);
    by value: the plain-pickle form (``_rebuild_tensor_v2``, storages by bytes)."""
    answer = probes[version]
    entries = answer["globals"][kind]
    assert entries
    refused = [entry for entry in entries if not entry["admitted"]]
    assert not refused, refused
    if kind == "by_value":
        names = {entry["global"] for entry in entries}
        assert {"torch._utils._rebuild_tensor_v2", *SAFE_STORAGE_LOADER} <= names
    if version == NEW:
        assert answer["allowlist_kind"] == "exact"
        off = {e["global"]: e["resolved"] for e in entries if not e["on_allowlist"]}
        expected_off = SAFE_STORAGE_LOADER if kind == "by_value" else {}
        assert off == expected_off, f"not on 0.5.23's SafeUnpickler.ALLOWED_GLOBALS: {off}"


@pytest.mark.parametrize("version", VERSIONS)
def test_the_device_uuid_reaches_sglangs_device_mapping(probes: dict, version: str):
    cuda = probes[version]["cuda"]
    resolved = "sglang.srt.utils.patch_torch._rebuild_cuda_tensor_modified"
    assert cuda["rebuild_cuda_tensor_resolves_to"] == resolved
    assert cuda["outcome"] == "reached _device_from_maybe_uuid"
    assert cuda["reached"] == [FAKE_GPU_UUID]
    assert cuda["gpus"] == 0
    assert cuda["unstubbed"] == f"Exception: Invalid device_uuid={FAKE_GPU_UUID}"


# --- a pickle that would run a command ----------------------------------------------------


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("module", ["os", "posix"])
def test_sglang_refuses_a_pickle_naming_os_system(
    probes: dict, sent: Sent, version: str, module: str
):
    evil = probes[version]["evil"][module]
    assert evil["refusal"] is not None and "Blocked unsafe" in evil["refusal"], evil
    assert f"{module}.system" in evil["refusal"]
    assert not evil["ran"]
    assert not Path(sent.markers[module]).exists()


@pytest.mark.parametrize("module", ["os", "posix"])
def test_the_embedded_reader_refuses_a_pickle_naming_os_system(sent: Sent, module: str):
    with pytest.raises(RequestError, match=rf"{module}\.system"):
        read_named_tensors(sent.evil[module], "flattened_bucket")
    assert not Path(sent.markers[module]).exists()


# --- the embedded server ------------------------------------------------------------------


def _pydantic_default(name: str) -> dict[str, Any]:
    field = TensorUpdateBody.model_fields[name]
    required = field.is_required()
    return {"required": required, "default": None if required else field.default}


@pytest.mark.parametrize("version", VERSIONS)
def test_tensor_update_body_has_sglangs_names_and_defaults(probes: dict, version: str):
    sglang = probes[version]["models"][REQUEST_MODELS[TENSOR_ROUTE]]
    for name in FIELDS_WE_USE:
        assert name in sglang, f"SGLang {version} has no {name}"
        assert name in TensorUpdateBody.model_fields, f"TensorUpdateBody has no {name}"
        ours = _pydantic_default(name)
        theirs = {"required": sglang[name]["required"], "default": unwrap(sglang[name]["default"])}
        assert ours == theirs, name


def test_the_embedded_server_serves_the_session_and_tensor_routes_as_sglang(probes: dict):
    from areal.inference.server import create_app

    app = create_app(engine=None)  # routes only: nothing is served
    ours = {
        route.path: sorted(route.methods)
        for route in app.routes
        if getattr(route, "path", None) in {TENSOR_ROUTE, *SESSION_ROUTES}
    }
    assert ours == probes[NEW]["routes"]


def test_the_embedded_server_reads_every_global_a_cuda_payload_names(sent: Sent):
    """The embedded server's reader resolves each global our sender emits for a CUDA
    tensor (its storage travels as ``torch.storage.TypedStorage``), as SGLang 0.5.23's
    allowlist does; nothing else is needed to open a CUDA IPC payload."""
    from areal.inference.tensor_payloads import _Unpickler

    assert sent.cuda_globals
    assert [g for g in sent.cuda_globals if g not in _Unpickler.allowed] == []
