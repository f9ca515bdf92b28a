"""Engines: the remote inference engine (SGLang API) and the FSDP / Megatron train engines.

``from areal.engine import RemoteSGLangEngine`` (and the other engine classes) resolves
lazily, so importing a submodule does not load every backend.
"""

from __future__ import annotations

from areal.utils.lazy_exports import lazy_exports

__all__ = ["FSDPEngine", "MegatronEngine", "RemoteInfEngine", "RemoteSGLangEngine"]

_LAZY_EXPORTS = {
    "FSDPEngine": "areal.engine.fsdp_engine",
    "MegatronEngine": "areal.engine.megatron_engine",
    "RemoteInfEngine": "areal.engine.sglang_remote",
    "RemoteSGLangEngine": "areal.engine.sglang_remote",
}


__getattr__, __dir__ = lazy_exports("areal.engine", _LAZY_EXPORTS, __all__)
