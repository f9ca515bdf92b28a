"""Named loggers, file logging and secret masking."""

from __future__ import annotations

import logging

from areal.utils import logging as areal_logging
from areal.utils.secrets import SecretStr
from tests.conftest import SECRET_SENTINEL


def test_named_loggers_live_under_areal():
    assert areal_logging.getLogger("trainer").name == "areal.trainer"
    assert areal_logging.getLogger("areal.proxy").name == "areal.proxy"
    assert areal_logging.getLogger().name == "areal"


def test_file_logging_masks_registered_secrets(tmp_path, monkeypatch):
    monkeypatch.setenv("ARENA_OPENAPI_TOKEN", SECRET_SENTINEL)
    areal_logging.register_secrets_from_env()
    path = areal_logging.setup_file_logging(tmp_path, "main.log")
    assert areal_logging.setup_file_logging(tmp_path, "main.log") == path  # idempotent
    log = areal_logging.getLogger("unit")
    log.warning("calling with token %s", SECRET_SENTINEL)
    log.warning("secret str %s", SecretStr("another-secret-value"))
    try:
        raise RuntimeError(f"upstream said {SECRET_SENTINEL}")
    except RuntimeError:
        log.exception("request failed")
    for handler in areal_logging.getLogger().handlers:
        handler.flush()
    text = path.read_text()
    assert "calling with token <redacted>" in text
    assert "secret str <redacted>" in text
    assert "RuntimeError: upstream said <redacted>" in text
    assert SECRET_SENTINEL not in text and "another-secret-value" not in text
    root = areal_logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler):
            root.removeHandler(handler)
            handler.close()


def test_short_values_are_not_registered():
    areal_logging.register_secret("ab")
    assert areal_logging.mask_secrets("abc ab") == "abc ab"
