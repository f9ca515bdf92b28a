"""Loads a config from the real command line and prints a few fields as JSON.

Used by tests to check both argv forms: ``python -m tests.helpers.print_config ...`` and
``python tests/helpers/print_config.py ...`` (sys.argv is passed whole).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from areal.api.cli_args import PPOConfig, load_expr_config


def main() -> None:
    cfg, path = load_expr_config(sys.argv, PPOConfig)
    print(json.dumps({"path": path, "eps_clip": cfg.actor.eps_clip, "trial": cfg.trial_name}))


if __name__ == "__main__":
    main()
