"""What a trajectory must be before it may reach an update (pure rules; no I/O).

The scorer checks a reward with :func:`reward_problem` before it writes it; the assembler checks every
scored trajectory with :func:`trajectory_problem` on receipt (an external scorer writes
``dora.rollout.scored`` too) and refuses its group otherwise; the trainer checks every batch again,
with the model's vocabulary, before the optimizer sees it. One rule, three callers.

A trajectory is trainable iff
- its reward is a finite number in ``[REWARD_MIN, REWARD_MAX]``;
- its prompt is non-empty; its response has as many behaviour log-probs (and, when recorded, token
  versions) as tokens;
- every behaviour log-prob is finite and ``<= 0`` (the log of a probability);
- every prompt and response token id is ``>= 0`` and, when the vocabulary size is known, ``< vocab``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

REWARD_MIN, REWARD_MAX = 0.0, 1.0
"""The range every reward function returns (``DoraConfig.reward_fn``)."""


def reward_problem(reward: object) -> str | None:
    """Why ``reward`` may not be trained on, or None."""
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        return f"reward {reward!r} is not a number"
    if not (math.isfinite(reward) and REWARD_MIN <= reward <= REWARD_MAX):
        return f"reward {reward!r} is not a finite number in [{REWARD_MIN:g}, {REWARD_MAX:g}]"
    return None


def trajectory_problem(prompt_ids: Sequence[int] | np.ndarray, response_ids: Sequence[int] | np.ndarray,
                       behaviour_logprobs: Sequence[float] | np.ndarray, reward: float | None,
                       token_versions: np.ndarray | None = None, vocab: int | None = None) -> str | None:
    """Why this trajectory may not reach an update (the first rule it breaks), or None."""
    if reward is None:
        return "no reward"
    bad_reward = reward_problem(reward)
    if bad_reward is not None:
        return bad_reward
    prompt, response = np.asarray(prompt_ids), np.asarray(response_ids)
    logprobs = np.asarray(behaviour_logprobs, dtype=np.float64)
    if prompt.size == 0:
        return "empty prompt"
    if logprobs.shape != response.shape:
        return f"{logprobs.size} behaviour log-probs for {response.size} response tokens"
    if token_versions is not None and np.asarray(token_versions).shape != response.shape:
        return f"{np.asarray(token_versions).size} token versions for {response.size} response tokens"
    if logprobs.size and not (np.isfinite(logprobs).all() and (logprobs <= 0.0).all()):
        return "a behaviour log-prob is not finite or is above 0"
    for name, ids in (("prompt", prompt), ("response", response)):
        if ids.size and (ids.min() < 0 or (vocab is not None and ids.max() >= vocab)):
            return f"a {name} token id is outside [0, {vocab if vocab is not None else 'inf'})"
    return None
