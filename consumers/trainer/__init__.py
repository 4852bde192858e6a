"""Trainer: GRPO/PPO losses, SFT warm-up and the training loop."""
