"""Where a GPU sits idle: the gaps in a profiled step's kernel timeline, attributed to the
Python code the host was running while the GPU waited.

A gap between two kernels is host-bound when the kernel that ends it was launched during
the gap: the GPU had run out of work and waited for the CPU. Such a gap is sampled every
``sample_us`` microseconds and each sample is charged to the Python frames open at that
moment (the most recently entered stack over all threads, so a backward pass is charged
to the autograd thread's frames, not to the main thread waiting in ``backward()``). A gap
whose closing kernel was launched before the gap began waited on something else (a copy,
an event between streams) and is reported as such.

``idle_profile(step)`` profiles one call with Python stacks (which slows the host, so the
idle share it reports is an upper bound; use it for where, not how much) and returns the
summary; :func:`attribute_idle` does the arithmetic on a Chrome trace and is what the
tests exercise.
"""

from __future__ import annotations

import bisect
import collections
import gzip
import json
import os
import re
import tempfile
import time
from typing import Any

__all__ = ["GPU_CATEGORIES", "attribute_idle", "idle_profile", "profiled_trace", "step_window"]

GPU_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")
# frames that say nothing about which part of the step is running
# (torch's own frames appear as "torch/nn/modules/module.py(1779): _call_impl")
_PLUMBING = re.compile(r"(^|/)torch/|^<built-in method _|threading\.py|contextlib\.py|gpu_idle\.py")


def _frame(name: str) -> str:
    """``'/a/b/areal/engine/x.py(12): f'`` -> ``'x.py:12 f'``; built-ins lose addresses."""
    name = _ADDRESS.sub("", name)
    match = re.match(r"(.*?)\((\d+)\): (.*)", name)
    if not match:
        return name
    path, line, func = match.groups()
    return f"{os.path.basename(path)}:{line} {func}"


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[tuple[float, float]] = []
    for begin, end in sorted(intervals):
        if merged and begin <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((begin, end))
    return merged


