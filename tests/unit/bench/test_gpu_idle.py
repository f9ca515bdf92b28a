"""bench/gpu_idle.py on hand-built Chrome traces: which gaps are host-bound and whose
Python frames they are charged to."""

from __future__ import annotations

import pytest

from bench.gpu_idle import attribute_idle


def kernel(ts, dur, corr):
    return {"ph": "X", "cat": "kernel", "name": f"k{corr}", "ts": ts, "dur": dur,
            "args": {"correlation": corr}}  # fmt: skip


def launch(ts, corr):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1,
            "args": {"correlation": corr}}  # fmt: skip


def frame(ts, dur, name, tid=1):
    return {"ph": "X", "cat": "python_function", "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_a_host_bound_gap_is_charged_to_the_frames_open_during_it():
    # GPU: busy 0-100, idle 100-400, busy 400-500. The kernel at 400 was launched at 390,
    # so 100-390 is host-bound (290 us) and 390-400 is the launch itself (not sampled).
    # The host ran pack() from 0 to 1000 and, inside it, tolist() from 120 to 380.
    trace = {"traceEvents": [
        kernel(0, 100, 1), launch(0, 1),
        kernel(400, 100, 2), launch(390, 2),
        frame(0, 1000, "/x/areal/engine/packing.py(10): pack"),
        frame(120, 260, "<built-in method tolist of Tensor object at 0x7f00>"),
    ]}  # fmt: skip
    out = attribute_idle(trace, window=(0, 500), sample_us=10)
    assert out["busy_s"] == pytest.approx(200e-6)
    assert out["idle_s"] == pytest.approx(300e-6)
    assert out["host_bound_s"] == pytest.approx(290e-6)
    assert out["waiting_s"] == 0.0
    assert out["gaps"] == 1
    sites = {site: s for site, s, _ in out["sites"]}
    # 120-380 inside tolist (26 samples of 10 us), the rest (100-120, 380-390) in pack
    assert sites["<built-in method tolist of Tensor object> <- packing.py:10 pack"] == (
        pytest.approx(260e-6, abs=10e-6)
    )
    assert sites["packing.py:10 pack"] == pytest.approx(30e-6, abs=10e-6)


def test_a_gap_whose_kernel_was_already_queued_is_waiting_not_host_bound():
    # the kernel at 300 was launched at 50, while the GPU was still busy: the GPU waited
    # on something other than the host (an event, a copy) for 200 us
    trace = {"traceEvents": [
        kernel(0, 100, 1), launch(0, 1), kernel(300, 50, 2), launch(50, 2),
        frame(0, 400, "/x/train.py(1): step"),
    ]}  # fmt: skip
    out = attribute_idle(trace, window=(0, 350), sample_us=10)
    assert out["waiting_s"] == pytest.approx(200e-6)
    assert out["host_bound_s"] == 0.0
    assert out["sites"] == []


def test_backward_gaps_go_to_the_thread_that_entered_its_frame_last():
    # the main thread sits in backward() (entered at 0); the autograd thread enters a hook
    # at 150: the gap 100-300 (launch at 300) is charged to the hook from 150 on
    trace = {"traceEvents": [
        kernel(0, 100, 1), launch(0, 1), kernel(300, 10, 2), launch(300, 2),
        frame(0, 400, "/x/train.py(5): backward", tid=1),
        frame(150, 150, "/x/megatron/core/distributed/ddp.py(7): hook", tid=2),
    ]}  # fmt: skip
    out = attribute_idle(trace, window=(0, 310), sample_us=10)
    sites = {site: s for site, s, _ in out["sites"]}
    assert sites["ddp.py:7 hook"] == pytest.approx(150e-6, abs=10e-6)
    assert sites["train.py:5 backward"] == pytest.approx(50e-6, abs=10e-6)
    assert out["host_bound_s"] == pytest.approx(200e-6)


def test_torch_frames_are_skipped_but_the_innermost_one_is_named():
    trace = {"traceEvents": [
        kernel(0, 10, 1), launch(0, 1), kernel(100, 10, 2), launch(100, 2),
        frame(0, 200, "/x/areal/engine/megatron_engine.py(840): optimizer_step"),
        frame(5, 190, "torch/optim/optimizer.py(500): wrapper"),
        frame(6, 180, "torch/optim/adamw.py(200): step"),
    ]}  # fmt: skip
    out = attribute_idle(trace, window=(0, 110), sample_us=10)
    assert [site for site, _, _ in out["sites"]] == [
        "[adamw.py:200 step] megatron_engine.py:840 optimizer_step"
    ]
