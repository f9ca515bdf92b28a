"""A small GRPO example that runs anywhere: a tiny model learns to favour some tokens."""
