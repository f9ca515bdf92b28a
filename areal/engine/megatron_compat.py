"""Every patch the Megatron engine makes to megatron-core and mbridge internals.

The engine runs Megatron's local (non Transformer Engine) layers on packed streams. Some
internals of the pinned releases assume Transformer Engine, Apex or transformers 4, or wait
for the host where a training step cannot afford it; the patches below change exactly those.

Each patch is written for the versions in :data:`PINNED` (the ``megatron`` extra of
pyproject.toml) and checks them before it touches anything:

* a patch the engine cannot run without raises :class:`MegatronVersionError` on any other
  version, naming the package, the version found, the pinned one and the patched symbol;
* a patch that only makes the engine faster is refused with a warning of the same words,
  and the engine runs on Megatron's own code.

:func:`apply_patches` is the entry point the engine calls: process-wide patches are applied
once and a bridge is adapted once, so calling it again changes nothing.
:func:`pass_hidden_through_output_layer` is the one per-model patch, for the engine's
chunked LM head. ``tests/unit/engine/test_megatron_compat.py`` fails when a patched symbol
moves or changes shape.

megatron-core and mbridge are imported inside functions only.
"""

from __future__ import annotations

import functools
import importlib.metadata
import re
from typing import Any

import torch

from areal.utils import logging

__all__ = [
    "COMPILED_ROPE_ATTR",
    "PINNED",
    "MegatronVersionError",
    "apply_patches",
    "enable_compiled_rope",
    "pass_hidden_through_output_layer",
    "patch_bridge_expert_names",
    "patch_bridge_layer_spec",
    "patch_bridge_local_norm_names",
    "patch_bridge_rope_theta",
    "patch_foreach_l2_norm",
    "patch_mla_without_te",
    "patch_moe_router_gemm",
    "patch_packed_rope",
]

logger = logging.getLogger("engine.megatron_compat")

# keep in step with the `megatron` extra of pyproject.toml (a unit test compares them)
PINNED: dict[str, str] = {"megatron-core": "0.16.1", "mbridge": "0.15.1"}

# set on a bridge once apply_patches adapted it
_BRIDGE_ADAPTED = "_areal_compat_adapted"
# set on a model's TransformerConfig by an engine with use_kernels: its layers take the
# compiled rotary embedding (the rotary patch is process-wide, the choice is per model)
COMPILED_ROPE_ATTR = "_areal_compiled_rope"

# Megatron's local layer spec names the two RMSNorms of a layer as modules of their own;
# mbridge only knows the Transformer Engine names, where they are fused into the linears.
LOCAL_SPEC_OTHER = {
    "input_layernorm.weight": ["model.layers.{layer_number}.input_layernorm.weight"]
}
LOCAL_SPEC_MLP = {
    "pre_mlp_layernorm.weight": ["model.layers.{layer_number}.post_attention_layernorm.weight"]
}


class MegatronVersionError(RuntimeError):
    """A patch met a megatron-core or mbridge version it was not written for."""


# --- version guard ---


@functools.cache
def _installed_version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "(not installed)"


def _version_problem(symbol: str, packages: tuple[str, ...]) -> str | None:
    """Why ``symbol`` must not be patched here, or ``None`` when every package is pinned."""
    for package in packages:
        found, pinned = _installed_version(package), PINNED[package]
        if found != pinned:
            return (
                f"cannot patch {symbol}: {package} {found} is installed, but the patch is "
                f"written for {package}=={pinned} (the 'megatron' extra of pyproject.toml); "
                f"install {package}=={pinned} or port the patch in areal/engine/megatron_compat.py"
            )
    return None


def _may_patch(symbol: str, packages: tuple[str, ...], *, required: bool) -> bool:
    """Raise (``required``) or warn and return False when a package is not at its pin."""
    problem = _version_problem(symbol, packages)
    if problem is None:
        return True
    if required:
        raise MegatronVersionError(problem)
    logger.warning("%s; patch refused, running on Megatron's own implementation", problem)
    return False


# --- the entry point ---


