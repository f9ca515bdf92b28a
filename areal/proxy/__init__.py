"""Rollout proxy: OpenAI- and Anthropic-compatible endpoints that record exact tokens."""
