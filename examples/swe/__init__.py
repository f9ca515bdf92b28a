"""The Arena suite: train agents on Arena Streams with GRPO."""
