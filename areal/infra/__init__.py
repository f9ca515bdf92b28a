"""Rollout infrastructure: workflow execution, staleness control, execution context."""
