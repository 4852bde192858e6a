"""Which rollout instances are alive, from their heartbeats: a pure rule with the clock injected.

An instance is *heard* each time one of its heartbeats (``dora.instances``) is processed, at the
processor's clock ``now``, not the record's timestamp: hosts' clocks may disagree, the processor's
clock is one. Rules:

1. **Join.** An instance heard for the first time (a configured one, or a newcomer with a new index)
   or heard again after it was lost is *live*; :meth:`Membership.hear` says so (the scheduler gives it
   work at the next re-partition).
2. **Loss.** A live instance heard before and silent for longer than ``timeout_s`` is *lost*
   (:meth:`Membership.expire`, once per loss); its in-flight work is generated again elsewhere.
3. **Leave.** An instance that says it is leaving (a ``STOPPED`` heartbeat: SIGTERM, scale-in) is lost at
   once (:meth:`Membership.leave`), without waiting for the timeout; it rejoins by rule 1 if heard again.
4. **Never heard.** A configured instance not yet heard counts as live (it may still be loading its
   model; its requests wait in its partition) but can only be lost after it was heard once — a role
   that never starts is the supervisor's business, not the scheduler's.

Invariant: ``live() ∩ lost == ∅`` and every index ever heard is in exactly one of them.

Cost: :meth:`hear` and :meth:`size` are ``O(1)`` and :meth:`expire` is ``O(1)`` until some heard
instance may have gone silent for ``timeout_s`` (then ``O(instances)``): a heartbeat per instance per
second at thousands of instances stays cheap. ``last_heard`` and ``lost`` change only through these
methods and :meth:`load`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Membership:
    """Live and lost rollout instances (see the module docstring)."""

    configured: int
    timeout_s: float
    last_heard: dict[int, float] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)
    _floor: float = field(default=-math.inf, init=False, repr=False, compare=False)  # <= every live last_heard
    extent: int = field(default=0, init=False, repr=False, compare=False)  # size(), kept up to date

    def __post_init__(self) -> None:
        self._reindex()

    def _reindex(self) -> None:
        self._floor = min((t for i, t in self.last_heard.items() if i not in self.lost), default=math.inf)
        self.extent = max([self.configured - 1, *self.last_heard]) + 1

    def _heard(self, index: int, now: float) -> None:
        before = self.last_heard.get(index, now)
        t = self.last_heard[index] = before if before > now else now  # max(now, before)
        if t < self._floor:
            self._floor = t
        if index >= self.extent:
            self.extent = index + 1

    def hear(self, index: int, now: float) -> bool:
        """A heartbeat of ``index`` at ``now``; True when it joins (first heard beyond the configured
        ones, or heard again after being lost)."""
        heard = self.last_heard
        joined = index in self.lost or (index >= self.configured and index not in heard)
        if joined:  # it was lost (or is new)
            self.lost.discard(index)
        before = heard.get(index, now)
        t = heard[index] = before if before > now else now  # max(now, before), inline: once per heartbeat
        if t < self._floor:
            self._floor = t
        if index >= self.extent:
            self.extent = index + 1
        return joined

    def leave(self, index: int, now: float) -> bool:
        """``index`` left gracefully at ``now`` (rule 3); True if it was not lost already."""
        self._heard(index, now)
        was_lost = index in self.lost
        self.lost.add(index)
        return not was_lost

    def expire(self, now: float) -> list[int]:
        """Instances lost at ``now`` (each reported once per loss), ascending."""
        if now - self._floor <= self.timeout_s:
            return []  # every live instance was heard at or after the floor: none is silent for long
        gone = sorted(i for i, t in self.last_heard.items()
                      if i not in self.lost and now - t > self.timeout_s)
        self.lost.update(gone)
        self._floor = min((t for i, t in self.last_heard.items() if i not in self.lost), default=math.inf)
        return gone

    def live(self) -> list[int]:
        """Every instance that may be given work: configured or heard, and not lost, ascending."""
        known = set(range(self.configured)) | set(self.last_heard)
        return sorted(known - self.lost)

    def size(self) -> int:
        """One more than the highest index ever known (the scheduler's per-instance arrays)."""
        return self.extent

    def dump(self) -> dict[str, object]:
        return {"heard": {str(i): t for i, t in self.last_heard.items()}, "lost": sorted(self.lost)}

    def load(self, d: dict[str, object]) -> None:
        """Restore :meth:`dump` (the timers keep their wall-clock times, so a restored orchestrator decides
        exactly what the uninterrupted one would have; after a long downtime its backlog of heartbeats,
        processed before the first :meth:`expire`, refreshes every instance that is still there)."""
        heard = d.get("heard", {})
        assert isinstance(heard, dict)
        self.last_heard = {int(i): float(t) for i, t in heard.items()}
        lost = d.get("lost", [])
        assert isinstance(lost, list)
        self.lost = {int(i) for i in lost}
        self._reindex()
