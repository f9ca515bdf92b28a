"""Loading experiment configs: YAML + Hydra defaults + overrides -> validated dataclasses.

``load_expr_config`` composes the YAML with Hydra (so a profile may inherit a sibling
through ``defaults: [base, _self_]`` and take ``a.b=1`` / ``+x=1`` / ``~key`` overrides),
rejects keys that are not dataclass fields, resolves ``${...}`` and ``${oc.env:...}`` in
the controller's environment, builds the dataclass tree (running every validator) and
saves a redacted ``config.yaml`` next to the logs. Every error names the dotted path of
the offending key.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import difflib
import os
import re
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import OverrideType
from hydra.errors import HydraException
from omegaconf import DictConfig, ListConfig, OmegaConf, SCMode
from omegaconf.errors import (
    InterpolationResolutionError,
    MissingMandatoryValue,
    OmegaConfBaseException,
)

from areal.api.config.fields import ConfigError, FieldError, plain_secrets
from areal.utils import logging, name_resolve
from areal.utils.config_utils import redact_sensitive_config
from areal.utils.paths import get_log_path, make_private_dirs

__all__ = [
    "check_known_keys",
    "conf_as_dict",
    "instantiate_config",
    "load_expr_config",
    "parse_cli_args",
    "save_config",
    "to_structured_cfg",
    "unused_fields_set",
    "warn_unused_fields",
]

logger = logging.getLogger("config")
ConfigT = TypeVar("ConfigT")

_LEGACY_ACTOR_KEYS = ("behave_imp_weight_cap", "behave_imp_weight_mode")


# --- command line and Hydra composition ---


def parse_cli_args(argv: list[str], config_cls: type | None = None) -> tuple[DictConfig, Path]:
    """Compose ``--config <yaml>`` with the remaining argv tokens as Hydra overrides.

    A leading ``*.py`` token (the script path of ``python train.py ...`` or of
    ``python -m pkg.train ...`` when ``sys.argv`` is passed whole) is dropped. Given
    ``config_cls``, a plain ``a.b=1`` override of a dataclass field that the YAML leaves
    out is applied as ``+a.b=1`` (Hydra alone would insist on the ``+``), and one naming
    no field at all is rejected with a suggestion.
    """
    argv = list(argv)
    if argv and argv[0].endswith(".py"):
        argv = argv[1:]
    parser = argparse.ArgumentParser(
        description="Experiment config: --config FILE.yaml [hydra overrides such as a.b=1]"
    )
    parser.add_argument("--config", required=True, help="YAML experiment config")
    args, overrides = parser.parse_known_args(argv)
    config_file = Path(args.config).expanduser().absolute()
    if not config_file.is_file():
        raise ConfigError(f"--config {args.config}: no such file ({config_file})")
    if config_cls is not None and overrides:
        base = OmegaConf.to_container(compose_yaml(config_file), resolve=False)
        overrides = _normalize_overrides(overrides, base, config_cls)
    return compose_yaml(config_file, overrides), config_file


def compose_yaml(config_file: Path, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """Hydra-compose one YAML (its ``defaults`` list names siblings by stem)."""
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(
            config_dir=str(config_file.parent), job_name="app", version_base=None
        ):
            return compose(config_name=config_file.stem, overrides=list(overrides))
    except (HydraException, OmegaConfBaseException, yaml.YAMLError) as e:
        raise ConfigError(f"cannot compose {config_file}: {e}") from e
    finally:
        GlobalHydra.instance().clear()


def _normalize_overrides(overrides: list[str], base: Any, config_cls: type) -> list[str]:
    try:
        parsed = OverridesParser.create().parse_overrides(overrides)
    except HydraException as e:
        raise ConfigError(f"bad command-line override: {e}") from e
    result = []
    for override in parsed:
        line = override.input_line
        if override.type == OverrideType.CHANGE and override.package is None:
            key = override.key_or_group
            if not _yaml_has_key(base, key):
                _check_override_path(config_cls, key)
                line = "+" + line
        result.append(line)
    return result


def _yaml_has_key(data: Any, dotted: str) -> bool:
    node = data
    parts = dotted.split(".")
    for i, part in enumerate(parts):
        if _is_interpolation(node):
            parent = ".".join(parts[:i])
            raise ConfigError(
                f"override '{dotted}=...': '{parent}' is the interpolation {node} in the "
                f"YAML; override the key it points to, or replace '{parent}' whole"
            )
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return False
    return True


def _check_override_path(config_cls: type, dotted: str) -> None:
    """Raise unless ``dotted`` names a field path of ``config_cls`` (list parts are ints)."""
    tp: Any = config_cls
    walked: list[str] = []
    for part in dotted.split("."):
        tp = _strip_optional(tp)
        origin = typing.get_origin(tp)
        if dataclasses.is_dataclass(tp):
            names = [f.name for f in dataclasses.fields(tp)]
            if part not in names:
                path = ".".join([*walked, part])
                close = difflib.get_close_matches(part, names, n=1)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ConfigError(
                    f"unknown config key '{path}' in override '{dotted}=...': "
                    f"{tp.__name__} has no field '{part}'{hint}"
                )
            tp = typing.get_type_hints(tp)[part]
        elif origin in (list, tuple) and part.isdigit():
            tp = (typing.get_args(tp) or (Any,))[0]
        elif origin is dict:
            args = typing.get_args(tp)
            tp = args[1] if len(args) == 2 else Any
        elif tp is Any:
            return
        else:
            raise ConfigError(
                f"override '{dotted}=...': '{'.'.join(walked)}' is a single value, not a section"
            )
        walked.append(part)


# --- key checking against the dataclass tree ---


def _is_interpolation(value: Any) -> bool:
    return isinstance(value, str) and "${" in value


def _strip_optional(tp: Any) -> Any:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return tp


def check_known_keys(data: Any, config_cls: type, path: str = "") -> None:
    """Raise :class:`ConfigError` for the first key that is not a dataclass field.

    ``data`` is a plain (unresolved) mapping; interpolations are not followed. Paths are
    dotted with list indices, e.g. ``econfig.arena_streams[1].harnes``.
    """
    if not isinstance(data, dict):
        return
    hints = typing.get_type_hints(config_cls)
    names = [f.name for f in dataclasses.fields(config_cls)]
    for key, value in data.items():
        key_path = f"{path}.{key}" if path else str(key)
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ConfigError(
                f"unknown config key '{key_path}': {config_cls.__name__} has no field "
                f"'{key}'{hint}; fix the spelling or remove it"
            )
        _check_value(value, hints[key], key_path)


def _check_value(value: Any, tp: Any, path: str) -> None:
    if _is_interpolation(value) or value is None:
        return
    tp = _strip_optional(tp)
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, dict):
            check_known_keys(value, tp, path)
    elif origin in (list, tuple) and isinstance(value, list):
        (item_type, *_) = typing.get_args(tp) or (Any,)
        for i, item in enumerate(value):
            _check_value(item, item_type, f"{path}[{i}]")
    elif origin is dict and isinstance(value, dict):
        args = typing.get_args(tp)
        if len(args) == 2:
            for k, v in value.items():
                _check_value(v, args[1], f"{path}.{k}")


def _check_legacy_keys(data: dict[str, Any]) -> None:
    if "launcher" in data:
        raise ConfigError(
            "config key 'launcher' was removed: per-role resources, images, env vars and "
            "extra bash commands now live in each engine's scheduling_spec "
            "(e.g. actor.scheduling_spec[0].mem, rollout.scheduling_spec[0].env_vars)"
        )
    for section in ("actor", "teacher"):
        block = data.get(section)
        if isinstance(block, dict):
            for key in _LEGACY_ACTOR_KEYS:
                if key in block:
                    raise ConfigError(
                        f"config key '{section}.{key}' was replaced by "
                        f"'{section}.rejection_sampling' (e.g. behave_imp_weight_cap: 5 -> "
                        "rejection_sampling: {metric: ratio, upper: 5.0, action: mask})"
                    )


# --- merge, resolve, build ---


def _omegaconf_message(e: OmegaConfBaseException) -> str:
    msg = getattr(e, "msg", None) or str(e)
    return msg.splitlines()[0] if msg else type(e).__name__


def to_structured_cfg(cfg: DictConfig, config_cls: type) -> DictConfig:
    """Merge a composed YAML onto the dataclass defaults (unknown keys rejected)."""
    data = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(data, dict)
    _check_legacy_keys(data)
    check_known_keys(data, config_cls)
    try:
        # OmegaConf builds nodes from class defaults (here and for list items while
        # merging): secret defaults must enter it as their values, not their printed form
        with plain_secrets():
            return OmegaConf.merge(OmegaConf.structured(config_cls), cfg)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "<root>"
        raise ConfigError(f"config key '{key}': {_omegaconf_message(e)}") from e


_ENV_NOT_FOUND = re.compile(r"Environment variable '([^']+)' not found")


def _resolve(cfg: DictConfig) -> dict[str, Any]:
    try:
        data = OmegaConf.to_container(
            cfg, resolve=True, throw_on_missing=True, structured_config_mode=SCMode.DICT
        )
    except MissingMandatoryValue as e:
        key = getattr(e, "full_key", "?")
        raise ConfigError(
            f"config key '{key}' is required and has no value: set it in the YAML or pass "
            f"{key}=VALUE on the command line"
        ) from e
    except InterpolationResolutionError as e:
        key = getattr(e, "full_key", "?")
        match = _ENV_NOT_FOUND.search(str(e))
        if match:
            var = match.group(1)
            raise ConfigError(
                f"config key '{key}': environment variable {var} is not set; export "
                f"{var}=... or give the YAML a default with ${{oc.env:{var},<default>}}"
            ) from e
        raise ConfigError(f"config key '{key}': {_omegaconf_message(e)}") from e
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "<root>"
        raise ConfigError(f"config key '{key}': {_omegaconf_message(e)}") from e
    assert isinstance(data, dict)
    return data


def _build(tp: Any, value: Any, path: str) -> Any:
    tp = _strip_optional(tp)
    if value is None:
        return None
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp) and isinstance(value, dict):
        return _build_dataclass(tp, value, path)
    if origin in (list, tuple) and isinstance(value, list):
        (item_type, *_) = typing.get_args(tp) or (Any,)
        items = [_build(item_type, v, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict and isinstance(value, dict):
        args = typing.get_args(tp)
        item_type = args[1] if len(args) == 2 else Any
        return {k: _build(item_type, v, f"{path}.{k}") for k, v in value.items()}
    return value


def _build_dataclass(config_cls: type, data: dict[str, Any], path: str) -> Any:
    hints = typing.get_type_hints(config_cls)
    kwargs = {
        f.name: _build(hints[f.name], data[f.name], f"{path}.{f.name}" if path else f.name)
        for f in dataclasses.fields(config_cls)
        if f.init and f.name in data
    }
    try:
        return config_cls(**kwargs)
    except FieldError as e:
        raise e.with_prefix(path) from None
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"config key '{path or '<root>'}': {e}") from e


def instantiate_config(cfg: DictConfig, config_cls: type[ConfigT]) -> ConfigT:
    """Resolve interpolations and build the dataclass tree, validating every node."""
    return _build_dataclass(config_cls, _resolve(cfg), "")


# --- saving ---


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def conf_as_dict(cfg: Any) -> dict[str, Any]:
    """A plain dict of a config: resolved for OmegaConf objects, field by field otherwise.

    Secret fields stay :class:`~areal.utils.secrets.SecretStr` (they print redacted);
    use :func:`~areal.utils.config_utils.redact_sensitive_config` before saving elsewhere.
    """
    if isinstance(cfg, (DictConfig, ListConfig)):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return _plain(cfg)


def save_config(cfg: Any, log_dir: str | os.PathLike[str]) -> Path:
    """Write ``config.yaml`` (secrets redacted, fields in declaration order) to ``log_dir``.

    The file is readable by its owner only (0600), as are the directories created for it
    (0700): redaction is by rule, and a run's settings are nobody else's business.
    """
    path = Path(log_dir)
    make_private_dirs(path)
    target = path / "config.yaml"
    text = yaml.safe_dump(
        redact_sensitive_config(conf_as_dict(cfg)), sort_keys=False, allow_unicode=True
    )
    tmp = target.with_suffix(f".yaml.{os.getpid()}.tmp")
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        os.fchmod(fd, 0o600)  # a leftover temp file may have had other bits
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            fd = -1
            f.write(text)
        os.replace(tmp, target)
    except BaseException:
        if fd != -1:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    return target


# --- fields that are accepted but read by nothing ---

# Fields kept so that AReaL configs load unchanged, but that nothing in this port reads,
# by the config class that declares them. Setting one to a value other than its default
# warns once per run, naming the field, instead of silently doing nothing. (Fields whose
# only effect is refused at load, e.g. the LoRA ones, SAPO's and the overlong penalty's,
# are left out: the flag that would use them already fails with its own message.)
UNUSED_FIELDS: dict[str, tuple[str, ...]] = {
    "BaseExperimentConfig": (
        "allocation_mode",
        "total_train_n_seqs",
        "post_exit_hook",
        "memory_profiler",
    ),
    "PPOConfig": ("teacher",),
    "SchedulerConfig": (
        "deploy_mode",
        "functioncall_service_domain",
        "reward_functioncall_config",
        "reward_model_path",
        "reward_model_service_url",
    ),
    "_DatasetConfig": ("dataset_kwargs", "num_dataset_workers", "num_workers", "pin_memory"),
    "PerfTracerConfig": ("enabled", "save_interval", "profile_steps"),
    "SessionTracerConfig": ("enabled", "flush_threshold"),
    "GenerationHyperparameters": ("use_beam_search",),
    "AgentConfig": ("agent_cls_path", "set_reward_finish_timeout"),
    "InferenceEngineConfig": (
        "api_url",
        "provider_api_key",
        "check_trajectory_format",
        "return_routed_experts",
        "routing_strategy",
        "serialize_group_samples",
        "workers_ready_timeout",
    ),
    "TrainEngineConfig": (
        "attn_impl",
        "optimizer_dtype",
        "enable_tree_training",
        "is_critic",
        "enable_delta_weight_update",
        "weight_update_anchor_interval",
        "weight_update_delta_method",
    ),
    "PPOActorConfig": ("log_agent_stats", "log_agent_stats_keys", "m2_threshold"),
    "FSDPEngineConfig": (
        "offload_params",
        "memory_efficient_load",
        "optim_step_prefetch_layers",
        "per_layer_optim_step",
        "shard_vision_across_sp",
    ),
    "MegatronEngineConfig": (
        "async_save",
        "bridge_type",
        "cross_entropy_loss_fusion",
        "disable_grad_buffers_cpu_backup",
        "distribute_saved_activations",
        "enable_chunked_logits",
        "enable_mtp",
        "entropy_requires_grad",
        "exp_avg_dtype",
        "exp_avg_sq_dtype",
        "fp8_config",
        "lm_head_loss_chunk_size",
        "main_grads_dtype",
        "main_params_dtype",
        "moe_enable_deepep",
        "moe_permute_fusion",
        "moe_router_fusion",
        "moe_shared_expert_overlap",
        "overlap_param_gather_with_optimizer_step",
        "use_bridge_for_update_weights",
        "use_checkpoint_opt_param_scheduler",
        "use_custom_fsdp",
        "use_mbridge_save",
        "use_torch_fsdp2",
    ),
}
_warned_unused: set[str] = set()


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def unused_fields_set(cfg: Any, path: str = "") -> list[tuple[str, dataclasses.Field]]:
    """``(dotted path, field)`` of every field of :data:`UNUSED_FIELDS` that ``cfg`` sets
    to a value other than its default."""
    found: list[tuple[str, dataclasses.Field]] = []
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        return found
    unused = {name for cls in type(cfg).__mro__ for name in UNUSED_FIELDS.get(cls.__name__, ())}
    for f in dataclasses.fields(cfg):
        dotted = f"{path}.{f.name}" if path else f.name
        value = getattr(cfg, f.name)
        if f.name in unused:
            default = _default(f)
            if default is not dataclasses.MISSING and value != default:
                found.append((dotted, f))
                continue  # an unused section: nothing inside it matters either
        if dataclasses.is_dataclass(value):
            found.extend(unused_fields_set(value, dotted))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                found.extend(unused_fields_set(item, f"{dotted}[{i}]"))
    return found


def warn_unused_fields(cfg: Any) -> list[str]:
    """Warn once per run about each accepted-but-unused field ``cfg`` sets; their paths."""
    paths = []
    for dotted, f in unused_fields_set(cfg):
        paths.append(dotted)
        if dotted in _warned_unused:
            continue
        _warned_unused.add(dotted)
        default = "" if f.metadata.get("secret") else f" (default {_default(f)!r})"
        logger.warning(
            "config key '%s' is set but this port never reads it, so it has no effect; "
            "remove it or keep its default%s",
            dotted,
            default,
        )
    return paths


# --- the entry point ---


def load_expr_config(argv: list[str], config_cls: type[ConfigT]) -> tuple[ConfigT, str]:
    """Parse ``--config FILE [overrides...]`` into a validated ``config_cls`` instance.

    Returns ``(config, config_file_path)``. Side effects: name resolution is configured
    from ``cluster.name_resolve``, and on rank 0 (``RANK`` unset or ``0``) the redacted
    config is saved to ``{stats_logger.fileroot}/logs/{user}/{experiment}/{trial}/``.
    """
    composed, config_file = parse_cli_args(argv, config_cls)
    structured = to_structured_cfg(composed, config_cls)
    cfg = instantiate_config(structured, config_cls)
    warn_unused_fields(cfg)
    cluster = getattr(cfg, "cluster", None)
    if cluster is not None:
        try:
            name_resolve.reconfigure(cluster.name_resolve)
        except ValueError as e:
            raise ConfigError(str(e)) from e
    stats = getattr(cfg, "stats_logger", None)
    if stats is not None and os.environ.get("RANK", "0") == "0":
        log_dir = get_log_path(stats.fileroot, cfg.experiment_name, cfg.trial_name)
        saved = save_config(cfg, log_dir)
        logger.info("Config loaded from %s; saved (redacted) to %s", config_file, saved)
    return cfg, str(config_file)
