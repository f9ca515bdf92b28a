"""Training-side algorithms: the PPO/GRPO actor maths and, later, the trainer loop."""
