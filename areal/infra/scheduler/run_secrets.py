"""A run's secrets as the scheduler hands them out: each role gets only those it uses."""

from __future__ import annotations

import contextlib
import os
import secrets
import threading
from pathlib import Path
from typing import Any

from areal.api.scheduler_api import RPC_TOKEN_ENV
from areal.inference.auth import API_KEY_ENV
from areal.infra.rpc.secret_env import (
    ROLLOUT_CREDENTIAL_VARS,
    SecretScope,
    config_secrets,
    scoped_config_secrets,
    secrets_file_text,
)
from areal.utils import logging
from areal.utils.secrets import SecretStr, refuse_printed_form

__all__ = ["RunSecrets"]


class RunSecrets:
    """The RPC token, the inference API key and the config's secrets of one run.

    The token and the key come from the controller's environment (``$AREAL_RPC_TOKEN``,
    ``$AREAL_INFERENCE_API_KEY``) or are generated here, once per run. Which secrets a
    role's workers receive is its :data:`~areal.infra.rpc.secret_env.SecretScope`
    (:meth:`set_scope`); :mod:`areal.infra.rpc.secret_env` says what each scope holds.
    Files for workers that read their secrets from disk (forked workers, Slurm jobs) go
    to ``secrets_dir`` (0700, files 0600) and are removed by :meth:`remove_files`.
    """

    def __init__(self, exp_config: Any, secrets_dir: Path):
        given = refuse_printed_form(os.environ.get(RPC_TOKEN_ENV), f"${RPC_TOKEN_ENV}")
        self.token = SecretStr(given or secrets.token_urlsafe(32))
        # one inference-server API key per run: every rollout worker's servers and proxies
        # share it; controller-side probes read it from here
        given = refuse_printed_form(os.environ.get(API_KEY_ENV), f"${API_KEY_ENV}")
        self.inference_key = SecretStr(given.strip() or secrets.token_urlsafe(32))
        self.config_secrets = config_secrets(exp_config)
        for secret in (self.token, self.inference_key, *self.config_secrets.values()):
            logging.register_secret(secret)
        self.secrets_dir = secrets_dir
        self._scopes: dict[str, SecretScope] = {}
        self._lock = threading.Lock()

    def set_scope(self, role: str, scope: SecretScope) -> None:
        with self._lock:
            self._scopes[role] = scope

    def scope(self, role: str) -> SecretScope:
        """Which secrets ``role``'s workers get (``"none"`` for a role never set)."""
        with self._lock:
            return self._scopes.get(role, "none")

    def for_role(self, role: str) -> dict[str, str]:
        """The variables ``role``'s workers get: the RPC token, and for rollout workers the
        inference API key, the rollout and Arena secrets of the config (``AREAL_SECRET_*``)
        and the Arena credentials of this environment."""
        found = {RPC_TOKEN_ENV: self.token.reveal()}
        scope = self.scope(role)
        if scope == "rollout":
            found[API_KEY_ENV] = self.inference_key.reveal()
            found.update(
                (name, os.environ[name]) for name in ROLLOUT_CREDENTIAL_VARS if os.environ.get(name)
            )
        for name, secret in scoped_config_secrets(self.config_secrets, scope).items():
            found[name] = secret.reveal()
        return found

    def for_requests(self, role: str) -> tuple[dict[str, SecretStr], list[SecretStr]]:
        """``(given, withheld)``: the config secrets ``role``'s workers hold (requests name
        them), and the others (requests to those workers carry them redacted)."""
        given = scoped_config_secrets(self.config_secrets, self.scope(role))
        withheld = [value for name, value in self.config_secrets.items() if name not in given]
        return given, withheld

    def write_file(self, name: str, values: dict[str, str]) -> Path:
        """A mode-0600 file ``<name>.env`` of ``export`` lines in the secrets directory."""
        self.secrets_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.secrets_dir, 0o700)
        path = self.secrets_dir / f"{name}.env"
        path.unlink(missing_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets_file_text(values))
        return path

    def remove_files(self) -> None:
        if self.secrets_dir.is_dir():
            for path in self.secrets_dir.glob("*.env"):
                path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # something else was put there
                self.secrets_dir.rmdir()