def apply_patches(bridge: Any = None) -> None:
    """Apply the process-wide patches and adapt ``bridge`` (an mbridge ``Bridge``), once each."""
    if bridge is not None and not getattr(bridge, _BRIDGE_ADAPTED, False):
        patch_bridge_rope_theta(bridge)
        patch_bridge_local_norm_names(bridge)
        patch_bridge_layer_spec(bridge)
        if getattr(bridge.hf_config, "num_experts", None):
            patch_moe_router_gemm()
            patch_bridge_expert_names(bridge)
            patch_bridge_local_expert_loading(bridge)
        if getattr(getattr(bridge, "config", None), "multi_latent_attention", False):
            patch_mla_without_te()
        setattr(bridge, _BRIDGE_ADAPTED, True)
    patch_packed_rope()
    patch_foreach_l2_norm()


# --- mbridge: transformers 5 configs, local layers, local experts ---


def patch_bridge_rope_theta(bridge: Any) -> None:
    """Set ``hf_config.rope_theta``: mbridge reads it, transformers 5 moved it elsewhere."""
    _may_patch(
        "mbridge.core.llm_bridge.LLMBridge._get_gptmodel_args (hf_config.rope_theta)",
        ("mbridge",),
        required=True,
    )
    hf = bridge.hf_config
    if not hasattr(hf, "rope_theta"):
        params = getattr(hf, "rope_parameters", None) or {}
        hf.rope_theta = params.get("rope_theta", 10000.0)


def patch_bridge_local_norm_names(bridge: Any) -> None:
    """Give the bridge private name mappings that know the local layers' separate RMSNorms."""
    _may_patch(
        "mbridge.core.bridge.Bridge._DIRECT_MAPPING / _OTHER_MAPPING / _MLP_MAPPING",
        ("mbridge",),
        required=True,
    )
    # the class-level dicts are shared (and edited for tied models): keep private copies
    cls = type(bridge)
    direct = dict(cls._DIRECT_MAPPING)
    tied = bool(getattr(bridge.hf_config, "tie_word_embeddings", False))
    direct["output_layer.weight"] = "model.embed_tokens.weight" if tied else "lm_head.weight"
    bridge._DIRECT_MAPPING = direct
    bridge._OTHER_MAPPING = {**cls._OTHER_MAPPING, **LOCAL_SPEC_OTHER}
    bridge._MLP_MAPPING = {**LOCAL_SPEC_MLP, **cls._MLP_MAPPING}


def patch_bridge_layer_spec(bridge: Any) -> None:
    """Build the bridge's layers from Megatron's local modules (mbridge asks for TE's)."""
    _may_patch(
        "mbridge.core.llm_bridge.LLMBridge._get_transformer_layer_spec",
        ("mbridge", "megatron-core"),
        required=True,
    )
    from areal.engine.megatron_model import local_layer_spec

    bridge._get_transformer_layer_spec = functools.partial(local_layer_spec, bridge)
    # mbridge's own method sets this flag as it runs; the local spec takes vp_stage too
    bridge.has_vp_stage = True


