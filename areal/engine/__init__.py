"""Engines: the remote inference engine (SGLang API) and, later, training engines."""
