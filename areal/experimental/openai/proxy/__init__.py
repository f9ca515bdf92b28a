"""``areal.experimental.openai.proxy``: the reference's path of :mod:`areal.proxy`."""
