"""Ling 3 (``bailing_hybrid``) on CUDA: our KDA paths against flash-linear-attention's kernels.

Three agreements, each printed so the run's output shows the figures:

* the packed KDA recurrence: :func:`areal.engine.kda.chunked_kda` (plain torch, used by the
  Megatron bridge) and :func:`areal.models.bailing_packed.packed_kda_forward` (the FSDP
  path) against ``fla.ops.kda.chunk_kda`` with ``cu_seqlens`` over three sequences;
* transformers' ``BailingHybridForCausalLM`` log-probs with fla's kernels against its own
  torch fallback (transformers picks fla when it imports the model module, so the test swaps
  the module's kernel functions back to the torch functions they wrap);
* the FSDP engine's packed log-probs against the model run one sequence at a time.

bf16 comparisons measure a noise floor first: the bf16 torch path against an fp32
reference. A fast path may sit somewhat further from that reference than the floor (bf16
keeps 8 mantissa bits; kernels round at other places), not an order of magnitude further.
Without ``fla`` the tests skip; without CUDA the suite's GPU skip fires first.

The tiny model here is the CPU tests' fixture with the KDA heads of the ~1B bench shape (16
heads of dimension 64; fla is mostly run at head dimensions 64 and 128). With the CPU
fixture's 4 heads of 16 the FSDP engine's varlen fla call failed on an H100 (Triton's
``PassManager::run failed`` while autotuning) and the Megatron bridge run exited 1, its
traceback lost; transformers' non-varlen call at that size passed. The kernels these tests
compile and autotune are now also those ``bench/train_engine.py --shape ling3-1b`` needs
(Triton caches them on disk).

With ``BAILING_GPU_RESULTS`` set each test appends its figures to that file (one JSON object
a line); ``BAILING_GPU_LOG_DIR`` keeps the Megatron workers' whole logs.
"""

from __future__ import annotations

import importlib.util
import inspect
import itertools
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from areal.engine import kda
from areal.engine.kda import chunked_kda, kda_forget_gate
from areal.engine.logprobs import logprobs_from_logits
from areal.models import bailing_packed
from areal.utils.tiny_bailing import TINY_BAILING_SHAPE, build_bailing_model

pytestmark = pytest.mark.gpu

needs_fla = pytest.mark.skipif(
    importlib.util.find_spec("fla") is None, reason="flash-linear-attention is not installed"
)

# Three packed sequences, none a multiple of the 64-token chunk, the longest 19 chunks.
LENGTHS = [100, 517, 1200]
HEADS, HEAD_DIM = 16, 64
# the tiny model with the KDA heads above (MLA heads follow num_attention_heads too)
GPU_BAILING_SHAPE = {
    **TINY_BAILING_SHAPE,
    "num_attention_heads": HEADS,
    "num_key_value_heads": HEADS,
    "head_dim": HEAD_DIM,
}


def _record(test: str, **figures) -> None:
    """Append ``figures`` of ``test`` to ``$BAILING_GPU_RESULTS`` (JSON lines), if set."""
    path = os.environ.get("BAILING_GPU_RESULTS")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **figures}, default=str) + "\n")


def _cu_seqlens(lengths: list[int]) -> torch.Tensor:
    return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.long, device="cuda")


