"""The DORA scheduler's state (:class:`DoraState`) and the counts it keeps in step with every change.

:class:`DoraState` is everything the rules of :mod:`dora_rl.streams.dora_policy` read, and what a
snapshot holds (:mod:`dora_rl.streams.scheduler_state`). Its trajectories (``trajs``: frozen
:class:`TrajState` records), the version each instance holds (``instance_version``) and the draining
instances (``draining``) are read-only views; they change only through its methods (``add``,
``remove``, ``place``, ``retag``, ``finish``, ``hold``, ``grow``, ``hold_all``, ``drain``,
``stop_draining``, ``restore``), each of which says what it changes.

Invariant: ``DoraState.counts`` (:class:`_Counts`: load and placed trajectories per instance,
in-flight work per version, holders and idle instances per version, each trajectory's position in
``trajs`` order) always agrees with what a full recount (``_Counts.recount``) of the state gives. Every
method updates it in ``O(1)`` per entry it changes; only ``hold_all`` and ``restore`` count again. So the
rules read counts instead of scanning every trajectory or instance (:mod:`.slot_heaps` places work with them).
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

LOST = -2
"""``instance_version`` of an instance that stopped heartbeating (``streams/membership.py``)."""


TOUCHED_MAX = 1 << 16
"""Load changes :attr:`_Counts.touched` lists before it gives up (the reader then rebuilds its heaps)."""


@dataclass(frozen=True, slots=True)
class TrajState:
    """What the scheduler tracks per unconsumed trajectory (changed by replacing it, through :class:`DoraState`)."""

    version: int
    instance: int
    group_id: str
    done: bool = False


class _Counts:
    """Counts derived from a :class:`DoraState`, kept in step with every change of it, so the rules read
    the load of an instance, the in-flight work of a version and the idle instances of a version in
    ``O(1)`` instead of scanning every trajectory (``O(unconsumed)``) or instance.

    ``load``: instance -> trajectories placed there and still decoding (``placed``: their ids);
    ``in_flight``: version -> trajectories still decoding; ``members``: version -> the instances holding
    it, ascending (``instance_version``, -1 and ``LOST`` included; their number is ``len``); ``idle``:
    version -> those of its holders with no load; ``pos``: trajectory id -> its position in ``trajs`` (dict
    order); ``emptied``: instances whose load fell to 0 since the scheduler last cleared it (``None``:
    unknown, after a recount) — what lets a draining instance switch without a scan of all draining ones;
    ``epoch``: bumped by every change of who holds what (and of ``DoraState.draining`` as a whole), so a
    rule can tell that the instances are as it left them; ``touched``: instances whose load changed since
    the scheduler last read it (``None``: more than :data:`TOUCHED_MAX` changes, or a recount — unknown),
    so a heap of a version's instances kept across calls learns of every change."""

    def __init__(self, state: DoraState) -> None:
        self.state = state
        self.load: dict[int, int] = {}
        self.placed: dict[int, set[str]] = {}
        self.in_flight: dict[int, int] = {}
        self.members: dict[int, list[int]] = {}
        self.idle: dict[int, int] = {}
        self.pos: dict[str, int] = {}
        self.next_pos = 0
        self.emptied: set[int] | None = None
        self.epoch = 0
        self.touched: list[int] | None = []

    @staticmethod
    def _bump(d: dict[int, int], key: int, n: int) -> None:
        left = d.get(key, 0) + n
        if left:
            d[key] = left
        else:
            del d[key]

    def recount(self) -> None:
        """Count everything again (``O(trajectories + instances)``)."""
        self.load, self.placed, self.in_flight = {}, {}, {}
        self.emptied = self.touched = None
        self.pos = {tid: n for n, tid in enumerate(self.state.trajs)}
        self.next_pos = len(self.pos)
        for tid, t in self.state.trajs.items():
            if not t.done:
                self._bump(self.in_flight, t.version, 1)
                if t.instance >= 0:
                    self.load[t.instance] = self.load.get(t.instance, 0) + 1
                    self.placed.setdefault(t.instance, set()).add(tid)
        self.recount_instances()

    def recount_instances(self) -> None:
        """Count the instances again (``O(instances)``; the load is unchanged)."""
        iv, load = self.state.instance_version, self.load
        self.epoch += 1
        self.members = {}
        for i, v in enumerate(iv):
            self.members.setdefault(v, []).append(i)
        self.idle = dict(Counter(v for i, v in enumerate(iv) if i not in load))

    def put(self, tid: str, t: TrajState) -> None:
        """Count trajectory ``tid`` as ``t``."""
        if t.done:
            return
        in_flight = self.in_flight
        in_flight[t.version] = in_flight.get(t.version, 0) + 1  # counts are never negative: never 0 here
        i = t.instance
        if i >= 0:
            self._touch(i)
            before = self.load.get(i, 0)
            self.load[i] = before + 1
            if before == 0:
                self.placed[i] = {tid}
                iv = self.state.instance_version
                if i < len(iv):
                    self._bump(self.idle, iv[i], -1)
            else:
                self.placed[i].add(tid)

    def drop(self, tid: str, t: TrajState) -> None:
        """Uncount trajectory ``tid``, counted as ``t``."""
        if t.done:
            return
        self._bump(self.in_flight, t.version, -1)
        i = t.instance
        if i >= 0:
            self._touch(i)
            self._bump(self.load, i, -1)
            if i in self.load:
                self.placed[i].discard(tid)
            else:
                del self.placed[i]
                if self.emptied is not None:
                    self.emptied.add(i)
                iv = self.state.instance_version
                if i < len(iv):
                    self._bump(self.idle, iv[i], 1)

    def _touch(self, instance: int) -> None:
        touched = self.touched
        if touched is not None:
            if len(touched) < TOUCHED_MAX:
                touched.append(instance)
            else:
                self.touched = None

    def hold(self, instance: int, version: int, n: int) -> None:
        """Instance ``instance`` starts (``n`` = 1) or stops (-1) holding ``version``."""
        self.epoch += 1
        members = self.members.setdefault(version, [])
        if n > 0:
            bisect.insort(members, instance)
        else:
            del members[bisect.bisect_left(members, instance)]
            if not members:
                del self.members[version]
        if instance not in self.load:
            self._bump(self.idle, version, n)


