"""Rule 5 of :mod:`.dora_policy` as pure functions: how many instances each live version gets, which
instance holds what, and — under the ``drain`` policy — which instances keep their version until they
are empty. No state, no clock: the scheduler, the simulator and the tests call the same code.

Quotas (:func:`quotas`), for ``n`` live instances and ``pending[v]`` work per version (in-flight
trajectories; the newest version also counts its dispatch headroom): every version with work gets one
instance, oldest first, while instances last; the rest are spread in proportion to ``pending`` by the
largest-remainder method, so ``sum(quota) == n`` whenever some version has work.

Assignment (:func:`assign`): instances keep their version while its quota lasts (no needless weight
load), the most loaded first when the caller orders them so (:func:`least_loaded_freed`); the free ones
take the remaining quotas newest first; any left over hold ``latest``. It returns only the free
instances' versions, from each version's holders (``_Counts.members``), so its cost is the versions plus
the instances it frees, not all instances (``bench/orchestration.py``).

Draining (:func:`drain_moves`): an instance the assignment moves to another version while it still
decodes trajectories of its own is *held* on its version (``new[i] = current[i]``) and recorded as
draining towards its target. Invariants: no trajectory is cancelled by a drain; an instance is draining
only while its load is > 0; a draining instance gets no new work and no resumed trajectory (the
scheduler leaves it out of its version's slots), so its load only falls and it switches, at a tick,
once its last trajectory completes (:func:`drained`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence


def quotas(pending: Mapping[int, float], n: int) -> dict[int, int]:
    """Instances per version with work (see the module docstring); ``{}`` when no version has work."""
    needed = [v for v in sorted(pending) if pending[v] > 0]
    quota = {v: 0 for v in needed}
    for v in needed[:n]:
        quota[v] = 1
    spare = n - sum(quota.values())
    total = sum(pending[v] for v in needed)
    if spare > 0 and total > 0:
        exact = {v: spare * pending[v] / total for v in needed}
        for v in needed:
            quota[v] += int(exact[v])
        rest = n - sum(quota.values())
        for v in sorted(needed, key=lambda v: exact[v] - int(exact[v]), reverse=True)[:rest]:
            quota[v] += 1
    return quota


def assign(members: Mapping[int, Sequence[int]], quota: Mapping[int, int], latest: int,
           lost: int) -> dict[int, int]:
    """The re-partition's moves: ``{instance: its version after it}`` for every *free* instance, ascending;
    every other live instance keeps its version.

    ``members[v]``: the instances holding ``v``, ascending (``-1``: none yet; ``lost`` ones are never
    moved). Instances keep their version while its quota lasts, lowest index first; the rest of a
    version's holders, the unassigned ones and the holders of a version without quota are free; the free
    ones take the remaining quotas newest first, in ascending order; any left over hold ``latest``.
    ``O(versions + free log free)``: a re-partition that moves a few instances does not scan the rest.
    """
    left: dict[int, int] = {}
    free: list[int] = []
    for v, holders in members.items():
        if v == lost:
            continue
        kept = min(quota.get(v, 0), len(holders))
        free.extend(holders[kept:])
    for v, q in quota.items():
        left[v] = q - min(q, len(members.get(v, ())))
    free.sort()
    moves: dict[int, int] = {}
    first = 0  # free[first:] are still free
    for v in sorted(left, reverse=True):  # newest first
        take = min(left[v], len(free) - first)
        for i in free[first:first + take]:
            moves[i] = v
        first += take
    for i in free[first:]:
        moves[i] = latest
    return moves


def keep_order(holders: Sequence[int], load: Mapping[int, int]) -> list[int]:
    """``holders`` ordered as :func:`assign` keeps them (the first ``quota``): most loaded first, ties to the
    lowest index, so the least loaded are freed."""
    return sorted(holders, key=lambda i: (-load.get(i, 0), i))


def least_loaded_freed(members: Mapping[int, Sequence[int]], quota: Mapping[int, int],
                       load: Mapping[int, int]) -> dict[int, Sequence[int]]:
    """``members`` with the holders of every version that gives instances up (quota below its holders) in
    :func:`keep_order`, so :func:`assign` frees its least loaded: an empty holder switches at once, where
    freeing a busy one would leave it draining while an idle one keeps a version with nothing to do.
    ``O(versions + the holders of versions that shrink)``."""
    out = dict(members)
    for v, holders in members.items():
        if v >= 0 and quota.get(v, 0) < len(holders):
            out[v] = keep_order(holders, load)
    return out


def drain_moves(current: Sequence[int], moves: dict[int, int], load: Mapping[int, int]) -> dict[int, int]:
    """Hold every moved instance that still decodes on its version (dropped from ``moves``, in place);
    returns ``{instance: the version it switches to once empty}``."""
    draining = {i: v for i, v in moves.items() if current[i] >= 0 and v != current[i] and load.get(i, 0) > 0}
    for i in draining:
        del moves[i]
    return draining


def drained(draining: Mapping[int, int], candidates: Iterable[int], load: Mapping[int, int],
            live_versions: set[int], latest: int) -> dict[int, int]:
    """Draining instances among ``candidates`` that are empty now, with the version each switches to: its
    target if that is still live, else ``latest``. ``candidates``: the draining instances, or any superset
    of those that emptied since the last call (``_Counts.emptied``: no scan of all draining ones)."""
    return {i: (draining[i] if draining[i] in live_versions else latest)
            for i in candidates if i in draining and load.get(i, 0) == 0}