_LOCAL_EXPERT = re.compile(r"(.*\.mlp\.experts)\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def patch_bridge_expert_names(bridge: Any) -> None:
    """Name local ``SequentialMLP`` experts as the grouped experts mbridge's mappings know."""
    _may_patch(
        "mbridge.core.bridge.Bridge._weight_name_mapping_mcore_local_to_global",
        ("mbridge",),
        required=True,
    )
    current = bridge._weight_name_mapping_mcore_local_to_global
    if isinstance(current, functools.partial) and current.func is _grouped_expert_names:
        return
    bridge._weight_name_mapping_mcore_local_to_global = functools.partial(
        _grouped_expert_names, bridge, current
    )


def _grouped_expert_names(bridge: Any, original: Any, model: Any, consider_ep: bool = True):
    """mbridge's local-to-global name map, with local experts named as grouped ones.

    Without Transformer Engine, Megatron builds MoE experts as ``SequentialMLP``, whose
    parameters are ``...mlp.experts.local_experts.{i}.linear_fc1.weight``; mbridge's HF
    mappings know the grouped names ``...mlp.experts.linear_fc1.weight{i}``. Expert
    indices become global (``i + experts_per_rank * ep_rank``) when ``consider_ep``.
    """
    names = original(model, consider_ep=False)  # pipeline layer numbering only
    per_rank = bridge.config.num_moe_experts // bridge.mpu.ep_size
    offset = per_rank * bridge.mpu.ep_rank if consider_ep else 0
    for local, name in names.items():
        match = _LOCAL_EXPERT.match(name)
        if match:
            prefix, index, linear = match.groups()
            names[local] = f"{prefix}.{linear}.weight{int(index) + offset}"
    return names


def patch_bridge_local_expert_loading(bridge: Any) -> None:
    """After mbridge's ``load_weights``, each rank loads its own local experts again.

    mbridge tells expert weights by their local name (``...mlp.experts.linear_fc1...``,
    grouped experts). Local ``SequentialMLP`` experts are named ``local_experts.{i}``, so
    mbridge loads them as it loads attention weights: tensor-parallel rank 0 reads them and
    scatters them over its tensor-parallel group. With expert parallelism over those ranks
    (attention ``t`` > 1, experts ``etp`` 1, ``e`` > 1) the group's other ranks hold other
    experts, and got rank 0's instead. Each rank then reads the experts it holds.
    """
    _may_patch("mbridge.core.bridge.Bridge.load_weights", ("mbridge",), required=True)
    current = bridge.load_weights
    if isinstance(current, functools.partial) and current.func is _load_weights_then_experts:
        return
    bridge.load_weights = functools.partial(_load_weights_then_experts, bridge, current)


def _load_weights_then_experts(
    bridge: Any, original: Any, models: list, weights_path: str, *args: Any, **kwargs: Any
) -> None:
    original(models, weights_path, *args, **kwargs)
    mpu = bridge.mpu
    if mpu.tp_size == 1 or mpu.ep_size == 1 or mpu.etp_size != 1:
        return  # the scatter over t handed every rank its own experts
    io = bridge._get_safetensor_io(weights_path)
    for model in models:
        state = model.state_dict()
        names = {
            local: name
            for local, name in bridge._weight_name_mapping_mcore_local_to_global(model).items()
            if ".mlp.experts.local_experts." in local and "_extra_state" not in local
        }
        for local, name in names.items():
            hf_names = bridge._weight_name_mapping_mcore_to_hf(name)
            tensors = io.load_some_hf_weight(hf_names)
            weight = bridge._weight_to_mcore_format(local, [tensors[n] for n in hf_names])
            param = state[local]
            with torch.no_grad():
                param.copy_(weight.to(param.device, dtype=param.dtype))


# --- megatron-core: the MoE router without Transformer Engine ---


def patch_moe_router_gemm() -> None:
    """Define ``moe_utils.te_general_gemm = None``: the router reads it, only TE defines it."""
    _may_patch(
        "megatron.core.transformer.moe.moe_utils.te_general_gemm", ("megatron-core",), required=True
    )
    from megatron.core.transformer.moe import moe_utils

    # None is what the router's own fallback (a plain matmul) tests for
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


# --- megatron-core: multi-latent attention without Transformer Engine ---


def patch_mla_without_te() -> None:
    """Set ``multi_latent_attention.HAVE_TE = False`` when its TE classes are stand-ins.

    MLA imports TE's linears from a module that imports without TE and leaves mock objects
    behind, so it believes TE is present and its ``isinstance(..., TELinear)`` raises while
    building the layer; without TE it takes the local-module path it has for that case.
    """
    _may_patch(
        "megatron.core.transformer.multi_latent_attention.HAVE_TE",
        ("megatron-core",),
        required=True,
    )
    from megatron.core.transformer import multi_latent_attention

    if multi_latent_attention.HAVE_TE and not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False


# --- megatron-core: rotary embedding for packed streams, without host syncs ---


def patch_packed_rope() -> bool:
    """Route attention's unfused THD rotary calls through :func:`_packed_rope`, which never syncs.

    Megatron's version copies the segment lengths to the host on every call (twice per
    layer per micro-batch), which left the GPU idle half of a training step. Under context
    parallelism the engine's streams are a rank's zigzag share of the padded global stream
    whose bounds ``cu_seqlens`` gives; each token gets its global in-sequence position
    (:func:`_zigzag_positions`). Fused rotary (Transformer Engine) and YaRN scaling keep
    Megatron's own path. Multi-latent attention imports the same function under its own
    name; it is routed too. Returns whether the patch is in place.
    """
    if not _may_patch(
        "megatron.core.transformer.attention.apply_rotary_pos_emb",
        ("megatron-core",),
        required=False,
    ):
        return False
    from megatron.core.transformer import attention, multi_latent_attention

    original = attention.apply_rotary_pos_emb
    if getattr(original, "_areal_packed", False):
        return True

    def apply_rotary_pos_emb(t, freqs, config, cu_seqlens=None, mscale=1.0, cp_group=None):
        if cu_seqlens is None or config.apply_rope_fusion or mscale != 1.0:
            return original(t, freqs, config, cu_seqlens=cu_seqlens, mscale=mscale,
                            cp_group=cp_group)  # fmt: skip
        size = cp_group.size() if cp_group is not None else 1
        share = (size, cp_group.rank()) if size > 1 else (1, 0)
        return _packed_rope(
            t, freqs, cu_seqlens, config.rotary_interleaved, config.multi_latent_attention,
            compiled=getattr(config, COMPILED_ROPE_ATTR, False), context_share=share,
        )  # fmt: skip

    apply_rotary_pos_emb._areal_packed = True
    attention.apply_rotary_pos_emb = apply_rotary_pos_emb
    if multi_latent_attention.apply_rotary_pos_emb is original:
        multi_latent_attention.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True


def enable_compiled_rope(model_chunks: list[torch.nn.Module]) -> None:
    """Mark the chunks' ``TransformerConfig`` s so the packed rotary embedding runs compiled."""
    configs = {id(m.config): m.config for chunk in model_chunks for m in chunk.modules()
               if getattr(m, "config", None) is not None}  # fmt: skip
    for config in configs.values():
        setattr(config, COMPILED_ROPE_ATTR, True)


def _packed_positions(n_tokens: int, rows: int, cu_seqlens: torch.Tensor, device) -> torch.Tensor:
    """Each token's position in its own segment (``[T]`` long), found on the device; all
    of ``0..T-1`` when ``freqs`` has a row per stream token (Megatron's offset mode)."""
    index = torch.arange(n_tokens, device=device, dtype=torch.long)
    if rows == n_tokens:
        return index
    bounds = cu_seqlens.to(device=device, dtype=torch.long)
    segment = torch.searchsorted(bounds[1:].contiguous(), index, right=True)
    return index - bounds[segment.clamp(max=bounds.numel() - 2)]


def _zigzag_positions(
    n_local: int, cu_seqlens: torch.Tensor, size: int, rank: int, device
) -> torch.Tensor:
    """Global in-sequence positions (``[T / c]`` long) of a context-parallel rank's tokens.

    ``cu_seqlens``: the padded global stream's bounds (every length a multiple of ``2c``).
    The rank holds, per sequence, chunk ``rank`` then chunk ``2c - 1 - rank`` of its ``2c``
    chunks (:mod:`areal.engine.context_parallel`); found on the device, without host syncs.
    """
    bounds = cu_seqlens.to(device=device, dtype=torch.long) // size  # local sequence bounds
    index = torch.arange(n_local, device=device, dtype=torch.long)
    segment = torch.searchsorted(bounds[1:].contiguous(), index, right=True)
    segment = segment.clamp(max=bounds.numel() - 2)
    offset = index - bounds[segment]
    chunk = (bounds[segment + 1] - bounds[segment]) // 2
    late = offset >= chunk
    first = torch.where(late, (2 * size - 2 - rank) * chunk, rank * chunk)
    return first + offset


def _rope_at(
    t: torch.Tensor,
    freqs: torch.Tensor,
    positions: torch.Tensor,
    rotary_interleaved: bool,
    multi_latent_attention: bool,
) -> torch.Tensor:
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    rotated = _apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),
        freqs[positions],
        rotary_interleaved=rotary_interleaved,
        multi_latent_attention=multi_latent_attention,
    )
    return rotated.squeeze(1)


