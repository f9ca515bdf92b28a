"""Proxy credentials: the admin key, per-session keys, and the session-gateway pair.

* The admin key manages sessions (start, export, capacity); it is never a session key.
  A run that sets none (or leaves the reference's public default) gets a random one
  (:func:`ensure_run_admin_keys`), which reaches proxies and workflows through their
  environment only.
* A session key (random, 32 bytes) authorizes generation, ``set_reward`` and
  ``end_session`` for its one session. Inline agents receive it as ``api_key``.
* The gateway key authorizes generation only. It is derived from the admin key, so every
  proxy of a run shares it; a request using it must also name its session with
  ``X-Session-Id`` and prove it with ``X-Session-Token``, a token derived from the admin
  key and that session id.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
from collections.abc import Iterator, Mapping
from typing import Any

from areal.utils import logging
from areal.utils.secrets import SecretStr, refuse_printed_form, reveal

__all__ = [
    "DEFAULT_ADMIN_API_KEY",
    "candidate_tokens",
    "derive_gateway_key",
    "derive_session_token",
    "ensure_run_admin_keys",
    "is_loopback_host",
    "new_admin_key",
    "new_session_key",
    "same_secret",
    "validate_admin_key",
]

logger = logging.getLogger("proxy.keys")

# The reference's documented default admin key. It is public: a proxy refuses it off
# loopback, and a run that leaves it gets a random key instead (ensure_run_admin_keys).
DEFAULT_ADMIN_API_KEY = "areal-admin-key"
ADMIN_KEY_FIELD = "admin_api_key"
_GATEWAY_LABEL = b"areal-proxy/gateway-key/v1"
_TOKEN_LABEL = b"areal-proxy/session-token/v1:"


def _b64(digest: bytes) -> str:
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")


def derive_gateway_key(admin_key: str) -> str:
    """The generation-only key: HMAC-SHA256(admin key, fixed label), URL-safe."""
    return "gw-" + _b64(
        hmac.new(reveal(admin_key).encode(), _GATEWAY_LABEL, hashlib.sha256).digest()
    )


def derive_session_token(admin_key: str, session_id: str) -> str:
    """The token proving a gateway request belongs to ``session_id``."""
    message = _TOKEN_LABEL + session_id.encode()
    return "st-" + _b64(hmac.new(reveal(admin_key).encode(), message, hashlib.sha256).digest())


def new_session_key() -> str:
    return "sk-" + secrets.token_urlsafe(32)


def new_admin_key() -> SecretStr:
    """A random admin key (32 bytes), registered for redaction in this process's logs."""
    key = SecretStr("ak-" + secrets.token_urlsafe(32))
    logging.register_secret(key)
    return key


def _admin_key_nodes(node: Any, path: str) -> Iterator[tuple[Any, str]]:
    """``(config node, dotted path)`` of every node with a secret ``admin_api_key`` field."""
    if not dataclasses.is_dataclass(node) or isinstance(node, type):
        return
    for f in dataclasses.fields(node):
        dotted = f"{path}.{f.name}" if path else f.name
        if f.name == ADMIN_KEY_FIELD and f.metadata.get("secret"):
            yield node, dotted
        else:
            yield from _admin_key_nodes(getattr(node, f.name, None), dotted)


def ensure_run_admin_keys(config: Any) -> list[str]:
    """Give every unset admin key of ``config`` a random per-run value; their paths.

    An admin key that is empty or the reference's public default would let anyone who can
    reach a proxy manage its sessions, so the run gets a fresh random key instead (like the
    RPC token), set in the config before any worker starts: the scheduler exports config
    secrets to the workers' environment, and requests name them, never carry them. A
    key the user set is kept as given.
    """
    filled = []
    for node, dotted in _admin_key_nodes(config, ""):
        current = reveal(getattr(node, ADMIN_KEY_FIELD)).strip()
        if current and current != DEFAULT_ADMIN_API_KEY:
            continue
        setattr(node, ADMIN_KEY_FIELD, new_admin_key())
        filled.append(dotted)
        logger.info(
            "%s is %s: this run uses a random admin key of its own",
            dotted,
            "the public default" if current else "unset",
        )
    return filled


def same_secret(a: str | None, b: str | None) -> bool:
    """Constant-time equality of two secrets (``False`` if either is empty)."""
    if not a or not b:
        return False
    return hmac.compare_digest(reveal(a).encode(), reveal(b).encode())


def candidate_tokens(headers: Mapping[str, str]) -> list[str]:
    """Tokens a request presents: the bearer token, then ``x-api-key`` (deduplicated)."""
    found: list[str] = []
    auth = headers.get("authorization", "")
    scheme, _, value = auth.partition(" ")
    if scheme.lower() == "bearer" and value.strip():
        found.append(value.strip())
    api_key = headers.get("x-api-key", "").strip()
    if api_key and api_key not in found:
        found.append(api_key)
    return found


def is_loopback_host(host: str) -> bool:
    """Whether ``host`` only serves this machine (wildcard binds resolve to the node IP)."""
    if host in ("localhost", ""):
        return True
    if host in ("0.0.0.0", "::"):
        return False
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def validate_admin_key(admin_key: str | None, host: str) -> str:
    """Refuse an empty admin key, a printed (redacted) one, and the public default one off
    loopback (unless allowed)."""
    key = refuse_printed_form(admin_key, "the proxy admin key").strip()
    if not key:
        raise ValueError(
            "the proxy admin key is empty; set rollout.agent.admin_api_key (for example from "
            "SWE_RL_ADMIN_API_KEY)"
        )
    allow_default = os.environ.get("AREAL_ALLOW_DEFAULT_ADMIN_KEY", "") == "1"
    if key == DEFAULT_ADMIN_API_KEY and not is_loopback_host(host) and not allow_default:
        raise ValueError(
            f"the default proxy admin key may only be used on loopback, not on {host!r}; set a "
            "real key (SWE_RL_ADMIN_API_KEY) or AREAL_ALLOW_DEFAULT_ADMIN_KEY=1"
        )
    return key