class DoraState:
    """Everything the rules read; rebuilt from Kafka on restart by replaying the events (see the module
    docstring: views to read, methods to change, counts kept in step)."""

    def __init__(self, instances: int = 0) -> None:
        self.latest = -1
        self.next_cut = 0
        self.dispatched = 0
        self.migrating: dict[str, int] = {}  # tid -> instance cancelled on, awaiting its partial
        self._trajs: dict[str, TrajState] = {}
        self._view = MappingProxyType(self._trajs)
        self._iv: list[int] = [-1] * instances
        self._draining: dict[int, int] = {}  # instance -> version it takes once empty (drain policy)
        self._draining_view = MappingProxyType(self._draining)  # a new one per drain(): its id tells them apart
        self.counts = _Counts(self)
        self.counts.recount()

    @property
    def trajs(self) -> Mapping[str, TrajState]:
        """Unconsumed trajectories by id, in the order they were added (a read-only view)."""
        return self._view

    @property
    def instance_version(self) -> Sequence[int]:
        """The version each instance holds (-1: none yet, ``LOST``: gone)."""
        return self._iv

    @property
    def draining(self) -> Mapping[int, int]:
        """Draining instances (``drain`` policy) -> the version each takes once empty (a read-only view)."""
        return self._draining_view

    # -- trajectories ------------------------------------------------------------------------------

    def add(self, tid: str, t: TrajState) -> None:
        """Track ``tid`` as ``t``: a new one goes last; a known one is replaced where it stands."""
        old = self._trajs.get(tid)
        if old is None:
            self.counts.pos[tid] = self.counts.next_pos
            self.counts.next_pos += 1
        else:
            self.counts.drop(tid, old)
        self._trajs[tid] = t
        self.counts.put(tid, t)

    def remove(self, tid: str) -> TrajState | None:
        """Stop tracking ``tid`` (consumed, withdrawn); what it was, or None if unknown."""
        t = self._trajs.pop(tid, None)
        if t is not None:
            self.counts.drop(tid, t)
            del self.counts.pos[tid]
        return t

    def _change(self, tid: str, t: TrajState) -> None:
        self.counts.drop(tid, self._trajs[tid])
        self._trajs[tid] = t
        self.counts.put(tid, t)

    def place(self, tid: str, instance: int) -> None:
        """``tid`` now runs on ``instance`` (-1: on none: cancelled, lost, waiting to resume)."""
        t = self._trajs[tid]
        self._change(tid, TrajState(t.version, instance, t.group_id, t.done))

    def retag(self, tid: str, version: int, instance: int) -> None:
        """``tid`` resumes under ``version`` on ``instance``."""
        t = self._trajs[tid]
        self._change(tid, TrajState(version, instance, t.group_id, t.done))

    def finish(self, tid: str) -> None:
        """``tid`` finished decoding (its instance is free of it)."""
        t = self._trajs[tid]
        self._change(tid, TrajState(t.version, t.instance, t.group_id, True))

    def orphaned(self) -> bool:
        """Some live instance sits idle on an old version that has no work in flight."""
        c, latest = self.counts, self.latest
        return any(n > 0 and 0 <= v < latest and not c.in_flight.get(v, 0) for v, n in c.idle.items())

    def unplace_on(self, instance: int) -> list[tuple[str, int]]:
        """Every unfinished trajectory running on ``instance``, or cancelled there with its partial still to come
        (it never will: the instance is lost), now placed on none; returns them as ``(tid, version)``, in the
        state's order."""
        out: list[tuple[str, int]] = []
        for tid, t in self._trajs.items():  # replacing a value: the dict's keys do not change
            if not t.done and (t.instance == instance or self.migrating.get(tid) == instance):
                self.migrating.pop(tid, None)
                self.place(tid, -1)
                out.append((tid, t.version))
        return out

    def forget(self, tids: Sequence[str]) -> dict[int, list[tuple[str, int]]]:
        """Stop tracking ``tids`` (a withdrawn group); returns those still decoding, by instance, as
        ``(tid, version)``: the caller cancels them there."""
        running: dict[int, list[tuple[str, int]]] = {}
        for tid in tids:
            t = self.remove(tid)
            self.migrating.pop(tid, None)
            if t is not None and not t.done and t.instance >= 0:
                running.setdefault(t.instance, []).append((tid, t.version))
        return running

    # -- instances ---------------------------------------------------------------------------------

    def hold(self, instance: int, version: int) -> None:
        """Instance ``instance`` holds ``version`` now."""
        iv = self._iv
        self.counts.hold(instance, iv[instance], -1)
        iv[instance] = version
        self.counts.hold(instance, version, 1)

    def grow(self, instances: int) -> None:
        """At least ``instances`` instances, the new ones holding no version yet."""
        while len(self._iv) < instances:
            self._iv.append(-1)
            self.counts.hold(len(self._iv) - 1, -1, 1)

    def hold_all(self, versions: Sequence[int]) -> None:
        """Every instance's version at once (``O(instances)``: counted again)."""
        self._iv = list(versions)
        self.counts.recount_instances()

    def drain(self, draining: Mapping[int, int]) -> None:
        """These instances drain (and no others), each then taking the version it maps to."""
        self._draining = dict(draining)
        self._draining_view = MappingProxyType(self._draining)
        self.counts.emptied = None  # which of them emptied is unknown: the next switch scans them
        self.counts.epoch += 1

    def stop_draining(self, instance: int) -> None:
        """``instance`` drains no more (switched, joined again or lost)."""
        self._draining.pop(instance, None)

    def restore(self, trajs: Mapping[str, TrajState], versions: Sequence[int]) -> None:
        """Trajectories and instance versions from a snapshot (counted again)."""
        self._trajs = dict(trajs)
        self._view = MappingProxyType(self._trajs)
        self._iv = list(versions)
        self.counts.recount()


