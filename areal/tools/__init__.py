"""Command-line tools that work on a run's outputs (``python -m areal.tools.<name>``)."""
