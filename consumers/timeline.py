"""Version timeline of a run's rollout instances, from their ``dora.instances`` heartbeats (pure).

An instance's row is a sequence of :class:`Segment` s: maximal runs of consecutive heartbeats with the
same ``(loaded_version, state)``. A segment runs from its first heartbeat to the first heartbeat that
differs (so consecutive segments touch), or to its last heartbeat when the next one is more than
``gap_ms`` later (the instance was silent: the gap belongs to no segment) or when it is the newest.

Bubbles: the time an instance spent ``IDLE`` (nothing to generate for the version it holds) or
``LOADING`` (switching versions), as a fraction of its row's span
``first heartbeat .. last heartbeat``::

    idle_fraction(i) = sum(end - start of i's IDLE and LOADING segments) / (last_ms(i) - first_ms(i))
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from dora_rl.schemas.records import InstanceStatus

BUBBLE_STATES = ("IDLE", "LOADING")


@dataclass(frozen=True)
class Segment:
    """An instance held ``version`` in ``state`` from ``start_ms`` to ``end_ms`` (epoch ms)."""

    version: int
    state: str
    start_ms: int
    end_ms: int

    @property
    def duration_ms(self) -> int:
        return self.end_ms - self.start_ms


class Timeline:
    """Folds heartbeats into per-instance segments (see the module docstring)."""

    def __init__(self, gap_ms: int = 10_000) -> None:
        self.gap_ms = gap_ms
        self._rows: dict[str, list[Segment]] = {}

    def observe(self, st: InstanceStatus) -> None:
        """One heartbeat (heartbeats of one instance arrive in order: one partition, one writer)."""
        row = self._rows.setdefault(st.instance_id, [])
        ts, version, state = int(st.ts_ms), int(st.loaded_version), str(st.state)
        if row and ts < row[-1].end_ms:
            return  # an older heartbeat (a restarted instance's clock step): the row stays monotonic
        if row and ts - row[-1].end_ms <= self.gap_ms:
            last = row[-1]
            if (last.version, last.state) == (version, state):
                row[-1] = replace(last, end_ms=ts)
                return
            row[-1] = replace(last, end_ms=ts)
        row.append(Segment(version, state, ts, ts))

    def observe_all(self, statuses: Iterable[InstanceStatus]) -> Timeline:
        for st in statuses:
            self.observe(st)
        return self

    def rows(self) -> dict[str, tuple[Segment, ...]]:
        """Each instance's segments, instances sorted by id."""
        return {iid: tuple(row) for iid, row in sorted(self._rows.items())}

    def span(self) -> tuple[int, int] | None:
        """(first, last) heartbeat time over every instance; None before any heartbeat."""
        if not self._rows:
            return None
        return (min(r[0].start_ms for r in self._rows.values()), max(r[-1].end_ms for r in self._rows.values()))

    def idle_fraction(self, instance_id: str) -> float:
        """Share of the instance's span spent in bubbles (IDLE or LOADING)."""
        row = self._rows.get(instance_id, [])
        if not row or row[-1].end_ms <= row[0].start_ms:
            return 0.0
        idle = sum(s.duration_ms for s in row if s.state in BUBBLE_STATES)
        return idle / (row[-1].end_ms - row[0].start_ms)


__all__ = ["BUBBLE_STATES", "Segment", "Timeline"]
