"""``AREAL_FLA_AUTOTUNE=quick``: fla's kernels keep two tuning candidates each.

fla's kernels are Triton autotuners (under ``triton.heuristics`` wrappers) held as module
globals; the GPU is not needed to check which candidates survive, so stand-ins with the
same shape (a class named ``Autotuner`` with ``configs``, a wrapper with ``fn``) sit in a
module registered as ``fla.*``.
"""

from __future__ import annotations

import sys
import types

import pytest

from areal.engine import kda


class Config:
    def __init__(self, num_warps: int, num_stages: int, **kwargs: int):
        self.num_warps, self.num_stages, self.kwargs = num_warps, num_stages, kwargs

    def __repr__(self) -> str:
        return f"Config({self.kwargs}, w{self.num_warps}, s{self.num_stages})"


class Autotuner:
    def __init__(self, configs: list[Config]):
        self.configs = configs


class Heuristics:  # triton.heuristics wraps the autotuner as .fn
    def __init__(self, fn: object):
        self.fn = fn


@pytest.fixture
def fake_fla(monkeypatch):
    module = types.ModuleType("fla.ops.fake")
    grid = [
        Config(w, s, BK=bk, BV=bv)
        for bk in (32, 64)
        for bv in (32, 64)
        for w in (1, 2, 4, 8)
        for s in (2, 3, 4)
    ]
    module.wrapped = Heuristics(Autotuner(list(grid)))
    module.bare = Autotuner([Config(w, s) for w in (2, 4, 8) for s in (2, 3, 4)])
    module.single = Autotuner([Config(8, 3)])
    module.not_a_kernel = types.SimpleNamespace(configs=[1, 2, 3])
    monkeypatch.setitem(sys.modules, "fla.ops.fake", module)
    return module, grid


def test_each_kernel_keeps_the_preferred_candidate_and_fla_first(fake_fla):
    module, grid = fake_fla
    assert kda.limit_fla_autotuning() == 2

    wrapped = module.wrapped.fn.configs
    assert len(wrapped) == 2
    best = wrapped[0]
    assert (best.num_warps, best.num_stages, best.kwargs) == (4, 2, {"BK": 64, "BV": 64})
    assert wrapped[1] is grid[0]  # fla's own first candidate, the fallback
    assert [(c.num_warps, c.num_stages) for c in module.bare.configs] == [(4, 2), (2, 2)]
    assert len(module.single.configs) == 1  # nothing to cut
    assert module.not_a_kernel.configs == [1, 2, 3]  # not an autotuner: untouched


def test_a_second_call_cuts_nothing_more(fake_fla):
    module, _ = fake_fla
    kda.limit_fla_autotuning()
    first = list(module.wrapped.fn.configs)
    assert kda.limit_fla_autotuning(keep=1) == 0
    assert module.wrapped.fn.configs == first


def test_modules_outside_fla_are_left_alone(monkeypatch):
    other = types.ModuleType("flax_like")
    other.kernel = Autotuner([Config(w, 2) for w in (1, 2, 4, 8)])
    monkeypatch.setitem(sys.modules, "flax_like", other)
    kda.limit_fla_autotuning()
    assert len(other.kernel.configs) == 4
