"""Model families this port trains beyond what transformers resolves on its own.

Importing this package registers them (:func:`register`), so every module that loads a
model with ``AutoConfig`` / ``AutoModelForCausalLM`` imports it first. Today that is Ling 3
(``BailingMoeV3ForCausalLM``, :mod:`areal.models.bailing`), which transformers implements as
``bailing_hybrid``; the helpers here are the model-agnostic entry points the engines call
(they do nothing for other models).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from areal.models import bailing

__all__ = [
    "checkpoint_weights",
    "enable_packed_sequences",
    "hf_state_dict",
    "register",
    "save_pretrained",
]


def register() -> None:
    """Register every model family of this package with transformers; idempotent."""
    bailing.register()


def enable_packed_sequences(model: Any) -> None:
    """Make a loaded model honour packed-sequence boundaries wherever transformers' own code
    does not (Ling 3's KDA layers: :mod:`areal.models.bailing_packed`); a no-op for other
    models, whose attention layers already take the boundaries."""
    if bailing.is_bailing_config(model.config):
        from areal.models.bailing_packed import enable_packed_sequences as enable_kda

        enable_kda(model)


def checkpoint_weights(
    config: Any, weights: Iterable[tuple[str, Any]]
) -> Iterator[tuple[str, Any]]:
    """``(name, tensor)`` pairs under the names a checkpoint of ``config``'s family stores.

    ``weights`` are the model's own (``state_dict``) names. For Ling 3 they become the
    official names, one internal tensor possibly giving several (fused experts and short
    convolutions are split); for other models the pairs pass through unchanged. Inference
    servers loading the official checkpoint (SGLang) expect these names in weight updates.
    """
    if not bailing.is_bailing_config(config):
        yield from weights
        return
    for name, tensor in weights:
        yield from bailing.to_official(name, tensor)


def hf_state_dict(config: Any, state: Mapping[str, Any]) -> dict[str, Any]:
    """A checkpoint's tensors renamed to the model's own (``state_dict``) names.

    The inverse of :func:`checkpoint_weights`: official Ling 3 names are merged and renamed
    (:func:`areal.models.bailing.to_hf_state_dict`; names that are internal already pass
    through); other models' states are returned as a plain dict, unchanged.
    """
    if not bailing.is_bailing_config(config):
        return dict(state)
    return bailing.to_hf_state_dict(state, getattr(config, "num_experts", None))


def save_pretrained(
    model: Any,
    path: str | os.PathLike[str],
    state_dict: Mapping[str, Any] | None = None,
    source: str | os.PathLike[str] | None = None,
) -> None:
    """``model.save_pretrained(path)``, written the way the model's official checkpoints are.

    transformers already writes official weight names; for Ling 3 the config is rewritten
    too (:func:`areal.models.bailing.write_official_config`; ``source``: the directory the
    model was loaded from, whose config is kept).
    """
    model.save_pretrained(path, state_dict=dict(state_dict) if state_dict is not None else None)
    if bailing.is_bailing_config(model.config):
        bailing.write_official_config(path, source=source)


register()