class ResumeQueue:
    """Trajectories waiting to resume (after a migration or a lost instance), one FIFO per trajectory
    version, as ``(migration, version)`` pairs.

    All the members of one FIFO resume under the same version (their own under DORA, the newest under
    partial rollout), so when the head of a FIFO finds no free slot the rest of it waits too: placing
    costs ``O(versions + placed)`` per call instead of a scan of the whole queue. Iteration yields every
    pair, oldest version first, in arrival order within a version (what a snapshot holds).
    """

    def __init__(self, items: Any = ()) -> None:
        self._fifos: dict[int, deque[tuple[Any, int]]] = {}  # only non-empty FIFOs
        for item in items:
            self.append(item)

    def append(self, item: tuple[Any, int]) -> None:
        self._fifos.setdefault(int(item[0].version), deque()).append(item)

    def __len__(self) -> int:
        return sum(len(q) for q in self._fifos.values())

    def __iter__(self) -> Iterator[tuple[Any, int]]:
        for v in sorted(self._fifos):
            yield from self._fifos[v]

    def versions(self) -> list[int]:
        """The versions with a waiting trajectory, oldest first."""
        return sorted(self._fifos)

    def head(self, version: int) -> tuple[Any, int] | None:
        q = self._fifos.get(version)
        return q[0] if q else None

    def pop(self, version: int) -> tuple[Any, int]:
        q = self._fifos[version]
        item = q.popleft()
        if not q:
            del self._fifos[version]
        return item

    def discard(self, trajectory_ids: set[str]) -> None:
        """Drop the entries of ``trajectory_ids`` (``O(queue)``: withdrawn groups only)."""
        for v in list(self._fifos):
            kept = deque(m for m in self._fifos[v] if m[0].trajectory_id not in trajectory_ids)
            if kept:
                self._fifos[v] = kept
            else:
                del self._fifos[v]
