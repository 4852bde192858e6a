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

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
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
    return feasible_counts(Counter(deadlines), next_step, train_batch_size, steps)


def feasible_counts(counts: Mapping[int, int], next_step: int, train_batch_size: int, steps: int) -> bool:
    """:func:`feasible` with the deadlines given as ``{deadline: how many}``: ``O(D log D)`` for ``D``
    distinct deadlines (at most ``S + 1`` live versions), whatever the number of trajectories."""
    last = steps - 1
    count = 0
    for d in sorted(d for d, n in counts.items() if n > 0):
        count += counts[d]
        if d < next_step:
            return False  # already over-stale
        if count > train_batch_size * (min(d, last) - next_step + 1):
            return False
    return count <= train_batch_size * max(0, steps - next_step)


def plan_batch(complete: Sequence[GroupView], in_flight_deadlines: Sequence[int] | Mapping[int, int],
               next_step: int, train_batch_size: int, steps: int) -> list[GroupView] | None:
    """Groups forming batch ``next_step``, or None to wait.

    ``in_flight_deadlines`` holds the deadline of every unplanned trajectory outside ``complete``
    (still decoding, or finished while a sibling of its group still decodes), as a list or as
    ``{deadline: how many}`` (then the cost is ``O(groups log groups)``, whatever the trajectories).

    Waits while a trajectory due at ``next_step`` still decodes, while fewer than TBS complete
    trajectories exist, or while the best choice (earliest deadline first, then completion order)
    would leave the rest infeasible for the following steps.
    """
    counts = Counter(in_flight_deadlines)  # a mapping's counts, or a sequence's elements counted
    if any(d <= next_step for d, n in counts.items() if n > 0):
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
    for g in ordered:
        if g.group_id not in chosen_ids:
            counts[g.deadline] += len(g.trajectory_ids)
    if not feasible_counts(counts, next_step + 1, train_batch_size, steps):
        return None
    return chosen


