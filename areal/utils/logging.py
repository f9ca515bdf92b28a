"""Named, coloured loggers under ``areal.*``, file logging, and secret masking.

Every record passes a filter that replaces registered secret values (Arena tokens, the
proxy admin key, ...) with ``<redacted>`` and the user-info, query values and fragment of
every URL with ``***``, so a secret that slips into a message or an exception text never
reaches a console or a log file.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from pathlib import Path

from areal.utils.secrets import REDACTED, redact_urls, reveal

__all__ = [
    "SecretMaskingFilter",
    "getLogger",
    "register_secret",
    "register_secrets_from_env",
    "setup_file_logging",
    "stop_file_logging",
]

ROOT = "areal"
LOG_FORMAT = "%(asctime)s.%(msecs)03d %(name)s %(levelname)s: %(message)s"
DATE_FORMAT = "%Y%m%d-%H:%M:%S"
# Environment variables whose values are always masked when set.
SECRET_ENV_VARS = (
    "ARENA_OPENAPI_TOKEN",
    "ARENA_LLM_API_KEY",
    "SWE_RL_ADMIN_API_KEY",
    "AREAL_RPC_TOKEN",
    "AREAL_INFERENCE_API_KEY",
    "WANDB_API_KEY",
    "SWANLAB_API_KEY",
)
_MIN_SECRET_LEN = 4  # shorter values would mask innocent text

_secrets: set[str] = set()
_secrets_lock = threading.Lock()
_configured = False

_COLORS = {
    logging.DEBUG: "\033[2m",
    logging.INFO: "\033[36m",
    logging.WARNING: "\033[33m",
    logging.ERROR: "\033[31m",
    logging.CRITICAL: "\033[1;31m",
}
_RESET = "\033[0m"


def register_secret(value: str | None) -> None:
    """Mask ``value`` in every record logged from now on.

    Surrounding whitespace is dropped first: a key read with its trailing newline is
    masked wherever the bare key appears (a header, an error message).
    """
    plain = reveal(value).strip()
    if len(plain) >= _MIN_SECRET_LEN:
        with _secrets_lock:
            _secrets.add(plain)


def register_secrets_from_env() -> None:
    """Register the values of the well-known secret environment variables."""
    for name in SECRET_ENV_VARS:
        register_secret(os.environ.get(name))


def mask_secrets(text: str) -> str:
    """``text`` with every registered secret replaced by ``<redacted>`` and the secret
    parts of every URL (user-info, query values, fragment) by ``***``."""
    with _secrets_lock:
        secrets = sorted(_secrets, key=len, reverse=True)
    for secret in secrets:
        if secret in text:
            text = text.replace(secret, REDACTED)
    return redact_urls(text)


class SecretMaskingFilter(logging.Filter):
    """Rewrites a record's message (with its arguments and exception) without secrets."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        masked = mask_secrets(message)
        if masked != message:
            record.msg, record.args = masked, None
        if record.exc_text:
            record.exc_text = mask_secrets(record.exc_text)
        return True


class _ColorFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        color = _COLORS.get(record.levelno)
        return f"{color}{text}{_RESET}" if color else text


def _configure_root() -> logging.Logger:
    global _configured
    root = logging.getLogger(ROOT)
    if _configured:
        return root
    _configured = True
    register_secrets_from_env()
    root.setLevel(os.environ.get("AREAL_LOG_LEVEL", "INFO").upper())
    root.propagate = False
    handler = logging.StreamHandler(sys.stderr)
    use_color = sys.stderr.isatty() and not os.environ.get("NO_COLOR")
    formatter_cls = _ColorFormatter if use_color else logging.Formatter
    handler.setFormatter(formatter_cls(LOG_FORMAT, DATE_FORMAT))
    handler.addFilter(SecretMaskingFilter())
    root.addHandler(handler)
    return root


def getLogger(name: str | None = None, type_: str | None = None) -> logging.Logger:  # noqa: N802
    """Logger ``areal.<name>`` (``type_`` is accepted for compatibility and ignored)."""
    _configure_root()
    if not name:
        return logging.getLogger(ROOT)
    if name == ROOT or name.startswith(ROOT + "."):
        return logging.getLogger(name)
    return logging.getLogger(f"{ROOT}.{name}")


def setup_file_logging(log_dir: str | os.PathLike[str], filename: str = "main.log") -> Path:
    """Also write every ``areal.*`` record to ``log_dir/filename``; returns the path."""
    root = _configure_root()
    path = Path(log_dir)
    path.mkdir(parents=True, exist_ok=True)
    target = (path / filename).absolute()
    for handler in root.handlers:
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename) == target:
            return target
    handler = logging.FileHandler(target, encoding="utf-8")
    handler.setFormatter(logging.Formatter(LOG_FORMAT, DATE_FORMAT))
    handler.addFilter(SecretMaskingFilter())
    root.addHandler(handler)
    return target


def stop_file_logging(path: str | os.PathLike[str]) -> None:
    """Undo :func:`setup_file_logging` for ``path`` (closes the file)."""
    root = _configure_root()
    target = Path(path).absolute()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename) == target:
            root.removeHandler(handler)
            handler.close()
