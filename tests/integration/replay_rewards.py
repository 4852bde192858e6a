"""A reward function known to the replay tests (``replay_rewards:length_reward``): importable by the reward
worker because tests/integration is on ``sys.path``, which the worker inherits."""

from __future__ import annotations


def length_reward(task: str, reference: str, completion: str) -> float:
    """1 for a completion as long as the reference, falling linearly to 0 at a difference of that length."""
    if not reference:
        return 0.0
    return max(0.0, 1.0 - abs(len(completion) - len(reference)) / len(reference))
