"""Config dataclasses and their loader; the public import path is ``areal.api.cli_args``."""