def _packed_rope(
    t: torch.Tensor,
    freqs: torch.Tensor,
    cu_seqlens: torch.Tensor,
    rotary_interleaved: bool,
    multi_latent_attention: bool,
    compiled: bool = False,
    context_share: tuple[int, int] = (1, 0),
) -> torch.Tensor:
    """Megatron's unfused THD rotary embedding without its per-call ``tolist()``.

    ``t`` ``[T, H, D]``, ``freqs`` ``[S, 1, 1, d]``, ``cu_seqlens`` ``[n + 1]`` on the device.
    Token ``i`` of the segment starting at ``cu_seqlens[k]`` gets ``freqs[i - cu_seqlens[k]]``
    (``freqs[i]`` when ``freqs`` covers the whole stream, as Megatron's offset mode does):
    the same values as Megatron's split-and-concatenate loop (one context-parallel rank),
    found on the device, so no layer waits for the host.

    ``context_share`` ``(c, rank)``: with ``c > 1`` ``t`` is that rank's zigzag share of
    the stream ``cu_seqlens`` bounds, and ``freqs`` is indexed by global in-sequence
    positions (:func:`_zigzag_positions`).

    ``compiled`` (``use_kernels``): the frequency lookup, cos/sin and rotation run as one
    ``torch.compile`` graph instead of a dozen memory passes; if the compiler fails on this
    platform, a warning says so and the eager maths is used from then on.
    """
    global _ROPE_COMPILE_FAILED
    size, rank = context_share
    if size > 1:
        positions = _zigzag_positions(t.shape[0], cu_seqlens, size, rank, t.device)
    else:
        positions = _packed_positions(t.shape[0], freqs.shape[0], cu_seqlens, t.device)
    args = (t, freqs, positions, rotary_interleaved, multi_latent_attention)
    if compiled and not _ROPE_COMPILE_FAILED:
        try:
            return _compiled_rope_at()(*args)
        except Exception as e:  # an Inductor lowering missing on this platform
            _ROPE_COMPILE_FAILED = True
            logger.warning("compiled rotary embedding failed (%s); using the eager one", e)
    return _rope_at(*args)


