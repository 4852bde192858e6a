"""DORA: asynchronous RL post-training with multi-version streaming rollout, built around Kafka."""

__version__ = "0.1.0"
