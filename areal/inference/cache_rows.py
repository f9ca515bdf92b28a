"""Row surgery on a ``transformers`` cache, for continuous batching: keep some rows, append
the rows of another cache.

Two kinds of cache layer hold per-request state, and both are batched along dim 0:

* attention layers (``DynamicLayer``): keys and values of shape ``[B, heads, L, dim]``,
  left-padded to the batch's column count ``L`` (MLA caches its compressed latent and its
  rotary key here, with ``heads = 1``). Appending pads the shorter side on the left;
  keeping rows can drop leading columns that are padding in every row.
* linear-attention layers (``LinearAttentionLayer``, e.g. KDA): per state, a conv state
  ``[B, channels, kernel]`` and a recurrent state ``[B, heads, k_dim, v_dim]``. They have
  no length axis, so rows are selected and concatenated as they are. Their token counter
  (the ``get_seq_length()`` of such a layer) is kept at the batch's column count, as a
  forward pass over the padded batch would leave it.

Left padding cannot leak into a recurrent state: the model zeroes the hidden states of
padded positions before its linear-attention layers (``create_recurrent_attention_mask``),
and with zero keys and values a zero state stays zero through any decay. So a group of
prompts can be prefilled together, left-padded, and its states merged.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    Cache,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionCacheLayerMixin,
)

__all__ = ["append_rows", "new_cache", "select_rows"]


def _has_linear_attention(config) -> bool:
    """Whether the model keeps recurrent state in some layers (a hybrid such as Ling 3)."""
    return "linear_attention" in (getattr(config, "layer_types", None) or [])


def new_cache(model: torch.nn.Module) -> Cache:
    """An empty cache for one prefill of ``model``.

    Plain models get attention layers only (also for sliding-window layers: the attention
    mask applies the window, and the columns stay aligned across rows). Hybrid models get
    the layer kinds their config names, since a linear-attention layer needs its own
    state slots.
    """
    config = model.config.get_text_config(decoder=True)
    if not _has_linear_attention(config):
        return DynamicCache()
    cache = DynamicCache(config=config)
    for index, layer in enumerate(cache.layers):
        if isinstance(layer, DynamicSlidingWindowLayer):
            raise NotImplementedError(
                f"layer {index} is a sliding-window layer of a hybrid model: continuous "
                "batching keeps every column, so it cannot merge a windowed cache"
            )
        if not isinstance(layer, (DynamicLayer, LinearAttentionCacheLayerMixin)):
            raise NotImplementedError(
                f"layer {index} of the cache is a {type(layer).__name__}, which the embedded "
                "server cannot batch"
            )
    return cache


def select_rows(cache: Cache, rows: torch.Tensor, start: int, length: int) -> None:
    """Keep ``rows`` (a 1-D index, in its order) and drop the first ``start`` columns of the
    attention layers, in place; ``length`` is the column count left."""
    for layer in cache.layers:
        if _has_keys(layer):
            layer.keys = layer.keys.index_select(0, rows)[:, :, start:]
            layer.values = layer.values.index_select(0, rows)[:, :, start:]
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            for states, slot in _states(layer):
                states[slot] = states[slot].index_select(0, rows)
            _set_length(layer, length)


def append_rows(cache: Cache, other: Cache, length: int) -> None:
    """Append the rows of ``other`` (same model) to ``cache``, in place; both sides'
    attention layers are left-padded to ``length`` columns."""
    if len(cache.layers) != len(other.layers):
        raise ValueError(f"caches of {len(cache.layers)} and {len(other.layers)} layers")
    for layer, extra in zip(cache.layers, other.layers, strict=True):
        if _has_keys(layer) != _has_keys(extra):
            raise ValueError("one cache has keys in a layer where the other has none")
        if _has_keys(layer):
            layer.keys = _cat_left_padded(layer.keys, extra.keys, length)
            layer.values = _cat_left_padded(layer.values, extra.values, length)
        if isinstance(layer, LinearAttentionCacheLayerMixin):
            pairs = zip(_states(layer), _states(extra), strict=True)
            for (states, slot), (extra_states, extra_slot) in pairs:
                states[slot] = torch.cat([states[slot], extra_states[extra_slot]])
            _set_length(layer, length)


def _has_keys(layer) -> bool:
    return isinstance(layer, DynamicLayer) and bool(layer.is_initialized)


def _states(layer: LinearAttentionCacheLayerMixin) -> list[tuple[dict, int]]:
    """``(dict, slot)`` of each initialized conv and recurrent state of ``layer``: assigning
    ``dict[slot]`` replaces that state."""
    return [
        (states, slot)
        for states, ready in (
            (layer.conv_states, layer.is_conv_states_initialized),
            (layer.recurrent_states, layer.is_recurrent_states_initialized),
        )
        for slot in states
        if ready[slot]
    ]


def _set_length(layer: LinearAttentionCacheLayerMixin, length: int) -> None:
    # a tensor the model adds to in place: keep the object, set its value
    layer.cumulative_length_linear.fill_(length)


def _cat_left_padded(a: torch.Tensor, b: torch.Tensor, length: int) -> torch.Tensor:
    """``[B1, H, L1, D]`` and ``[B2, H, L2, D]`` → ``[B1 + B2, H, length, D]``."""
    return torch.cat([_pad_left(a, length), _pad_left(b, length)])


def _pad_left(t: torch.Tensor, length: int) -> torch.Tensor:
    missing = length - t.shape[2]
    if missing <= 0:
        return t
    return torch.cat([t.new_zeros(*t.shape[:2], missing, *t.shape[3:]), t], dim=2)
