"""Batch planning and dispatch feasibility: earliest-deadline-first, as pure functions.

A trajectory of version ``v`` has *deadline* ``v + S``: it must be trained in a step ``k <= v + S``
(C3; the deadline comes from :meth:`dora_rl.core.staleness.StalenessBound.deadline`). Each step
trains exactly TBS trajectories (whole groups). ``c`` is the next step to plan.

**Feasible set.** A set of unplanned trajectories (complete or still decoding) can all be trained
in time iff, for every deadline ``D >= c``::

    #{deadline <= D}  <=  TBS * (min(D, steps - 1) - c + 1)                        (EDF condition)

(Each step takes TBS; taking earliest deadlines first is optimal.) The orchestrator dispatches a
new group only if the set stays feasible (:func:`feasible`), and plans batch ``c`` from *complete*
groups, earliest deadline first, only if what remains is feasible for steps ``c + 1, ...`` and no
trajectory due at ``c`` is still decoding (:func:`plan_batch`). Both hold by induction, so no
dispatched trajectory ever becomes over-stale (C3) and none is dropped (C2) — and because one
process makes both decisions, no race between dispatching and batching can break them.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from dora_rl.core.staleness import StalenessBound


@dataclass(frozen=True)
class GroupView:
    """A complete, unplanned group: its deadline, members and completion order."""

    group_id: str
    deadline: int
    trajectory_ids: tuple[str, ...]
    completed_seq: int


def feasible(deadlines: Iterable[int], next_step: int, train_batch_size: int, steps: int) -> bool:
    """The EDF condition for ``deadlines`` (unplanned trajectories) from step ``next_step``."""
    ds = sorted(deadlines)
    last = steps - 1
    count = 0
    i = 0
    for d in sorted(set(ds)):
        while i < len(ds) and ds[i] <= d:
            count += 1
            i += 1
        if d < next_step:
            return False  # already over-stale
        if count > train_batch_size * (min(d, last) - next_step + 1):
            return False
    return len(ds) <= train_batch_size * max(0, steps - next_step)


def plan_batch(complete: Sequence[GroupView], in_flight_deadlines: Sequence[int], next_step: int,
               train_batch_size: int, steps: int) -> list[GroupView] | None:
    """Groups forming batch ``next_step``, or None to wait.

    ``in_flight_deadlines`` holds the deadline of every unplanned trajectory outside ``complete``
    (still decoding, or finished while a sibling of its group still decodes).

    Waits while a trajectory due at ``next_step`` still decodes, while fewer than TBS complete
    trajectories exist, or while the best choice (earliest deadline first, then completion order)
    would leave the rest infeasible for the following steps.
    """
    if any(d <= next_step for d in in_flight_deadlines):
        return None
    ordered = sorted(complete, key=lambda g: (g.deadline, g.completed_seq))
    chosen: list[GroupView] = []
    size = 0
    for g in ordered:
        if size + len(g.trajectory_ids) > train_batch_size:
            continue
        chosen.append(g)
        size += len(g.trajectory_ids)
        if size == train_batch_size:
            break
    if size != train_batch_size:
        return None
    chosen_ids = {g.group_id for g in chosen}
    rest = [g.deadline for g in ordered if g.group_id not in chosen_ids for _ in g.trajectory_ids]
    if not feasible([*rest, *in_flight_deadlines], next_step + 1, train_batch_size, steps):
        return None
    return chosen


class Planner:
    """Tracks unplanned trajectories and cuts plans; owned by a scheduler (pure, no clock).

    ``version_of`` may change for a trajectory that is resumed under another version (the
    partial-rollout baseline); its deadline then counts from its *first* version.
    """

    def __init__(self, train_batch_size: int, group_size: int, max_staleness: int, steps: int) -> None:
        self.tbs, self.G, self.steps = train_batch_size, group_size, steps
        self.bound = StalenessBound(max_staleness)
        self.next_step = 0
        self.version_of: dict[str, int] = {}  # unplanned trajectory -> (first) version
        self.group_of: dict[str, str] = {}
        self.members: dict[str, set[str]] = {}
        self.done: set[str] = set()
        self.completed_seq: dict[str, int] = {}
        self._seq = 0

    def deadline(self, tid: str) -> int:
        return self.bound.deadline(self.version_of[tid])

    def deadlines(self) -> list[int]:
        """Deadlines of every unplanned trajectory."""
        return [self.bound.deadline(v) for v in self.version_of.values()]

    def unplanned(self) -> int:
        return len(self.version_of)

    def can_add(self, version: int, n: int) -> bool:
        """May ``n`` more trajectories of ``version`` be dispatched (EDF condition)?"""
        return feasible([*self.deadlines(), *([self.bound.deadline(version)] * n)], self.next_step, self.tbs,
                        self.steps)

    def add(self, tid: str, group_id: str, version: int) -> None:
        self.version_of[tid] = version
        self.group_of[tid] = group_id
        self.members.setdefault(group_id, set()).add(tid)

    def complete(self, tid: str) -> None:
        if tid in self.version_of and tid not in self.done:
            self.done.add(tid)
            gid = self.group_of[tid]
            if all(m in self.done for m in self.members[gid]) and len(self.members[gid]) == self.G:
                self.completed_seq[gid] = self._seq
                self._seq += 1

    def withdraw(self, group_id: str) -> list[str]:
        """Remove an unplanned group (it was refused); returns its trajectory ids ([] when the group is
        unknown: never dispatched, or planned already). The EDF condition only gets easier."""
        tids = sorted(self.members.pop(group_id, set()))
        for t in tids:
            self.version_of.pop(t, None)
            self.group_of.pop(t, None)
            self.done.discard(t)
        self.completed_seq.pop(group_id, None)
        return tids

    def plans(self) -> list[tuple[int, list[str]]]:
        """Every batch that can be planned now, in step order."""
        out: list[tuple[int, list[str]]] = []
        while self.next_step < self.steps:
            complete = [GroupView(gid, min(self.deadline(t) for t in self.members[gid]),
                                  tuple(sorted(self.members[gid])), seq)
                        for gid, seq in self.completed_seq.items()]
            # everything not in a complete group (decoding, or done while its group is not)
            in_flight = [self.deadline(t) for t in self.version_of if self.group_of[t] not in self.completed_seq]
            chosen = plan_batch(complete, in_flight, self.next_step, self.tbs, self.steps)
            if chosen is None:
                break
            tids: list[str] = []
            for g in chosen:
                tids.extend(g.trajectory_ids)
                del self.completed_seq[g.group_id]
                for t in g.trajectory_ids:
                    self.version_of.pop(t, None)
                    self.group_of.pop(t, None)
                    self.done.discard(t)
                del self.members[g.group_id]
            out.append((self.next_step, tids))
            self.next_step += 1
        return out