def _rel_max(a: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest absolute difference, relative to the reference's largest magnitude."""
    return ((a.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.fixture(scope="module")
def bailing_dir(tmp_path_factory) -> Path:
    return build_bailing_model(tmp_path_factory.mktemp("tiny-bailing"), GPU_BAILING_SHAPE)


# --- the KDA recurrence alone ---


def _kda_inputs(dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """``q``, ``k``, ``v``, log decay ``g`` ``[T, H, D]`` and ``beta`` ``[T, H]`` in ``dtype``."""
    g = torch.Generator(device="cuda").manual_seed(0)
    n = sum(LENGTHS)
    q, k, v, gate_in = (
        torch.randn(n, HEADS, HEAD_DIM, device="cuda", generator=g) for _ in range(4)
    )
    a_log = torch.randn(HEADS, device="cuda", generator=g) * 0.5
    dt_bias = torch.randn(HEADS, HEAD_DIM, device="cuda", generator=g) * 0.1
    decay = kda_forget_gate(gate_in, a_log, dt_bias, safe_gate=True, lower_bound=-5.0)
    beta = torch.rand(n, HEADS, device="cuda", generator=g)
    return tuple(t.to(dtype) for t in (q, k, v, decay, beta))


def _fla_kda(q, k, v, decay, beta, cu_seqlens) -> torch.Tensor:
    """fla's varlen ``chunk_kda`` as both engines call it: :func:`kda.kda_delta_rule` on CUDA
    (contiguous ``q``, ``k``, ``v``, ``beta`` of one dtype, float32 ``g``)."""
    assert q.is_cuda and kda.fla_available()
    return kda.kda_delta_rule(q, k, v, decay, beta, cu_seqlens)


@needs_fla
@pytest.mark.parametrize(("dtype", "bound"), [(torch.float32, 5e-3), (torch.bfloat16, 2e-2)])
def test_chunked_kda_matches_fla_chunk_kda(dtype, bound):
    inputs = _kda_inputs(dtype)
    cu = _cu_seqlens(LENGTHS)
    ours = chunked_kda(*inputs, cu)  # float32 maths whatever the input dtype
    fla = _fla_kda(*inputs, cu)
    reference = chunked_kda(*(t.float() for t in inputs), cu)
    diff = (ours - fla.float()).abs().max().item()
    rel = _rel_max(fla, ours)
    print(
        f"\nchunked_kda vs fla chunk_kda, {dtype}, lengths {LENGTHS}: max |diff| {diff:.3e} "
        f"(relative to max |out| {rel:.3e}); ours vs fp32 inputs {_rel_max(ours, reference):.3e}"
    )
    _record(f"chunked_kda_vs_fla[{dtype}]", max_abs_diff=diff, relative=rel, bound=bound)
    assert torch.isfinite(fla).all()
    assert rel < bound
    # each sequence starts from a zero state: its first tokens agree as closely as any
    for start in cu[:-1].tolist():
        assert _rel_max(fla[start : start + 8], ours[start : start + 8]) < bound


def _kda_layer(bailing_dir: Path, dtype: torch.dtype) -> torch.nn.Module:
    """Layer 0 of the tiny model (a ``BailingHybridDeltaAttention``), on CUDA in ``dtype``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bailing_dir, dtype=dtype, use_kernels=False)
    layer = model.model.layers[0].self_attn
    assert type(layer).__name__ == "BailingHybridDeltaAttention"
    return layer.cuda().eval()


@needs_fla
@pytest.mark.parametrize(("dtype", "bound"), [(torch.float32, 5e-3), (torch.bfloat16, 3e-2)])
def test_packed_kda_forward_fla_matches_torch_path(bailing_dir, dtype, bound, monkeypatch):
    """On CUDA ``packed_kda_forward`` runs fla's ``chunk_kda``; forcing the torch recurrence
    (``kda.fla_available`` off) must give the same layer output."""
    layer = _kda_layer(bailing_dir, dtype)
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, sum(LENGTHS), layer.hidden_size, device="cuda", generator=g).to(dtype)
    cu = _cu_seqlens(LENGTHS)
    with torch.no_grad():
        fla = bailing_packed.packed_kda_forward(layer, x, cu)
        monkeypatch.setattr(kda, "fla_available", lambda: False)
        torch_path = bailing_packed.packed_kda_forward(layer, x, cu)
        # fp32 reference: the same layer and input in float32, torch path
        reference = bailing_packed.packed_kda_forward(layer.float(), x.float(), cu)
    rel, floor = _rel_max(fla, reference), _rel_max(torch_path, reference)
    print(
        f"\npacked_kda_forward fla vs torch path, {dtype}: max |diff| "
        f"{(fla.float() - torch_path.float()).abs().max().item():.3e}; relative to fp32 "
        f"reference: fla {rel:.3e}, torch {floor:.3e}"
    )
    _record(
        f"packed_kda_forward[{dtype}]",
        fla_vs_torch=(fla.float() - torch_path.float()).abs().max().item(),
        fla_rel=rel,
        torch_rel=floor,
        bound=max(bound, 3 * floor),
    )
    assert fla.shape == x.shape and torch.isfinite(fla).all()
    assert rel < max(bound, 3 * floor)


# --- the whole HF model ---


KERNEL_ENTRY_POINTS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention",
                      "causal_conv1d_fn", "causal_conv1d_update")  # fmt: skip


def _closure_value(function: Callable, name: str):
    return function.__closure__[function.__code__.co_freevars.index(name)].cell_contents


def _fallback_wrapper(entry_point: Callable) -> Callable:
    """transformers' dispatching wrapper of one kernel entry point (it closes over the chosen
    ``implementation``; ``functools.wraps`` makes its ``__wrapped__`` the torch function).
    With the ``kernels`` package installed the entry point is a hub-kernel module whose
    ``forward`` closes over that wrapper as ``func``."""
    if isinstance(entry_point, torch.nn.Module):
        return _closure_value(type(entry_point).forward, "func")
    return entry_point


def _torch_references(module) -> dict[str, Callable]:
    """The module's fla/causal-conv1d entry points mapped to their torch fallbacks."""
    found = {
        name: inspect.unwrap(_fallback_wrapper(getattr(module, name)))
        for name in KERNEL_ENTRY_POINTS
    }
    for name, function in found.items():
        assert (function.__module__, function.__name__) == (module.__name__, name), function
    return found


def _sequence_logprobs(model, ids: list[torch.Tensor]) -> list[torch.Tensor]:
    with torch.no_grad():
        return [
            logprobs_from_logits(
                model(input_ids=s[None].cuda()).logits[0, :-1].float(), s[1:].cuda()
            )
            for s in ids
        ]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


@needs_fla
def test_hf_model_logprobs_with_fla_match_torch_fallback(bailing_dir, monkeypatch):
    from transformers import AutoModelForCausalLM
    from transformers.models.bailing_hybrid import modeling_bailing_hybrid as hf

    chosen = _closure_value(_fallback_wrapper(hf.chunk_kimi_delta_attention), "implementation")
    assert inspect.unwrap(chosen).__module__.startswith("fla"), f"transformers kept {chosen}"
    if os.environ.get(kda.FLA_AUTOTUNE_ENV) == "quick":  # transformers calls fla itself
        kda.limit_fla_autotuning()
    g = torch.Generator().manual_seed(2)
    ids = [torch.randint(3, 1000, (n,), generator=g) for n in LENGTHS]
    model = (
        AutoModelForCausalLM.from_pretrained(bailing_dir, dtype=torch.bfloat16, use_kernels=False)
        .cuda()
        .eval()
    )
    with_fla = _sequence_logprobs(model, ids)
    torch_only = _torch_references(hf)
    for name, function in torch_only.items():
        monkeypatch.setattr(hf, name, function)
    fallback = _sequence_logprobs(model, ids)
    reference = _sequence_logprobs(model.float(), ids)

    diff, err, floor = (_max_diff(with_fla, fallback), _max_diff(with_fla, reference),
                        _max_diff(fallback, reference))  # fmt: skip
    scale = max(r.abs().max().item() for r in reference)
    print(
        f"\nHF BailingHybridForCausalLM bf16 log-probs, lengths {LENGTHS} (max |logp| "
        f"{scale:.2f}): fla vs torch fallback max |diff| {diff:.3e}; vs fp32 torch: "
        f"fla {err:.3e}, torch bf16 {floor:.3e}"
    )
    _record(
        "hf_logprobs_fla_vs_torch",
        fla_vs_torch=diff,
        fla_vs_fp32=err,
        bf16_floor=floor,
        max_abs_logprob=scale,
        bound=max(2e-2 * scale, 3 * floor),
    )
    assert diff < max(2e-2 * scale, 3 * floor)


# --- the FSDP engine ---


def test_fsdp_engine_packed_logprobs_match_one_sequence_at_a_time(bailing_dir):
    """The engine's packed micro-batches (``enable_packed_sequences``; fla's varlen kernel
    where installed) against the HF model run on each sequence alone."""
    from transformers import AutoModelForCausalLM

    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig
    from areal.engine.fsdp_engine import FSDPEngine

    g = torch.Generator().manual_seed(3)
    width = max(LENGTHS)
    mask = torch.arange(width)[None] < torch.tensor(LENGTHS)[:, None]
    batch = {
        "input_ids": torch.randint(3, 1000, (len(LENGTHS), width), generator=g) * mask,
        "attention_mask": mask,
        "loss_mask": mask.long(),
    }
    rows = [batch["input_ids"][i, :n] for i, n in enumerate(LENGTHS)]
    model = (
        AutoModelForCausalLM.from_pretrained(bailing_dir, dtype=torch.float32, use_kernels=False)
        .cuda()
        .eval()
    )
    reference = _sequence_logprobs(model, rows)
    floor = _max_diff(_sequence_logprobs(model.bfloat16(), rows), reference)
    del model

    results = {}
    for mb_tokens in (1400, 4096):  # two packed streams, then one stream of all three
        engine = FSDPEngine(
            TrainEngineConfig(
                experiment_name="test",
                trial_name="bailing-gpu",
                path=str(bailing_dir),
                dtype="bfloat16",
                mb_spec=MicroBatchSpec(max_tokens_per_mb=mb_tokens),
                optimizer=OptimizerConfig(lr=1e-5, warmup_steps_proportion=0.0),
            )
        )
        engine.create_process_group()
        engine.initialize()
        try:
            got = engine.forward_batch(batch).float().cpu()
        finally:
            engine.destroy()
        # row i's log-prob at position t is of token t + 1; the last real one predicts nothing
        packed = [got[i, : n - 1] for i, n in enumerate(LENGTHS)]
        results[mb_tokens] = _max_diff(packed, [r.cpu() for r in reference])
    print(
        f"\nFSDP engine bf16 packed log-probs vs fp32 one at a time, lengths {LENGTHS}: "
        f"max |diff| {results} (bf16 one-at-a-time floor {floor:.3e})"
    )
    _record(
        "fsdp_packed_logprobs",
        max_abs_diff_by_mb_tokens=results,
        bf16_floor=floor,
        bound=max(5e-2, 3 * floor),
        fla_path=kda.fla_available(),
    )
    for err in results.values():
        assert err < max(5e-2, 3 * floor)


# --- the Megatron bridge ---


def _megatron_worker(model: Path, out: Path, *extra: str) -> dict:
    """One single-GPU ``megatron:d1`` run of :mod:`tests.gpu.megatron_worker` on ``LENGTHS``:
    log-probs, one Adam step, log-probs again.

    The worker's whole output goes to a log file (``$BAILING_GPU_LOG_DIR`` or beside
    ``out``), its last lines are echoed here; a failure raises with them, so the
    traceback is in the test report however the run's output is cut. The worker dumps its
    stacks and exits if it runs past ``$BAILING_GPU_WORKER_TIMEOUT`` (default 400 s).
    """
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    limit = float(os.environ.get("BAILING_GPU_WORKER_TIMEOUT", "400"))
    env = {
        **os.environ,
        "PYTHONPATH": f"{repo}:{os.environ.get('PYTHONPATH', '')}",
        "PYTHONFAULTHANDLER": "1",
        "PYTHONUNBUFFERED": "1",
        "WORKER_TRACEBACK_AFTER": str(max(limit - 20, 10)),
    }
    log_dir = Path(os.environ.get("BAILING_GPU_LOG_DIR") or out.parent)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"megatron_worker_{out.stem}.log"
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
            "-m", "tests.gpu.megatron_worker", "--model", str(model), "--out", str(out),
            "--backend", "megatron:d1", "--mb-tokens", "4096",
            "--lengths", ",".join(map(str, LENGTHS)), *extra]  # fmt: skip
    with open(log, "w") as f:
        # same process group as pytest: a `timeout` around the run ends the workers too
        proc = subprocess.Popen(argv, cwd=repo, env=env, stdout=f, stderr=subprocess.STDOUT)
        try:
            status = f"exit status {proc.wait(timeout=limit)}"
        except subprocess.TimeoutExpired:
            proc.terminate()  # torchrun passes SIGTERM on to its worker and waits for it
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            status = f"killed after {limit:.0f} s"
    lines = log.read_text(errors="replace").splitlines()
    name = " ".join(extra) or "(fla)"
    tail = "\n".join(lines[-60:])
    print(f"\n--- megatron worker {name}: {status}; last lines of {log} ---\n{tail}")
    if status != "exit status 0" or not out.exists():
        raise RuntimeError(f"megatron worker {name}: {status}; log {log}, last lines:\n{tail}")
    return torch.load(out, weights_only=False)


@needs_fla
def test_megatron_bridge_with_fla_matches_torch_kda_and_hf(bailing_dir, tmp_path):
    """The bridge's KDA layers with fla's varlen kernel against the same engine with the torch
    recurrence (bf16 log-probs before and after one step), and against the HF model in fp32."""
    pytest.importorskip("megatron.core")
    pytest.importorskip("mbridge")
    from transformers import AutoModelForCausalLM

    # both runs even if one fails: the torch-KDA run tells a bridge fault from an fla one
    runs, errors = {}, {}
    for name, extra in (("fla", ()), ("torch", ("--kda-torch",))):
        try:
            runs[name] = _megatron_worker(bailing_dir, tmp_path / f"{name}.pt", *extra)
        except RuntimeError as e:
            errors[name] = str(e)
    if errors:
        _record(
            "megatron_bridge",
            failed_runs=sorted(errors),
            passed_runs=sorted(runs),
            errors={k: v[-3000:] for k, v in errors.items()},
        )
        pytest.fail("\n\n".join(errors.values()), pytrace=False)
    with_fla, torch_kda = runs["fla"], runs["torch"]
    batch = with_fla["batch"]
    rows = [batch["input_ids"][i, :n] for i, n in enumerate(LENGTHS)]
    model = (
        AutoModelForCausalLM.from_pretrained(bailing_dir, dtype=torch.float32, use_kernels=False)
        .cuda()
        .eval()
    )
    reference = [r.cpu() for r in _sequence_logprobs(model, rows)]
    del model

    def rows_of(logp: torch.Tensor) -> list[torch.Tensor]:
        return [logp[i, : n - 1].float() for i, n in enumerate(LENGTHS)]

    diffs = {
        "fla vs torch KDA, before the step": _max_diff(rows_of(with_fla["before"]),
                                                       rows_of(torch_kda["before"])),
        "fla vs torch KDA, after the step": _max_diff(rows_of(with_fla["after"]),
                                                      rows_of(torch_kda["after"])),
        "fla vs HF fp32": _max_diff(rows_of(with_fla["before"]), reference),
        "torch KDA vs HF fp32": _max_diff(rows_of(torch_kda["before"]), reference),
    }  # fmt: skip
    losses = (with_fla["stats"], torch_kda["stats"])
    print(f"\nMegatron bridge bf16 log-probs, lengths {LENGTHS}: {diffs}; step stats {losses}")
    floor = diffs["torch KDA vs HF fp32"]
    _record("megatron_bridge", **diffs, step_stats=losses, bound=max(5e-2, 3 * floor))
    assert diffs["fla vs torch KDA, before the step"] < max(5e-2, 3 * floor)
    assert diffs["fla vs torch KDA, after the step"] < max(5e-2, 3 * floor)
    assert diffs["fla vs HF fp32"] < max(5e-2, 3 * floor)