_ROPE_COMPILE_FAILED = False


@functools.cache
def _compiled_rope_at():
    return torch.compile(_rope_at, dynamic=True)


# --- megatron-core: gradient norm without Apex, without a host sync per parameter ---


def patch_foreach_l2_norm() -> bool:
    """Swap Megatron's Apex-less L2-norm fallback for :func:`_foreach_l2_norm`, which never syncs.

    Returns whether the patch is in place (an Apex kernel, when installed, is kept).
    """
    if not _may_patch(
        "megatron.core.optimizer.clip_grads.l2_norm_impl", ("megatron-core",), required=False
    ):
        return False
    from megatron.core import utils
    from megatron.core.optimizer import clip_grads

    if clip_grads.l2_norm_impl is utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = _foreach_l2_norm
    return clip_grads.l2_norm_impl is _foreach_l2_norm


def _foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """Drop-in for Megatron's Apex-less ``multi_tensor_l2norm`` fallback: the global L2 norm
    of every tensor, as a ``[1]`` float32 tensor on their device.

    Megatron's fallback reads each parameter's norm on the host (one GPU wait per
    parameter, twice per step); ``torch._foreach_norm`` keeps it on the device.
    """
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    if not tensors:
        return torch.zeros(1, dtype=torch.float32, device=noop_flag.device), None
    norms = torch.stack([n.float() for n in torch._foreach_norm(tensors)])
    return torch.linalg.vector_norm(norms).reshape(1), None


# --- megatron-core: an output layer that hands its input through ---


def pass_hidden_through_output_layer(head: torch.nn.Module, weights: list[torch.Tensor]) -> bool:
    """Make the LM head return its input, so the loss computes log-probs from it in chunks.

    The weight the head would have used (tied or its own, after any pre-hook) is appended
    to ``weights`` for the loss function of the same micro-batch. Returns whether the
    patch is in place; without it the engine keeps Megatron's full-logits head.
    """
    if not _may_patch(
        "megatron.core.tensor_parallel.ColumnParallelLinear.forward",
        ("megatron-core",),
        required=False,
    ):
        return False
    head.forward = functools.partial(_pass_hidden_through, head, weights)
    return True


def _pass_hidden_through(
    head: torch.nn.Module,
    weights: list[torch.Tensor],
    input_: torch.Tensor,
    weight: torch.Tensor | None = None,
    runtime_gather_output: bool | None = None,
):
    """The output layer's ``forward`` for the chunked head (same signature as Megatron's)."""
    del runtime_gather_output  # one tensor-parallel rank: nothing to gather
    weights.append(head.weight if weight is None else weight)
    return input_, None
