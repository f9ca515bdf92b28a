"""Embedded inference server on transformers (backend "hf"), SGLang-API compatible."""
