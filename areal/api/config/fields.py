"""Building blocks for config dataclasses: documented fields, choices, secrets, errors."""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from omegaconf import MISSING

from areal.utils import logging
from areal.utils.secrets import REDACTED, SecretStr

__all__ = [
    "MISSING",
    "ConfigError",
    "ConfigNode",
    "FieldError",
    "cfg_field",
    "plain_secrets",
    "secret_fields",
]

logger = logging.getLogger("config")

# While set, config nodes keep secret fields as plain ``str``. OmegaConf stores a string
# field as ``str(value)``, which for a SecretStr is its printed form ``<redacted>``: a
# schema built from wrapped defaults would replace every non-empty secret default with it.
_PLAIN_SECRETS: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "areal_plain_secrets", default=False
)


@contextlib.contextmanager
def plain_secrets() -> Iterator[None]:
    """Build config nodes whose secret fields stay plain ``str`` (for OmegaConf schemas)."""
    token = _PLAIN_SECRETS.set(True)
    try:
        yield
    finally:
        _PLAIN_SECRETS.reset(token)


class ConfigError(ValueError):
    """An invalid experiment config. The message names the dotted path of the bad key."""


class FieldError(ConfigError):
    """A validation failure of one field; the loader prefixes the field's full path.

    ``field`` is relative to the dataclass that raised (it may itself be dotted, for
    cross-field rules such as ``actor.reward_norm`` raised by ``PPOConfig``).
    """

    def __init__(self, field: str, message: str):
        self.field = field
        self.message = message
        super().__init__(f"{field}: {message}")

    def with_prefix(self, prefix: str) -> FieldError:
        path = f"{prefix}.{self.field}" if prefix else self.field
        return FieldError(path, self.message)


def cfg_field(
    default: Any = dataclasses.MISSING,
    *,
    help: str,
    factory: Callable[[], Any] | None = None,
    choices: Sequence[Any] | None = None,
    secret: bool = False,
) -> Any:
    """A dataclass field with a one-line ``help`` (unit and meaning).

    ``choices`` closes the set of accepted values (checked when the node is built);
    ``secret`` makes the value a :class:`SecretStr`, redacted wherever it is printed
    or saved.
    """
    metadata: dict[str, Any] = {"help": help}
    if choices is not None:
        metadata["choices"] = tuple(choices)
    if secret:
        metadata["secret"] = True
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@functools.cache
def _checked_fields(cls: type) -> tuple[tuple[str, Any, bool], ...]:
    """``(name, choices, secret)`` of the fields ``__post_init__`` must look at."""
    return tuple(
        (f.name, f.metadata.get("choices"), bool(f.metadata.get("secret")))
        for f in dataclasses.fields(cls)
        if f.metadata.get("choices") is not None or f.metadata.get("secret")
    )


@dataclasses.dataclass
class ConfigNode:
    """Base of every config dataclass: checks choices, wraps secrets, then ``validate``.

    Subclasses put cross-field rules in :meth:`validate` (calling ``super().validate()``)
    and raise :class:`FieldError` naming the field, so that a failure in a nested node
    is reported with its full dotted path by the loader.
    """

    def __post_init__(self) -> None:
        for name, choices, secret in _checked_fields(type(self)):
            value = getattr(self, name)
            if value == MISSING:
                continue
            if choices is not None and value not in choices:
                shown = ", ".join(repr(c) for c in choices)
                raise FieldError(name, f"{value!r} is not one of {shown}")
            if secret and isinstance(value, str):
                if value.strip() == REDACTED:
                    raise FieldError(
                        name,
                        f"is the redacted placeholder {REDACTED!r}, the printed form of a "
                        "secret (e.g. copied from a saved config.yaml or a log); set the real "
                        "value, or leave it unset where an unset key is generated per run",
                    )
                if not isinstance(value, SecretStr) and not _PLAIN_SECRETS.get():
                    setattr(self, name, SecretStr(value))
        self.validate()

    def validate(self) -> None:
        """Cross-field rules; raise :class:`FieldError` on failure."""

    @staticmethod
    def warn(message: str) -> None:
        logger.warning(message)


def secret_fields(node: Any, prefix: str = "") -> list[str]:
    """Dotted paths of every secret field in a config tree (for docs and checks)."""
    found: list[str] = []
    if not dataclasses.is_dataclass(node):
        return found
    for f in dataclasses.fields(node):
        path = f"{prefix}.{f.name}" if prefix else f.name
        if f.metadata.get("secret"):
            found.append(path)
        value = getattr(node, f.name)
        if dataclasses.is_dataclass(value):
            found.extend(secret_fields(value, path))
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                found.extend(secret_fields(item, f"{path}[{i}]"))
    return found
