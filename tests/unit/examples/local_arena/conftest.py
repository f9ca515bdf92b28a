"""The local Arena harness tests' scripted upstream and run fixtures, shared from
tests/unit/local_arena/test_harnesses.py."""

from tests.unit.local_arena.test_harnesses import (  # noqa: F401 (fixtures)
    make_run,
    upstream,
    upstream_server,
)
