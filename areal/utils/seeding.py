"""Per-process seeding: ``base + sha256(key) mod 2**32`` for every RNG in use."""

from __future__ import annotations

import hashlib
import os
import random
import sys

__all__ = ["derive_seed", "get_seed", "set_random_seed"]

_current_seed: int | None = None


def derive_seed(base: int, key: str) -> int:
    """The seed a process with role/rank ``key`` (e.g. ``trainer0``) uses."""
    digest = int(hashlib.sha256(key.encode("utf-8")).hexdigest(), 16)
    return base + digest % (2**32)


def set_random_seed(base: int, key: str) -> int:
    """Seed Python, NumPy, torch (CUDA too) and transformers; returns the seed used.

    ``PYTHONHASHSEED`` is exported for child processes (it cannot change this one's).
    """
    global _current_seed
    seed = derive_seed(base, key)
    _current_seed = seed
    os.environ["PYTHONHASHSEED"] = str(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed % (2**32))
    except ImportError:
        pass
    try:
        import torch

        torch.manual_seed(seed)
        if torch.cuda.is_available():
            torch.cuda.manual_seed_all(seed)
    except ImportError:
        pass
    transformers = sys.modules.get("transformers")
    if transformers is not None:  # seeds the same RNGs plus its own; only if already loaded
        transformers.set_seed(seed % (2**32))
    return seed


def get_seed() -> int:
    """The seed set by the last :func:`set_random_seed` call in this process."""
    if _current_seed is None:
        raise RuntimeError("set_random_seed has not been called in this process")
    return _current_seed
