"""``areal.current_platform``: what the process runs on, detected on first use."""

from __future__ import annotations

import subprocess
import sys

import torch

from areal.platforms import CPU, Platform, detect_platform


def test_without_a_gpu_the_platform_is_the_cpu_with_gloo(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    detect_platform.cache_clear()
    try:
        import areal

        platform = areal.current_platform
        assert platform is CPU
        assert (platform.device_type, platform.communication_backend) == ("cpu", "gloo")
        assert platform.current_device() == torch.device("cpu")
        assert platform.device_count() == 0
        platform.synchronize()  # no-ops on the CPU
        platform.clear_cache()
        platform.set_device(0)
    finally:
        detect_platform.cache_clear()


def test_with_a_gpu_the_platform_is_cuda_with_nccl(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "NVIDIA H200")
    detect_platform.cache_clear()
    try:
        from areal.platforms import current_platform

        assert current_platform == Platform("cuda", "nccl", "CUDA_VISIBLE_DEVICES", "NVIDIA H200")
    finally:
        detect_platform.cache_clear()


def test_import_areal_does_not_detect_or_import_torch():
    code = "import sys, areal; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
