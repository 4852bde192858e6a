"""The paired bootstrap of two evaluations on the same prompts: pure numpy, no model.

Outcomes travel as ``0``/``1`` strings (``EvalResult.correct`` in
:mod:`dora_rl.consumers.trainer.evaluate`). The difference is ``mean(after) - mean(before)``; its
interval is the ``level`` percentile interval of that difference over ``resamples`` resamples of the
prompt indices, the same indices for both (a paired interval, narrower than two independent ones).
Here, not beside the evaluation, so the launcher's run summary computes it without importing torch
(decision 0039).
"""

from __future__ import annotations

import numpy as np


def paired_bootstrap(before: str, after: str, resamples: int = 10_000, seed: int = 0,
                     level: float = 0.95) -> tuple[float, float, float]:
    """``(mean(after) - mean(before), low, high)``: the difference of two evaluations' pass@1 on the
    same prompts and its ``level`` percentile interval over paired resamples of the prompts."""
    if len(before) != len(after) or not before:
        raise ValueError(f"paired bootstrap needs two non-empty outcome strings of one length "
                         f"({len(before)} vs {len(after)})")
    a = np.frombuffer(before.encode(), dtype=np.uint8) - ord("0")
    b = np.frombuffer(after.encode(), dtype=np.uint8) - ord("0")
    diff = (b.astype(np.float64) - a.astype(np.float64))
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(diff), size=(resamples, len(diff)))
    means = diff[idx].mean(axis=1)
    tail = (1.0 - level) / 2
    return float(diff.mean()), float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))