class Planner:
    """Tracks unplanned trajectories and cuts plans; owned by a scheduler (pure, no clock).

    ``version_of`` may change for a trajectory that is resumed under another version (the
    partial-rollout baseline); its deadline then counts from its *first* version.

    Cost: besides the maps, the planner keeps counts of the unplanned trajectories per version (all of
    them, and those outside a complete group) and the size of the complete groups, so :meth:`can_add`
    and a :meth:`plans` that must wait cost ``O(S)``, not ``O(unplanned)``; only a batch that may be cut
    costs ``O(unplanned log unplanned)``. Restoring the maps directly needs :meth:`reindex` after.
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
        self._by_version: dict[int, int] = {}  # version -> unplanned trajectories
        self._open: dict[int, int] = {}  # version -> unplanned trajectories whose group is not complete
        self._complete_size = 0  # trajectories in complete groups
        self._done_in: dict[str, int] = {}  # group -> members in ``done``
        self._views: dict[str, GroupView] = {}  # complete group -> its view (built once per completion)
        self._changes = 0  # bumped by every change that can turn a refused plan into a possible one
        self._refused_at = -1  # ``_changes`` when plan_batch last refused

    def reindex(self) -> None:
        """Recount from the maps (after they were restored or replaced)."""
        self._by_version, self._open = {}, {}
        for t, v in self.version_of.items():
            self._by_version[v] = self._by_version.get(v, 0) + 1
            if self.group_of.get(t) not in self.completed_seq:
                self._open[v] = self._open.get(v, 0) + 1
        self._complete_size = sum(len(self.members.get(g, ())) for g in self.completed_seq)
        self._done_in = {g: len(m & self.done) for g, m in self.members.items()}
        self._views = {}
        self._changes += 1

    @staticmethod
    def _bump(counts: dict[int, int], version: int, n: int) -> None:
        left = counts.get(version, 0) + n
        if left:
            counts[version] = left
        else:
            counts.pop(version, None)

    def deadline(self, tid: str) -> int:
        return self.bound.deadline(self.version_of[tid])

    def deadlines(self) -> list[int]:
        """Deadlines of every unplanned trajectory."""
        return [self.bound.deadline(v) for v in self.version_of.values()]

    def versions(self) -> set[int]:
        """Versions of the unplanned trajectories (``set(version_of.values())``)."""
        return set(self._by_version)

    def unplanned(self) -> int:
        return len(self.version_of)

    def can_add(self, version: int, n: int) -> bool:
        """May ``n`` more trajectories of ``version`` be dispatched (EDF condition)?"""
        counts = {self.bound.deadline(v): c for v, c in self._by_version.items()}
        d = self.bound.deadline(version)
        counts[d] = counts.get(d, 0) + n
        return feasible_counts(counts, self.next_step, self.tbs, self.steps)

    def add(self, tid: str, group_id: str, version: int) -> None:
        again = tid in self.version_of
        self.version_of[tid] = version
        self.group_of[tid] = group_id
        self.members.setdefault(group_id, set()).add(tid)
        if again:
            self.reindex()
            return
        by_version = self._by_version
        by_version[version] = by_version.get(version, 0) + 1  # counts are never negative: never 0 here
        if group_id in self.completed_seq:
            self._complete_size += 1
            self._views.pop(group_id, None)
            self._changes += 1
        else:
            self._open[version] = self._open.get(version, 0) + 1

    def complete(self, tid: str) -> None:
        if tid in self.version_of and tid not in self.done:
            self.done.add(tid)
            gid = self.group_of[tid]
            members = self.members[gid]
            if tid in members:
                self._done_in[gid] = self._done_in.get(gid, 0) + 1
            if self._done_in.get(gid, 0) == len(members) == self.G:  # every member done, and all G there
                if gid not in self.completed_seq:
                    for m in self.members[gid]:
                        self._bump(self._open, self.version_of[m], -1)
                    self._complete_size += len(self.members[gid])
                self.completed_seq[gid] = self._seq  # a new seq: ``_view`` rebuilds the cached view
                self._seq += 1
                self._changes += 1

    def withdraw(self, group_id: str) -> list[str]:
        """Remove an unplanned group (it was refused); returns its trajectory ids ([] when the group is
        unknown: never dispatched, or planned already). The EDF condition only gets easier."""
        tids = sorted(self.members.pop(group_id, set()))
        self._done_in.pop(group_id, None)
        if group_id in self.completed_seq:
            self._complete_size -= len(tids)
        for t in tids:
            v = self.version_of.pop(t, None)
            if v is not None:
                self._bump(self._by_version, v, -1)
                if self.group_of.get(t) not in self.completed_seq:
                    self._bump(self._open, v, -1)
            self.group_of.pop(t, None)
            self.done.discard(t)
        self.completed_seq.pop(group_id, None)
        self._views.pop(group_id, None)
        self._changes += 1
        return tids

    def _must_wait(self) -> bool:
        """What :func:`plan_batch` would wait for, from the counts: a trajectory due at ``next_step`` outside
        a complete group, or fewer than TBS trajectories in complete groups."""
        return self._complete_size < self.tbs or any(
            self.bound.deadline(v) <= self.next_step for v in self._open)

    def _view(self, gid: str, seq: int) -> GroupView:
        """The view of complete group ``gid`` (cached: its members and deadline are fixed once complete)."""
        view = self._views.get(gid)
        if view is None or view.completed_seq != seq:
            view = GroupView(gid, min(self.deadline(t) for t in self.members[gid]),
                             tuple(sorted(self.members[gid])), seq)
            self._views[gid] = view
        return view

    def plans(self) -> list[tuple[int, list[str]]]:
        """Every batch that can be planned now, in step order."""
        out: list[tuple[int, list[str]]] = []
        while self.next_step < self.steps and not self._must_wait():
            if self._refused_at == self._changes:
                break  # nothing that could change the answer happened since the last refusal
            complete = [self._view(gid, seq) for gid, seq in self.completed_seq.items()]
            # everything not in a complete group (decoding, or done while its group is not), by deadline
            in_flight: dict[int, int] = {}
            for version, n in self._open.items():
                d = self.bound.deadline(version)
                in_flight[d] = in_flight.get(d, 0) + n
            chosen = plan_batch(complete, in_flight, self.next_step, self.tbs, self.steps)
            if chosen is None:
                self._refused_at = self._changes
                break
            self._changes += 1
            tids: list[str] = []
            for g in chosen:
                tids.extend(g.trajectory_ids)
                del self.completed_seq[g.group_id]
                self._complete_size -= len(g.trajectory_ids)
                for t in g.trajectory_ids:
                    v = self.version_of.pop(t, None)
                    if v is not None:
                        self._bump(self._by_version, v, -1)
                    self.group_of.pop(t, None)
                    self.done.discard(t)
                del self.members[g.group_id]
                self._done_in.pop(g.group_id, None)
                self._views.pop(g.group_id, None)
            out.append((self.next_step, tids))
            self.next_step += 1
        return out
