"""When the orchestrator may seal a train step (see rule 5 of :mod:`dora_rl.streams.batching`).

Step ``c`` is sealed — no trajectory with deadline ``v + S <= c`` will be dispatched any more —
as soon as one of these holds:

- **full**: the unconsumed trajectories with deadline ``<= c`` already fill every batch up to ``c``:
  ``#{deadline <= c} == TBS * (c - next_cut + 1)`` (the feasibility rule forbids more anyway);
- **window moved**: ``S >= 1`` and version ``c`` is published (new dispatches now use versions
  ``> c - S``; ``S = 0`` needs the version-``c`` trajectories themselves, so only *full* applies);
- **drained**: every trajectory of the run has been dispatched.

Steps are sealed in order; a dispatch must have a deadline beyond the last sealed step.
"""

from __future__ import annotations

from collections.abc import Iterable


def sealable_steps(deadlines: Iterable[int], next_cut: int, sealed_upto: int, latest: int, max_staleness: int,
                   train_batch_size: int, steps: int, all_dispatched: bool) -> list[int]:
    """Steps ``sealed_upto + 1, ...`` that can be sealed now, in order."""
    ds = sorted(deadlines)
    out: list[int] = []
    c = sealed_upto + 1
    while c < steps:
        full = sum(1 for d in ds if d <= c) >= train_batch_size * (c - next_cut + 1)
        moved = max_staleness >= 1 and latest >= c
        if not (full or moved or all_dispatched):
            break
        out.append(c)
        c += 1
    return out


def seal_counts(dispatched_by_version: dict[int, int], step: int, max_staleness: int) -> dict[int, int]:
    """The seal's payload: trajectories dispatched per version with deadline ``<= step``."""
    return {v: n for v, n in dispatched_by_version.items() if v + max_staleness <= step}
