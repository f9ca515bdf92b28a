"""Example applications built on ``areal``."""
