"""Proxy credentials: the admin key, per-session keys, and the session-gateway pair.

* The admin key manages sessions (start, export, capacity); it is never a session key.
* A session key (random, 32 bytes) authorizes generation, ``set_reward`` and
  ``end_session`` for its one session. Inline agents receive it as ``api_key``.
* The gateway key authorizes generation only. It is derived from the admin key, so every
  proxy of a run shares it; a request using it must also name its session with
  ``X-Session-Id`` and prove it with ``X-Session-Token``, a token derived from the admin
  key and that session id.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import ipaddress
import os
import secrets
import socket
from collections.abc import Mapping

from areal.utils.secrets import reveal

__all__ = [
    "DEFAULT_ADMIN_API_KEY",
    "candidate_tokens",
    "derive_gateway_key",
    "derive_session_token",
    "is_loopback_host",
    "new_session_key",
    "same_secret",
    "validate_admin_key",
]

DEFAULT_ADMIN_API_KEY = "areal-admin-key"
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
    """Refuse an empty admin key, and the default one off loopback (unless allowed)."""
    key = reveal(admin_key).strip()
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
