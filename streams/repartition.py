"""Rule 5 of :mod:`.dora_policy` as pure functions: how many instances each live version gets, which
instance holds what, and — under the ``drain`` policy — which instances keep their version until they
are empty. No state, no clock: the scheduler, the simulator and the tests call the same code.

Quotas (:func:`quotas`), for ``n`` live instances and ``pending[v]`` work per version (in-flight
trajectories; the newest version also counts its dispatch headroom): every version with work gets one
instance, oldest first, while instances last; the rest are spread in proportion to ``pending`` by the
largest-remainder method, so ``sum(quota) == n`` whenever some version has work.

Assignment (:func:`assign`): instances keep their version while its quota lasts (no needless weight
load); the free ones take the remaining quotas newest first; any left over hold ``latest``.

Draining (:func:`drain_moves`): an instance the assignment moves to another version while it still
decodes trajectories of its own is *held* on its version (``new[i] = current[i]``) and recorded as
draining towards its target. Invariants: no trajectory is cancelled by a drain; an instance is draining
only while its load is > 0; a draining instance gets no new work and no resumed trajectory (the
scheduler leaves it out of its version's slots), so its load only falls and it switches, at a tick,
once its last trajectory completes (:func:`drained`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence


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


def assign(current: Sequence[int], live: Sequence[int], quota: Mapping[int, int], latest: int,
           lost: int) -> list[int]:
    """The version of every instance after a re-partition (``lost`` instances keep the ``lost`` mark;
    instances not in ``live`` and not lost get -1)."""
    left = dict(quota)
    new = [v if v == lost else -1 for v in current]
    for i in live:  # keep instances on their version while its quota lasts
        v = current[i]
        if left.get(v, 0) > 0:
            new[i] = v
            left[v] -= 1
    free = [i for i in live if new[i] < 0]
    first = 0  # free[first:] are still free
    for v in sorted(left, reverse=True):  # newest first
        while left[v] > 0 and first < len(free):
            new[free[first]] = v
            first += 1
            left[v] -= 1
    for i in free[first:]:
        new[i] = latest
    return new


def drain_moves(current: Sequence[int], new: list[int], live: Sequence[int],
                load: Mapping[int, int]) -> dict[int, int]:
    """Hold every moved instance that still decodes on its version (``new[i] = current[i]``, in place);
    returns ``{instance: the version it switches to once empty}``."""
    draining: dict[int, int] = {}
    for i in live:
        if current[i] >= 0 and new[i] != current[i] and load.get(i, 0) > 0:
            draining[i] = new[i]
            new[i] = current[i]
    return draining


def drained(draining: Mapping[int, int], load: Mapping[int, int], live_versions: set[int],
            latest: int) -> dict[int, int]:
    """Draining instances that are empty now, with the version each switches to: its target if that is
    still live, else ``latest``."""
    return {i: (target if target in live_versions else latest)
            for i, target in draining.items() if load.get(i, 0) == 0}