def _python_stacks(events: list[dict], times: list[float]) -> list[list[str]]:
    """For each of the sorted ``times``, the open Python frames (outermost first) of the
    thread whose innermost open frame began last."""
    by_thread: dict[Any, list[dict]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "python_function" and e.get("ph") == "X":
            by_thread[e.get("tid")].append(e)
    per_thread: list[list[tuple[float, list[str]]]] = []
    for thread_events in by_thread.values():
        thread_events.sort(key=lambda e: (e["ts"], -e.get("dur", 0)))
        stack: list[tuple[float, float, str]] = []  # (begin, end, frame)
        out: list[tuple[float, list[str]]] = []
        i = 0
        for t in times:
            while i < len(thread_events) and thread_events[i]["ts"] <= t:
                e = thread_events[i]
                while stack and stack[-1][1] <= e["ts"]:
                    stack.pop()
                stack.append((e["ts"], e["ts"] + e.get("dur", 0), e["name"]))
                i += 1
            while stack and stack[-1][1] <= t:
                stack.pop()
            out.append((stack[-1][0] if stack else float("-inf"), [s[2] for s in stack]))
        per_thread.append(out)
    result = []
    for k in range(len(times)):
        candidates = [thread[k] for thread in per_thread if thread[k][1]]
        result.append(max(candidates, key=lambda c: c[0])[1] if candidates else [])
    return result


def _site(stack: list[str], depth: int = 3) -> str:
    """The innermost ``depth`` frames outside torch's plumbing, innermost first, with the
    innermost frame of all in brackets when it is torch's (``[adamw.py:...]``)."""
    frames = [_frame(f) for f in reversed(stack)]
    own = [f for f, raw in zip(frames, reversed(stack)) if not _PLUMBING.search(raw)]
    label = " <- ".join(own[:depth]) or "(no Python frame)"
    if frames and (not own or frames[0] != own[0]):
        label = f"[{frames[0]}] {label}"
    return label


def attribute_idle(
    trace: dict, window: tuple[float, float] | None = None, sample_us: float = 10.0, top: int = 15
) -> dict:
    """Summarize the GPU idle time in a Chrome trace (``torch.profiler`` export).

    ``window`` ``(begin_us, end_us)`` bounds the step (default: first to last event).
    Returns seconds: ``wall_s``, ``busy_s`` (the union of kernel, copy and memset
    intervals), ``idle_s``, ``host_bound_s``, ``waiting_s`` (gaps whose closing kernel had
    already been launched), ``gaps`` (count of gaps over ``sample_us``) and ``sites``:
    ``[[site, seconds, gaps], ...]`` for the host-bound time, largest first.
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "ts" in e]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    if window is None:
        window = (min(e["ts"] for e in events), max(e["ts"] + e.get("dur", 0) for e in events))
    begin, end = window
    clipped = [(max(begin, e["ts"]), min(end, e["ts"] + e.get("dur", 0))) for e in gpu]
    busy = _merge([(a, b) for a, b in clipped if b > a])
    launches = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    starts = sorted((e["ts"], e.get("args", {}).get("correlation")) for e in gpu)
    start_times = [s[0] for s in starts]
    # the gaps: before the first kernel, between busy intervals, after the last one
    edges = [begin] + [x for interval in busy for x in interval] + [end]
    gaps = [(edges[i], edges[i + 1]) for i in range(0, len(edges), 2) if edges[i + 1] > edges[i]]
    host_bound, waiting = [], 0.0
    for g0, g1 in gaps:
        if g1 - g0 < sample_us:
            continue
        k = bisect.bisect_left(start_times, g1)
        launched = launches.get(starts[k][1]) if k < len(starts) else None
        if launched is not None and launched <= g0:
            waiting += g1 - g0
        else:
            host_bound.append((g0, g1 if launched is None else min(g1, max(g0, launched))))
    times, weights, owner = [], [], []
    for index, (a, b) in enumerate(host_bound):
        n = max(1, int((b - a) // sample_us))
        for j in range(n):
            times.append(a + (j + 0.5) * (b - a) / n)
            weights.append((b - a) / n)
            owner.append(index)
    order = sorted(range(len(times)), key=times.__getitem__)
    stacks = _python_stacks(events, [times[i] for i in order])
    seconds: collections.Counter = collections.Counter()
    gap_sets: dict[str, set] = collections.defaultdict(set)
    for rank, i in enumerate(order):
        site = _site(stacks[rank])
        seconds[site] += weights[i] / 1e6
        gap_sets[site].add(owner[i])
    busy_s = sum(b - a for a, b in busy) / 1e6
    wall_s = (end - begin) / 1e6
    return {
        "wall_s": wall_s,
        "busy_s": busy_s,
        "idle_s": wall_s - busy_s,
        "host_bound_s": sum(weights) / 1e6,
        "waiting_s": waiting / 1e6,
        "gaps": len([g for g in gaps if g[1] - g[0] >= sample_us]),
        "sites": [[site, s, len(gap_sets[site])] for site, s in seconds.most_common(top)],
    }


def profiled_trace(step, with_stack: bool = False) -> tuple[Any, dict, float]:
    """Run ``step()`` once under ``torch.profiler`` inside an ``idle_step`` annotation:
    ``(profiler, Chrome trace as a dict, wall seconds)``."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    torch.cuda.synchronize()
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    with (
        profile(activities=activities, with_stack=with_stack) as prof,
        record_function("idle_step"),
    ):
        begin = time.perf_counter()
        step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - begin
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    return prof, trace, wall


def idle_profile(step, top: int = 15, save_to: str | None = None) -> dict:
    """Profile one ``step()`` with Python stacks and attribute its GPU idle time; with
    ``save_to``, the trace is also written there, gzipped (open it in Perfetto)."""
    _, trace, _ = profiled_trace(step, with_stack=True)
    if save_to:
        with gzip.open(save_to, "wt") as f:
            json.dump(trace, f)
    return attribute_idle(trace, window=step_window(trace), top=top)


def step_window(trace: dict) -> tuple[float, float] | None:
    """The ``(begin_us, end_us)`` of the trace's ``idle_step`` annotation, if it has one."""
    for e in trace.get("traceEvents", []):
        if e.get("name") == "idle_step" and e.get("cat") == "user_annotation":
            return e["ts"], e["ts"] + e["dur"]
    return None
