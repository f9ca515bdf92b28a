"""The accelerator platform this process runs on (the reference's ``areal.current_platform``).

Engines and workers ask it for the device type, the collective backend and the variable
that selects visible devices, instead of testing ``torch.cuda`` themselves. Detection runs
on first use of ``current_platform`` (it imports torch); ``import areal`` stays cheap.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["Platform", "current_platform", "detect_platform"]  # noqa: F822 (module __getattr__)

DeviceType = Literal["cuda", "cpu"]


@dataclass(frozen=True)
class Platform:
    """One kind of device: what torch calls it and how processes share it."""

    device_type: DeviceType
    communication_backend: Literal["nccl", "gloo"]  # torch.distributed backend for tensors
    device_control_env_var: str  # the scheduler sets this to give a worker its devices
    name: str  # e.g. "NVIDIA H200", or "cpu"

    def device_count(self) -> int:
        import torch

        return torch.cuda.device_count() if self.device_type == "cuda" else 0

    def current_device(self) -> Any:
        """``torch.device`` this process computes on (the selected GPU, or the CPU)."""
        import torch

        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")

    def set_device(self, index: int) -> None:
        import torch

        if self.device_type == "cuda":
            torch.cuda.set_device(index)

    def synchronize(self) -> None:
        import torch

        if self.device_type == "cuda":
            torch.cuda.synchronize()

    def clear_cache(self) -> None:
        import torch

        if self.device_type == "cuda":
            torch.cuda.empty_cache()


CPU = Platform("cpu", "gloo", "CUDA_VISIBLE_DEVICES", "cpu")


@functools.cache
def detect_platform() -> Platform:
    """CUDA when torch sees a GPU, else the CPU."""
    import torch

    if torch.cuda.is_available():
        return Platform("cuda", "nccl", "CUDA_VISIBLE_DEVICES", torch.cuda.get_device_name())
    return CPU


def __getattr__(name: str) -> Any:
    if name == "current_platform":
        return detect_platform()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
