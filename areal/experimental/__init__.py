"""The reference's ``areal.experimental`` import paths, kept for code written against them."""
