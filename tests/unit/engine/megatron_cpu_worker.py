"""The worker RPC server with megatron-core patched for CPU, for tests only.

``python -m tests.unit.engine.megatron_cpu_worker <rpc_server flags>``: applies
:mod:`tests.unit.engine.megatron_cpu_shim`, then runs
:func:`areal.infra.rpc.rpc_server.main` unchanged. A test puts this module in the
scheduling spec's ``cmd``, so workers the scheduler starts can host a Megatron engine on
CPU while production code never carries CPU patches.
"""

from __future__ import annotations

__all__ = ["main"]


def main() -> None:
    from tests.unit.engine import megatron_cpu_shim

    megatron_cpu_shim.apply()
    from areal.infra.rpc.rpc_server import main as serve

    serve()


if __name__ == "__main__":
    main()
