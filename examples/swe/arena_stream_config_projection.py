"""Project a training YAML's inline Streams into the document preflight reads.

``python -m examples.swe.arena_stream_config_projection CONFIG.yaml`` composes the YAML
with the same Hydra ``defaults`` as training (without resolving anything), takes
``econfig.arena_streams`` and prints a base64 YAML ``{streams: [...]}`` with no trailing
newline, ready for ``base64 --decode > streams.yaml`` or ``--streams-env-b64 NAME``.
Interpolations inside the Streams are refused, so that preflight and training are
guaranteed to see the same values.
"""

from __future__ import annotations

import argparse
import base64
import sys
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf

from areal.api.config.loader import compose_yaml

__all__ = ["main", "project_arena_streams"]


def _reject_interpolations(value: Any, path: str) -> None:
    if isinstance(value, str):
        if "${" in value:
            raise ValueError(
                f"{path} is the interpolation {value!r}; use a literal value so that preflight "
                "and training see the same Stream configuration"
            )
    elif isinstance(value, dict):
        for key, item in value.items():
            _reject_interpolations(item, f"{path}.{key}")
    elif isinstance(value, list):
        for index, item in enumerate(value):
            _reject_interpolations(item, f"{path}[{index}]")


def project_arena_streams(config_path: str | Path) -> bytes:
    """The UTF-8 YAML ``{streams: <econfig.arena_streams>}`` of a training config."""
    path = Path(config_path).expanduser().absolute()
    document = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(document, dict):
        raise ValueError(f"{path}: the config must be a YAML mapping")
    composed = OmegaConf.to_container(compose_yaml(path), resolve=False)
    econfig = composed.get("econfig") if isinstance(composed, dict) else None
    if not isinstance(econfig, dict):
        raise ValueError(f"{path}: the config has no 'econfig' mapping")
    streams = econfig.get("arena_streams")
    if not isinstance(streams, list) or not streams:
        raise ValueError(
            f"{path}: econfig.arena_streams must be a non-empty list (a config whose Streams "
            "come from a file, such as DATASET_CONFIG, can give that file to preflight directly)"
        )
    _reject_interpolations(streams, "econfig.arena_streams")
    text = yaml.safe_dump(
        {"streams": streams}, sort_keys=False, allow_unicode=True, default_flow_style=False
    )
    return text.encode("utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m examples.swe.arena_stream_config_projection",
        description="Print the base64 Streams document of a training YAML (for preflight).",
    )
    parser.add_argument("config", help="training YAML with an inline econfig.arena_streams list")
    args = parser.parse_args(argv)
    try:
        projected = project_arena_streams(args.config)
    except (OSError, ValueError) as e:
        print(f"arena_stream_config_projection: error: {e}", file=sys.stderr)
        return 1
    sys.stdout.write(base64.b64encode(projected).decode("ascii"))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
