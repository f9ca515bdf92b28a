"""The engine's sync-free rotary embedding for packed streams equals Megatron's own."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.unit.engine import megatron_cpu_shim

available, reason = megatron_cpu_shim.megatron_available()
pytestmark = pytest.mark.skipif(not available, reason=reason)


class _OneRank:
    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


def _config(interleaved: bool = False):
    return SimpleNamespace(
        rotary_interleaved=interleaved, multi_latent_attention=False, apply_rope_fusion=False
    )


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize(
    "lengths",
    [[5, 3, 8], [16], [1, 1, 1, 13], [4, 0, 6]],
    ids=["three", "one", "short-first", "empty-segment"],
)
def test_packed_rope_matches_megatron(lengths, interleaved):
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_thd

    from areal.engine.megatron_compat import _packed_rope

    g = torch.Generator().manual_seed(0)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t = torch.randn(total, 2, 8, generator=g)
    for rows in (max(lengths), total):  # max segment length, and Megatron's offset mode
        freqs = torch.randn(rows, 1, 1, 8, generator=g)
        expected = _apply_rotary_pos_emb_thd(
            t, cu, freqs, rotary_interleaved=interleaved, cp_group=_OneRank()
        )
        got = _packed_rope(t, freqs, cu, interleaved, False)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize("lengths", [[5, 3, 8], [4, 0, 6, 2]], ids=["three", "empty-segment"])
def test_compiled_packed_rope_matches_the_eager_one(lengths):
    from areal.engine import megatron_compat
    from areal.engine.megatron_compat import _packed_rope

    g = torch.Generator().manual_seed(2)
    total = sum(lengths)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    t = torch.randn(total, 2, 8, generator=g)
    freqs = torch.randn(max(lengths), 1, 1, 8, generator=g)
    eager = _packed_rope(t, freqs, cu, False, False)
    compiled = _packed_rope(t, freqs, cu, False, False, compiled=True)
    torch.testing.assert_close(compiled, eager, rtol=1e-6, atol=1e-6)
    assert not megatron_compat._ROPE_COMPILE_FAILED  # the compiled graph ran, no fallback


def test_attention_calls_the_packed_rope_only_where_it_applies(monkeypatch):
    from megatron.core.transformer import attention

    from areal.engine import megatron_compat

    calls = []
    monkeypatch.setattr(attention, "apply_rotary_pos_emb", lambda *a, **k: calls.append(k))
    monkeypatch.setattr(megatron_compat, "_packed_rope", lambda *a, **k: "packed")
    megatron_compat.patch_packed_rope()
    megatron_compat.patch_packed_rope()  # idempotent: wraps once
    rope = attention.apply_rotary_pos_emb
    t, freqs, cu = torch.zeros(4, 1, 2), torch.zeros(4, 1, 1, 2), torch.tensor([0, 4])
    assert rope(t, freqs, _config(), cu_seqlens=cu, cp_group=_OneRank()) == "packed"
    rope(t, freqs, _config(), cu_seqlens=None)  # unpacked: Megatron's own
    rope(t, freqs, _config(), cu_seqlens=cu, mscale=2.0)  # YaRN scaling: Megatron's own
    fused = SimpleNamespace(**{**vars(_config()), "apply_rope_fusion": True})
    rope(t, freqs, fused, cu_seqlens=cu)
    assert len(calls) == 3


def test_foreach_l2_norm_is_the_global_norm():
    from areal.engine.megatron_compat import _foreach_l2_norm

    g = torch.Generator().manual_seed(1)
    grads = [torch.randn(3, 5, generator=g), torch.randn(7, generator=g), torch.zeros(2, 2)]
    flag = torch.zeros(1, dtype=torch.int)
    norm, per_tensor = _foreach_l2_norm(2048, flag, [grads[:2], grads[2:]], False)
    expected = torch.cat([t.flatten() for t in grads]).norm()
    assert per_tensor is None and norm.shape == (1,) and norm.dtype == torch.float32
    torch.testing.assert_close(norm[0], expected)
    empty, _ = _foreach_l2_norm(2048, flag, [[]], False)
    assert empty.tolist() == [0.0]


def test_apex_less_megatron_uses_the_foreach_norm(monkeypatch):
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    from areal.engine import megatron_compat

    monkeypatch.setattr(clip_grads, "l2_norm_impl", utils.local_multi_tensor_l2_norm)
    megatron_compat.patch_foreach_l2_norm()
    assert clip_grads.l2_norm_impl is megatron_compat._foreach_l2_norm
    apex = object()  # an Apex kernel stays
    monkeypatch.setattr(clip_grads, "l2_norm_impl", apex)
    megatron_compat.patch_foreach_l2_norm()
    assert clip_grads.l2_norm_impl is apex


def test_fuse_torch_adam_switches_only_fresh_torch_adams():
    from types import SimpleNamespace

    from areal.engine.megatron_model import fuse_torch_adam

    def wrapped(optimizer):
        return SimpleNamespace(optimizer=optimizer)

    fresh = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    stepped = torch.optim.AdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    stepped.param_groups[0]["params"][0].grad = torch.ones(3)
    stepped.step()  # has state: its CPU step counters would not suit the fused kernel
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    chained = SimpleNamespace(chained_optimizers=[wrapped(fresh), wrapped(stepped), wrapped(sgd)])
    assert fuse_torch_adam(chained) == 1
    assert fresh.param_groups[0]["fused"] is True and fresh.param_groups[0]["foreach"] is False
    assert stepped.param_groups[0]["fused"] is None
    param = fresh.param_groups[0]["params"][0]
    param.grad = torch.ones(3)
    # the fused CPU kernel: the first step is w(1 - lr * 0.01) - lr * g / |g| = 0.999 - 0.1
    fresh.step()
    torch.testing.assert_close(param.detach(), torch.full((3,), 1 - 0.1 - 0.1 * 0.01 * 1.0))
