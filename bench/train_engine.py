"""Training throughput: ``FSDPEngine.train_batch`` versus a plain HF + PyTorch loop.

Both train the same random Qwen2-0.5B-shaped model (``--shape qwen2-0.5b``, the default;
bf16 compute, fp32 master weights, AdamW) on the same sequences (lengths drawn uniformly
from --min-len..--max-len, a next-token loss on every token) for --steps timed optimizer
steps after a warm-up step:

* engine: sequences packed into varlen micro-batches of at most --engine-mb-tokens tokens,
  per-sequence attention, log-probs in chunks of --logprobs-chunk-size tokens (no
  full-vocabulary logits), FSDP2.
* plain loop: the same sequences in padded micro-batches of at most --mb-tokens real
  tokens, HF forward with an attention mask (SDPA), full-vocabulary fp32 logits and
  cross-entropy, bf16 autocast.

MFU = achieved FLOP/s / peak, FLOPs per step = 6 x P x T + 6 x layers x hidden x
sum(len^2), where P counts the matmul parameters (attention projections, MLP, and the
LM head, whose matmul runs even with tied embeddings) and T the tokens; the second term is
attention: QK^T and AV are 2 x len^2 x hidden FLOPs each, halved by the causal mask, and
x3 for forward plus backward. Peak: --peak-tflops (989 for H100/H200 dense bf16).

* engine+kernels: the same engine with ``use_kernels=True``: each decoder layer's forward
  and the per-chunk log-prob maths run as ``torch.compile`` (Inductor/Triton) kernels, so
  norms, rotary embedding, SwiGLU, residual adds and the softmax statistics fuse instead of
  running as one memory pass per op. Two warm-up steps (compilation) are not timed.
* megatron (``--engines fsdp,megatron``): the same packed micro-batches through
  ``MegatronEngine`` (megatron-core + mbridge, one GPU, distributed optimizer); with one
  tensor-parallel rank its log-probs are chunked like the engine's, so it takes the same
  micro-batch budget unless --megatron-mb-tokens says otherwise.

* megatron+kernels: the same with ``use_kernels=True``: the log-prob chunks and the packed
  rotary embedding run compiled, Megatron's own fused SwiGLU and bias-dropout-add
  (``bias_activation_fusion``, ``bias_dropout_fusion``: ``torch.compile`` functions of
  Megatron's) replace the unfused ones, and torch's AdamW runs its fused kernel.

``--profile`` adds one profiled step per engine column: kernel time by class (GEMM, flash
attention, compiled Triton kernels, other elementwise, ...) and the top kernels.

    python3 bench/train_engine.py                 # engine, engine+kernels, plain (GPU)
    python3 bench/train_engine.py --only engine+kernels --engine-mb-tokens 81920
    python3 bench/train_engine.py --engines fsdp,megatron --profile
    python3 bench/train_engine.py --engines fsdp,fsdp+kernels,megatron,megatron+kernels

``--shape ling3-1b``: a random Ling 3 (``BailingMoeV3ForCausalLM``) of about 1.2 B
parameters, 0.38 B of them active per token: hidden 1024, 16 layers in groups of 4 (three
KDA linear-attention layers, then one MLA layer), a dense first layer, then MoE layers of
32 routed experts (top 4, chosen in 2 of 4 groups) plus 1 shared expert, a 157184-token
vocabulary. The checkpoint carries the small Ling 3 test tokenizer; the bench only feeds
random ids below the model's vocabulary, so the mismatch is harmless. The plain loop does
not run for this shape (it measures the dense model). MFU counts active FLOPs only::

    FLOPs per step = 6 x A x T + sum over sequences of 3 x len^2 x mla_layers x heads x
                     (qk_nope + qk_rope + v_head) + 6 x T x kda_layers x heads x
                     (3 x d^2 + 64 x 3 x d)

where A counts the active matmul parameters (every weight of two or more dimensions but the
input embedding, the LM head included, each routed-expert tensor scaled by top-k / experts,
so only the experts a token is routed to count); the second term is causal MLA scores and
mixing (forward + backward); the third the KDA recurrence per token and head (d = head_dim):
the [d, d] state read, correction and update, and the 64-token intra-chunk products.

    python3 bench/train_engine.py --shape ling3-1b --engines fsdp,megatron --steps 2 \
        --sequences 8 --max-len 4096
    python3 bench/train_engine.py --shape ling3-1b --count-params   # CPU: build no weights

``--warmup N`` sets the untimed steps before the --steps timed ones (default 1, 2 with
``use_kernels``; the first step of the Ling 3 shape compiles and autotunes fla's Triton
kernels); every step's wall time is printed as it ends and kept in the results
(``warmup_step_s``, ``step_times_s``). ``--model-dir DIR`` builds the random checkpoint in
DIR once and reuses it in later runs (the ~1.2B Ling 3 checkpoint takes a while to write;
``--build-only`` just builds it, on CPU).
The longest sequence one GPU trains, one sequence a step, with the memory savers
(log-probs in chunks, activation checkpointing)::

    python3 bench/train_engine.py --only engine --gradient-checkpointing --sequences 1 \
        --min-len 65536 --max-len 65536 --engine-mb-tokens 65536 --steps 1
"""

