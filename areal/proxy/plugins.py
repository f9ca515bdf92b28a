"""Proxy plugins named by dotted path in the agent config.

* ``rollout.agent.message_preprocessors``: classes instantiated with no arguments, each
  called as ``messages = p(messages)`` on every request (in order);
* ``rollout.agent.prefix_matcher``: a function ``matcher(prefix, messages) -> bool`` the
  interaction cache uses to find a call's parent.

Errors name the config field and the path, so a typo fails the launch, not the first request.
"""

from __future__ import annotations

from collections.abc import Iterable

from areal.proxy.interaction import PrefixMatcher
from areal.proxy.messages import MessagePreprocessor
from areal.utils.dynamic_import import import_from_string

__all__ = ["load_message_preprocessors", "load_prefix_matcher"]

PREPROCESSORS_FIELD = "rollout.agent.message_preprocessors"
PREFIX_MATCHER_FIELD = "rollout.agent.prefix_matcher"


def _load(path: str, field: str):
    try:
        return import_from_string(path)
    except (ImportError, ValueError) as e:
        raise ValueError(f"{field}: {e}") from None


def load_message_preprocessors(paths: Iterable[str]) -> list[MessagePreprocessor]:
    """One instance of each class, in order."""
    preprocessors = []
    for path in paths:
        cls = _load(path, PREPROCESSORS_FIELD)
        if not callable(cls):
            raise ValueError(f"{PREPROCESSORS_FIELD}: {path!r} is not a class or callable")
        try:
            instance = cls() if isinstance(cls, type) else cls
        except TypeError as e:
            raise ValueError(
                f"{PREPROCESSORS_FIELD}: {path!r} must be constructible with no arguments ({e})"
            ) from None
        if not callable(instance):
            raise ValueError(f"{PREPROCESSORS_FIELD}: instances of {path!r} are not callable")
        preprocessors.append(instance)
    return preprocessors


def load_prefix_matcher(path: str | None) -> PrefixMatcher | None:
    """The matcher function, or None (the cache's exact-prefix default) when unset."""
    if not path:
        return None
    matcher = _load(path, PREFIX_MATCHER_FIELD)
    if not callable(matcher):
        raise ValueError(f"{PREFIX_MATCHER_FIELD}: {path!r} is not callable")
    return matcher
