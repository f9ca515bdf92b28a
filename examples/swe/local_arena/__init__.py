"""The local Arena: an embedded Arena server for development, tests and the demo.

``python -m examples.swe.local_arena serve --db PATH [--catalog PATH]`` serves the
Arena OpenAPI routes the client and preflight use, an LLM gateway at ``/api``, a catalog
of Streams with gradable datasets, built-in and CLI harnesses, and fault injection.
In-process: :func:`examples.swe.local_arena.testing.running_local_arena`.
"""
