"""PPO/GRPO: reward shaping, advantages (GAE), normalization, the clipped loss, λ functions."""
