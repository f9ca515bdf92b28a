"""``areal.experimental.openai``: the reference's home of the rollout proxy (here
:mod:`areal.proxy`)."""