from __future__ import annotations

import argparse
import faulthandler
import functools
import gc
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from areal.utils.table import render_table  # noqa: E402
from areal.utils.tiny_bailing import (  # noqa: E402
    TINY_BAILING_SHAPE,
    build_bailing_model,
    write_bailing_config,
)
from areal.utils.tiny_model import QWEN2_05B_SHAPE, build_tiny_model  # noqa: E402
from bench.gpu_idle import (  # noqa: E402
    GPU_CATEGORIES,
    attribute_idle,
    idle_profile,
    profiled_trace,
    step_window,
)

RESULTS = ROOT / "bench" / "results" / "train_engine.json"


def make_batch(n: int, min_len: int, max_len: int, vocab: int, seed: int) -> list[torch.Tensor]:
    rng = random.Random(seed)
    lengths = [rng.randint(min_len, max_len) for _ in range(n)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g) for length in lengths]


def padded(seqs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = True
    loss_mask = mask.clone()
    loss_mask[torch.arange(len(seqs)), mask.sum(1) - 1] = False  # the last token predicts nothing
    return {"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask.long()}


def flops_per_step(cfg, seqs: list[torch.Tensor]) -> float:
    """6 N T for the matmuls (LM head included) + causal attention scores and mixing."""
    h, layers, vocab = cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    kv = cfg.num_key_value_heads * (h // cfg.num_attention_heads)
    per_layer = h * h + 2 * h * kv + h * h + 3 * h * cfg.intermediate_size  # q, k+v, o, mlp
    dense = layers * per_layer + vocab * h  # the LM head matmul (tied or not)
    tokens = sum(len(s) for s in seqs)
    attention = sum(6 * layers * h * len(s) * len(s) for s in seqs)
    return 6.0 * dense * tokens + attention


# --- the Ling 3 shape ---

# config.json keys in the official spelling: the tiny test model's, scaled up
LING3_1B_SHAPE: dict = {
    **TINY_BAILING_SHAPE,
    "vocab_size": 157184,
    "hidden_size": 1024,
    "intermediate_size": 4096,  # the dense first layer
    "moe_intermediate_size": 512,
    "num_hidden_layers": 16,
    "layer_group_size": 4,  # layers 3, 7, 11, 15 MLA, the other 12 KDA
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "head_dim": 64,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32,
    "v_head_dim": 64,
    "num_experts": 32,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "max_position_embeddings": 32768,
}
KDA_CHUNK_FLOPS = 64  # the intra-chunk length that the KDA FLOP count assumes (fla's)


def ling3_meta_model(model_dir: Path) -> torch.nn.Module:
    """The model of ``model_dir/config.json`` on the meta device: shapes only, no memory."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))


def ling3_param_counts(model: torch.nn.Module) -> dict[str, int]:
    """Total parameters, and the active matmul parameters of one token (see the docstring)."""
    cfg = model.config
    routed = cfg.num_experts_per_tok / cfg.num_experts
    total = active = 0
    for name, p in model.named_parameters():
        total += p.numel()
        if p.dim() < 2 or name.endswith("embed_tokens.weight"):
            continue
        active += p.numel() * (routed if ".mlp.experts." in name else 1.0)
    return {"total_params": total, "active_params": int(active)}


def ling3_flops_per_step(model: torch.nn.Module, seqs: list[torch.Tensor]) -> float:
    """6 A T for the active matmuls + causal MLA attention + the KDA recurrence."""
    cfg = model.config
    kinds = [type(layer.self_attn).__name__ for layer in model.model.layers]
    kda_layers = sum(kind == "BailingHybridDeltaAttention" for kind in kinds)
    mla_layers = len(kinds) - kda_layers
    heads = cfg.num_attention_heads
    d = cfg.linear_head_dim
    tokens = sum(len(s) for s in seqs)
    active = ling3_param_counts(model)["active_params"]
    mla_dims = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim
    attention = sum(3 * len(s) * len(s) * mla_layers * heads * mla_dims for s in seqs)
    kda = 6 * tokens * kda_layers * heads * (3 * d * d + KDA_CHUNK_FLOPS * 3 * d)
    return 6.0 * active * tokens + attention + kda


KERNEL_CLASSES = (  # (label, substrings of CUDA kernel names), first match wins
    ("attention (flash)", ("flash",)),  # before GEMM: flash kernel names mention cutlass
    ("matmul (GEMM)", ("gemm", "nvjet", "cutlass", "xmma", "sm90_", "sm100_")),
    ("compiled (triton)", ("triton",)),
    ("optimizer", ("adam", "multi_tensor")),
    ("communication", ("nccl",)),
    ("reductions", ("reduce", "softmax", "logsumexp")),
    ("copies and casts", ("copy", "cat", "fill")),
)


def profile_step(step) -> dict:
    """One profiled ``step()``: GPU busy share, kernel time by class, top kernels.

    Kernel times come from the exported trace (each kernel's own start and end, as the
    GPU ran it); busy time is the union of those intervals, so the idle share is the
    wall time no kernel, copy or memset was running. (The ``FunctionEvent`` totals that
    ``prof.events()`` gives attribute only part of some kernels' time, which made an
    earlier version of this bench report the Megatron step about 35 % idle when its GPU
    was busy about 97 % of the step.)
    """
    prof, trace, wall = profiled_trace(step)
    idle = attribute_idle(trace, window=step_window(trace))
    kernels: dict[str, float] = {}
    for event in trace["traceEvents"]:
        if event.get("ph") == "X" and event.get("cat") in GPU_CATEGORIES:
            kernels[event["name"]] = kernels.get(event["name"], 0.0) + event["dur"] / 1e6
    classes: dict[str, float] = {}
    for name, seconds in kernels.items():
        label = next(
            (lab for lab, keys in KERNEL_CLASSES if any(k in name.lower() for k in keys)),
            "other elementwise",
        )
        classes[label] = classes.get(label, 0.0) + seconds
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:30]
    # host side: where the CPU spends its time, and how often it waits for the GPU
    host = [
        (e.key, e.self_cpu_time_total / 1e6, e.count)
        for e in prof.key_averages()
        if e.self_cpu_time_total > 0
    ]
    host.sort(key=lambda row: -row[1])
    syncs = {
        e.key: e.count
        for e in prof.key_averages()
        if any(k in e.key for k in ("Synchronize", "cudaMemcpy", "item", "_local_scalar_dense"))
    }
    return {
        "wall_s": wall,
        "gpu_busy_s": idle["busy_s"],
        "gpu_idle_share": idle["idle_s"] / idle["wall_s"],
        "kernel_launches": sum(1 for e in trace["traceEvents"] if e.get("cat") in GPU_CATEGORIES),
        "by_class_s": dict(sorted(classes.items(), key=lambda kv: -kv[1])),
        "top_kernels_s": [[name[:110], seconds] for name, seconds in top],
        "top_host_ops_s": [[name[:80], seconds, count] for name, seconds, count in host[:25]],
        "sync_points": syncs,
    }


def host_sync_sites(step, top: int = 10) -> list[list]:
    """Run ``step()`` once, counting the Python call sites that read a CUDA tensor's value
    on the host (``item``, ``tolist``, ``int``/``float``/``bool`` of a tensor): each waits
    for the GPU."""
    import collections
    import traceback

    counts: collections.Counter = collections.Counter()
    saved = {}

    def wrap(name):
        original = getattr(torch.Tensor, name)
        saved[name] = original

        def counted(self, *args, **kwargs):
            if self.is_cuda:
                frames = [
                    f"{Path(f.filename).name}:{f.lineno} {f.name}"
                    for f in traceback.extract_stack()[:-1]
                    if "/torch/" not in f.filename
                ]
                counts[" <- ".join(reversed(frames[-3:]))] += 1
            return original(self, *args, **kwargs)

        setattr(torch.Tensor, name, counted)

    for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__"):
        wrap(name)
    try:
        step()
        torch.cuda.synchronize()
    finally:
        for name, original in saved.items():
            setattr(torch.Tensor, name, original)
    return [[site, n] for site, n in counts.most_common(top)]


def print_profile(name: str, prof: dict) -> None:
    wall, idle = prof["wall_s"], prof["gpu_idle_share"]
    rows = [[label, seconds, f"{100 * seconds / wall:.1f}%"]
            for label, seconds in prof["by_class_s"].items()]  # fmt: skip
    rows.append(["GPU idle (no kernel running)", idle * wall, f"{100 * idle:.1f}%"])
    print(render_table(f"{name}: one profiled step, {wall:.3f} s", ["kernels", "s", "share"], rows))
    top = [[n, s, f"{100 * s / wall:.1f}%"] for n, s in prof["top_kernels_s"]]
    print(render_table(f"{name}: top kernels", ["kernel", "s", "share"], top))
    host = [[n, s, c] for n, s, c in prof.get("top_host_ops_s", [])]
    if host:
        title = f"{name}: top host ops (self CPU), {prof.get('kernel_launches', 0)} kernels"
        print(render_table(title, ["op", "s", "calls"], host))
    for site, count in prof.get("sync_sites", []):
        print(f"  {count:5d} host reads at {site}")
    idle = prof.get("idle")
    if idle:
        title = (
            f"{name}: GPU idle with Python stacks on, {idle['idle_s']:.3f} of {idle['wall_s']:.3f}"
            f" s ({idle['gaps']} gaps; {idle['host_bound_s']:.3f} s host-bound, "
            f"{idle['waiting_s']:.3f} s waiting)"
        )
        rows = [[site[:110], f"{1e3 * s:.2f}", n] for site, s, n in idle["sites"]]
        print(render_table(title, ["host was running", "idle ms", "gaps"], rows))
    if prof.get("sync_points"):
        rows = [[k[:80], v] for k, v in prof["sync_points"].items()]
        print(render_table(f"{name}: host waits and copies", ["call", "count"], rows))


def run_engine(
    model_dir: Path,
    seqs,
    mb_tokens: int,
    steps: int,
    lr: float,
    backend: str = "fsdp",
    use_kernels: bool = False,
    profile: bool = False,
    chunk_size: int = 8192,
    trace_to: str | None = None,
    gradient_checkpointing: bool = False,
    warmup: int | None = None,
) -> dict:
    from areal.api.cli_args import MicroBatchSpec, OptimizerConfig, TrainEngineConfig

    config = TrainEngineConfig(
        use_kernels=use_kernels,
        experiment_name="bench",
        trial_name="train-engine",
        path=str(model_dir),
        dtype="bfloat16",
        mb_spec=MicroBatchSpec(max_tokens_per_mb=mb_tokens),
        optimizer=OptimizerConfig(lr=lr, warmup_steps_proportion=0.0),
        logprobs_chunk_size=chunk_size,
        gradient_checkpointing=gradient_checkpointing,
    )
    if backend == "megatron":
        from areal.engine.megatron_engine import MegatronEngine

        engine = MegatronEngine(config)
    else:
        from areal.engine.fsdp_engine import FSDPEngine

        engine = FSDPEngine(config)
    engine.create_process_group()
    engine.initialize()
    batch = padded(seqs)

    def loss_fn(logp, entropy, mb):
        mask = mb["loss_mask"].bool()
        return -(logp * mask).sum() / mask.sum().clamp(min=1)

    def weight_fn(mb):
        return mb["loss_mask"].count_nonzero()

    times, warm, stats, losses = [], [], {}, []
    if warmup is None:
        warmup = 2 if use_kernels else 1  # compiled kernels: the first steps compile
    for step in range(steps + warmup):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        stats = engine.train_batch(batch, loss_fn, weight_fn)
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - begin
        losses.append(stats.get("loss"))
        # warm-up steps build (and autotune) kernels and fill allocators
        (times if step >= warmup else warm).append(elapsed)
        kind = "timed" if step >= warmup else "warm-up"
        print(f"[{backend}] {kind} step {step + 1}/{steps + warmup}: {elapsed:.2f} s, "
              f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)  # fmt: skip
    result = {
        "step_s": sum(times) / len(times),
        "step_times_s": times,
        "warmup_steps": warmup,
        "warmup_step_s": warm,
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gb": torch.cuda.max_memory_reserved() / 2**30,
        "micro_batches": stats.get("num_micro_batches"),
        "last_loss": stats.get("loss"),
        "losses": losses,  # every step's, warm-up included (same batch, same start)
    }
    if profile:
        result["profile"] = profile_step(lambda: engine.train_batch(batch, loss_fn, weight_fn))
        result["profile"]["sync_sites"] = host_sync_sites(
            lambda: engine.train_batch(batch, loss_fn, weight_fn)
        )
        result["profile"]["idle"] = idle_profile(
            lambda: engine.train_batch(batch, loss_fn, weight_fn), save_to=trace_to
        )
    engine.destroy()
    return result


def run_plain(model_dir: Path, seqs, mb_tokens: int, steps: int, lr: float) -> dict:
    from transformers import AutoModelForCausalLM

    from areal.utils.packing import ffd_allocate

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="sdpa", use_kernels=False
    ).cuda()
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=True)
    groups = ffd_allocate([len(s) for s in seqs], mb_tokens, 1)
    micro = [padded([seqs[i] for i in group]) for group in groups]
    total = sum(int(mb["loss_mask"].sum()) for mb in micro)
    times = []
    loss_value = 0.0
    for step in range(steps + 1):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss_value = 0.0
        for mb in micro:
            ids, mask = mb["input_ids"].cuda(), mb["attention_mask"].cuda()
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(input_ids=ids, attention_mask=mask).logits
            labels = ids[:, 1:].clone()
            labels[~mb["loss_mask"][:, :-1].bool().cuda()] = -100
            loss = torch.nn.functional.cross_entropy(
                logits[:, :-1].float().flatten(0, 1), labels.flatten(), reduction="sum"
            )
            (loss / total).backward()
            loss_value += float(loss.detach()) / total
            del logits, loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        torch.cuda.synchronize()
        if step:
            times.append(time.perf_counter() - begin)
    result = {
        "step_s": sum(times) / len(times),
        "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30,
        "micro_batches": len(micro),
        "last_loss": loss_value,
    }
    del model, optimizer
    gc.collect()
    torch.cuda.empty_cache()
    return result


SHAPES = {"qwen2-0.5b": "Qwen2-0.5B-shaped", "ling3-1b": "Ling-3-shaped ~1.2B MoE"}
BUILT_MARK = ".bench_built.json"  # written last: a directory without it is rebuilt


def prepare_model(args, scratch: Path) -> Path:
    """The random checkpoint of ``args.shape``: built in ``scratch``, or in ``--model-dir``
    and reused there by later runs of the same shape, seed and position limit."""
    positions = None
    if args.shape == "qwen2-0.5b":
        positions = max(
            QWEN2_05B_SHAPE["max_position_embeddings"],
            args.max_len,
            args.max_position_embeddings or 0,
        )
    want = {"shape": args.shape, "seed": args.seed, "max_position_embeddings": positions}
    model_dir = args.model_dir or scratch / "model"
    mark = model_dir / BUILT_MARK
    if args.model_dir is not None and mark.exists():
        try:
            if json.loads(mark.read_text()) == want:
                print(f"reusing the checkpoint in {model_dir}", flush=True)
                return model_dir
        except (OSError, ValueError):
            pass
        shutil.rmtree(model_dir)  # this bench's checkpoint of another shape or seed
    began = time.perf_counter()
    if args.shape == "ling3-1b":
        build_bailing_model(model_dir, LING3_1B_SHAPE, seed=args.seed)
    else:
        shape = {**QWEN2_05B_SHAPE, "max_position_embeddings": positions}
        build_tiny_model(model_dir, dtype="float32", seed=args.seed, **shape)
    mark.write_text(json.dumps(want) + "\n")
    print(f"built the {args.shape} checkpoint in {model_dir} "
          f"({time.perf_counter() - began:.1f} s)", flush=True)  # fmt: skip
    return model_dir


def print_param_counts(shape: str) -> None:
    """Total and active parameters of ``shape``, from a meta-device model (CPU, no weights)."""
    if shape == "qwen2-0.5b":
        raise SystemExit("--count-params: only for --shape ling3-1b")
    with tempfile.TemporaryDirectory() as tmp:
        write_bailing_config(Path(tmp), LING3_1B_SHAPE)
        counts = ling3_param_counts(ling3_meta_model(Path(tmp)))
    print(f"{shape}: {counts['total_params']:,} parameters, "
          f"{counts['active_params']:,} active matmul parameters per token")  # fmt: skip


def main() -> None:
    # SIGUSR1 prints every thread's stack (a step runner's timeout sends it before killing a
    # run, so a run that hangs says where)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape",
        choices=list(SHAPES),
        default="qwen2-0.5b",
        help="the random model: Qwen2-0.5B-shaped (dense) or a ~1.2B Ling 3 (KDA + MLA + MoE)",
    )
    parser.add_argument(
        "--count-params",
        action="store_true",
        help="print the shape's total and active parameter counts (no weights, runs on CPU) "
        "and exit",
    )
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--min-len", type=int, default=512)
    parser.add_argument("--max-len", type=int, default=8192)
    parser.add_argument(
        "--mb-tokens", type=int, default=16384, help="plain loop: real tokens per mb"
    )
    parser.add_argument(
        "--engine-mb-tokens",
        type=int,
        default=40960,
        help="engine: packed tokens per micro-batch (no padding waste)",
    )
    parser.add_argument(
        "--megatron-mb-tokens",
        type=int,
        default=None,
        help="megatron: packed tokens per micro-batch (default: --engine-mb-tokens; with TP 1 "
        "it computes log-probs in chunks as the FSDP engine does)",
    )
    parser.add_argument(
        "--engines",
        default="fsdp,fsdp+kernels",
        help="comma-separated engine columns: fsdp (reported as 'engine'), fsdp+kernels "
        "(use_kernels: compiled decoder layers and log-prob chunks), megatron, "
        "megatron+kernels (use_kernels: compiled log-prob chunks and rotary embedding, "
        "Megatron's fused SwiGLU and bias-dropout-add, fused AdamW)",
    )
    parser.add_argument(
        "--logprobs-chunk-size", type=int, default=8192, help="engines: tokens per log-prob chunk"
    )
    parser.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="engines: recompute each decoder layer in backward (activation checkpointing)",
    )
    parser.add_argument("--steps", type=int, default=3, help="timed steps (at least 1)")
    parser.add_argument(
        "--warmup",
        type=int,
        default=None,
        help="engines: untimed warm-up steps before the timed ones (default 1, 2 with "
        "use_kernels); the plain loop always takes 1",
    )
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=None,
        help="build the random checkpoint here and reuse it in later runs of the same "
        "--shape, --seed and position limit (default: a temporary directory per run)",
    )
    parser.add_argument(
        "--build-only",
        action="store_true",
        help="with --model-dir: build (or keep) the checkpoint there and exit; CPU only",
    )
    parser.add_argument(
        "--max-position-embeddings",
        type=int,
        default=None,
        help="qwen2-0.5b: the checkpoint's position limit (default: 32768, or --max-len "
        "when longer); ling3-1b keeps its own",
    )
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--peak-tflops", type=float, default=989.0)
    parser.add_argument(
        "--only",
        choices=["engine", "engine+kernels", "megatron", "megatron+kernels", "plain"],
        default=None,
    )
    parser.add_argument(
        "--profile", action="store_true", help="profile one extra step of each engine column"
    )
    parser.add_argument(
        "--trace-dir",
        type=Path,
        default=None,
        help="with --profile: write each column's Python-stack trace there (gzipped JSON)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--output",
        "--out",
        type=Path,
        default=None,
        help=f"results JSON (default: {RESULTS.relative_to(ROOT)}, or "
        "train_engine_<shape>.json beside it for another shape)",
    )
    args = parser.parse_args()
    if args.steps < 1 or (args.warmup is not None and args.warmup < 0):
        raise SystemExit("--steps must be at least 1 and --warmup at least 0")
    if args.output is None:
        name = RESULTS.name if args.shape == "qwen2-0.5b" else f"train_engine_{args.shape}.json"
        args.output = RESULTS.with_name(name)
    if args.count_params:
        print_param_counts(args.shape)
        return
    if args.build_only:
        if args.model_dir is None:
            raise SystemExit("--build-only needs --model-dir")
        prepare_model(args, args.model_dir.parent)
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench/train_engine.py needs a CUDA GPU")

    from transformers import AutoConfig

    with tempfile.TemporaryDirectory() as tmp:
        shape_info: dict = {}
        model_dir = prepare_model(args, Path(tmp))
        if args.shape == "ling3-1b":
            meta = ling3_meta_model(model_dir)
            shape_info = ling3_param_counts(meta)
            print(f"{args.shape}: {shape_info}")
        cfg = AutoConfig.from_pretrained(model_dir)
        seqs = make_batch(args.sequences, args.min_len, args.max_len, cfg.vocab_size, args.seed)
        tokens = sum(len(s) for s in seqs)
        flops = ling3_flops_per_step(meta, seqs) if shape_info else flops_per_step(cfg, seqs)
        results = {}
        engines = {e.strip() for e in args.engines.split(",") if e.strip()}
        known = {"fsdp", "fsdp+kernels", "megatron", "megatron+kernels"}
        if engines - known:
            raise SystemExit(f"--engines: unknown {sorted(engines - known)}")
        engine = functools.partial(
            run_engine,
            profile=args.profile,
            chunk_size=args.logprobs_chunk_size,
            gradient_checkpointing=args.gradient_checkpointing,
            warmup=args.warmup,
        )
        columns = [
            ("engine", "fsdp", functools.partial(engine, backend="fsdp"), args.engine_mb_tokens),
            ("engine+kernels", "fsdp+kernels",
             functools.partial(engine, backend="fsdp", use_kernels=True), args.engine_mb_tokens),
            ("megatron", "megatron", functools.partial(engine, backend="megatron"),
             args.megatron_mb_tokens or args.engine_mb_tokens),
            ("megatron+kernels", "megatron+kernels",
             functools.partial(engine, backend="megatron", use_kernels=True),
             args.megatron_mb_tokens or args.engine_mb_tokens),
            ("plain", None, run_plain, args.mb_tokens),
        ]  # fmt: skip
        for name, key, run, budget in columns:
            if args.only and args.only != name:
                continue
            if key is not None and key not in engines:
                continue
            if key is None and args.shape != "qwen2-0.5b" and args.only != name:
                continue  # the plain loop is the dense model's baseline
            torch.cuda.reset_peak_memory_stats()
            extra = {}
            if key is not None and args.trace_dir is not None:
                args.trace_dir.mkdir(parents=True, exist_ok=True)
                extra["trace_to"] = str(args.trace_dir / f"trace_{key.replace('+', '_')}.json.gz")
            try:
                results[name] = run(model_dir, seqs, budget, args.steps, args.lr, **extra)
            except torch.OutOfMemoryError as e:
                results[name] = {
                    "error": f"out of memory: {str(e)[:200]}",
                    "oom": True,
                    "peak_mem_gb": torch.cuda.max_memory_allocated() / 2**30,
                }
                torch.cuda.empty_cache()
            r = results[name]
            if "step_s" in r:
                r["tokens_per_s"] = tokens / r["step_s"]
                r["mfu"] = flops / r["step_s"] / (args.peak_tflops * 1e12)
            if "profile" in r:
                print_profile(name, r["profile"])

    rows = []
    for name, r in results.items():
        if "error" in r:
            rows.append([name, "-", "-", "-", "-", r["error"][:60]])
            continue
        rows.append(
            [
                name,
                r["step_s"],
                r["tokens_per_s"],
                f"{100 * r['mfu']:.1f}%",
                r["peak_mem_gb"],
                r["micro_batches"],
            ]
        )
    device = torch.cuda.get_device_name()
    from areal.engine.attention import _varlen_reads_grouped_kv, varlen_kernel_available

    grouped_kv = varlen_kernel_available() and _varlen_reads_grouped_kv(
        torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    )
    print(f"varlen attention reads grouped key/value heads natively: {grouped_kv}")
    print(
        "\n"
        + render_table(
            f"Train step, {SHAPES[args.shape]}, {args.sequences} seqs "
            f"{args.min_len}-{args.max_len} ({tokens} tokens), {device}",
            ["loop", "step s", "tokens/s", "MFU", "peak GB", "micro-batches"],
            rows,
        )
    )
    for name in ("engine", "engine+kernels"):
        if name in results and "plain" in results and "tokens_per_s" in results["plain"]:
            speedup = results[name].get("tokens_per_s", 0) / results["plain"]["tokens_per_s"]
            print(f"{name} / plain tokens/s: {speedup:.2f}x")
            results["speedup" if name == "engine" else "speedup_kernels"] = speedup
    for mine, other in (
        ("megatron", "engine"),
        ("megatron+kernels", "engine+kernels"),
        ("megatron+kernels", "engine"),
    ):
        if "tokens_per_s" in results.get(mine, {}) and "tokens_per_s" in results.get(other, {}):
            ratio = results[mine]["tokens_per_s"] / results[other]["tokens_per_s"]
            print(f"{mine} / {other} tokens/s: {ratio:.3f}x")
            results[f"ratio {mine} / {other}"] = ratio
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(
        json.dumps(
            {
                "args": {k: str(v) for k, v in vars(args).items()},
                "device": device,
                "device_memory_gb": torch.cuda.get_device_properties(0).total_memory / 2**30,
                "torch": torch.__version__,
                "shape": args.shape,
                **shape_info,
                "varlen_grouped_kv": grouped_kv,
                "tokens": tokens,
                "flops_per_step": flops,
                "results": results,
                "world_size": int(os.environ.get("WORLD_SIZE", 1)),
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
