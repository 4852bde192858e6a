"""The DORA scheduler's state (:class:`DoraState`) and the counts it keeps in step with every change.

:class:`DoraState` is everything the rules of :mod:`dora_rl.streams.dora_policy` read, and what a
snapshot holds (:mod:`dora_rl.streams.scheduler_state`). Its ``trajs`` (a dict of :class:`TrajState`)
and ``instance_version`` (a list) may be read, changed in place or replaced like a dict and a list.

Invariant: ``DoraState.counts`` (:class:`_Counts`: load and placed trajectories per instance,
in-flight work per version, holders and idle instances per version, each trajectory's position in
``trajs`` order) always agrees with what a full recount (``_Counts.recount``) of ``trajs`` and
``instance_version`` gives. Every change — a :class:`TrajState` field set, a trajectory set, popped
or replaced, an instance's version assigned or appended — updates it in ``O(1)``; only a change that
touches many entries at once (replacing a container, a slice, a sort) counts again. So the rules read
counts instead of scanning every trajectory or instance (:mod:`.slot_heaps` places work with them).
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

LOST = -2
"""``instance_version`` of an instance that stopped heartbeating (``streams/membership.py``)."""


TOUCHED_MAX = 1 << 16
"""Load changes :attr:`_Counts.touched` lists before it gives up (the reader then rebuilds its heaps)."""


@dataclass(init=False)
class TrajState:
    """What the scheduler tracks per unconsumed trajectory.

    Once in a :class:`DoraState`'s ``trajs``, every change of a field keeps the state's counts
    (:class:`_Counts`) in step."""

    version: int
    instance: int
    group_id: str
    done: bool = False
    _counts: ClassVar[_Counts | None] = None  # the counts of the state holding it (set per object)
    _key: ClassVar[str] = ""  # its trajectory id there (set per object)

    def __init__(self, version: int, instance: int, group_id: str, done: bool = False) -> None:
        d = self.__dict__  # no state holds it yet: nothing to keep in step
        d["version"], d["instance"], d["group_id"], d["done"] = version, instance, group_id, done

    def __setattr__(self, name: str, value: Any) -> None:
        counts = self._counts
        if counts is None:
            self.__dict__[name] = value
            return
        counts.drop(self)
        self.__dict__[name] = value
        counts.put(self)


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

    def put(self, t: TrajState) -> None:
        """Count ``t`` (its current fields)."""
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
                self.placed[i] = {t._key}
                iv = self.state.instance_version
                if i < len(iv):
                    self._bump(self.idle, iv[i], -1)
            else:
                self.placed[i].add(t._key)

    def drop(self, t: TrajState) -> None:
        """Uncount ``t`` (its current fields)."""
        if t.done:
            return
        self._bump(self.in_flight, t.version, -1)
        i = t.instance
        if i >= 0:
            self._touch(i)
            self._bump(self.load, i, -1)
            if i in self.load:
                self.placed[i].discard(t._key)
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


class _Trajs(dict[str, TrajState]):
    """``DoraState.trajs``: a dict whose changes keep the counts in step."""

    def __init__(self, counts: _Counts, items: dict[str, TrajState]) -> None:
        super().__init__(items)  # counted by the caller (``_Counts.recount``)
        self.counts = counts
        for key, t in self.items():
            object.__setattr__(t, "_key", key)
            object.__setattr__(t, "_counts", counts)

    def __setitem__(self, key: str, t: TrajState) -> None:
        counts = self.counts
        if key in self:  # replaced in place: it keeps its position, as in a dict
            old = dict.__getitem__(self, key)
            counts.drop(old)
            old.__dict__["_counts"] = None
        else:
            counts.pos[key] = counts.next_pos
            counts.next_pos += 1
        dict.__setitem__(self, key, t)
        d = t.__dict__
        d["_key"], d["_counts"] = key, counts
        counts.put(t)

    def __delitem__(self, key: str) -> None:
        self.pop(key)

    def pop(self, key: str, *default: Any) -> Any:
        if key not in self:
            return super().pop(key, *default)
        t = dict.pop(self, key)
        self.counts.drop(t)
        del self.counts.pos[key]
        t.__dict__["_counts"] = None
        return t

    def popitem(self) -> tuple[str, TrajState]:
        key = next(reversed(self))
        return key, self.pop(key)

    def clear(self) -> None:
        for key in list(self):
            self.pop(key)

    def update(self, *args: Any, **kwargs: Any) -> None:
        for key, t in dict(*args, **kwargs).items():
            self[key] = t

    def setdefault(self, key: str, default: Any = None) -> Any:
        if key not in self:
            self[key] = default
        return self[key]

    def __ior__(self, other: Any) -> _Trajs:  # type: ignore[override,misc]
        self.update(other)
        return self


class _Versions(list[int]):
    """``DoraState.instance_version``: a list whose changes keep the counts in step."""

    def __init__(self, counts: _Counts, items: list[int]) -> None:
        super().__init__(items)
        self.counts = counts

    def __setitem__(self, index: Any, value: Any) -> None:
        if isinstance(index, int):
            i = index if index >= 0 else index + len(self)
            self.counts.hold(i, self[i], -1)
            super().__setitem__(i, value)
            self.counts.hold(i, value, 1)
            return
        super().__setitem__(index, value)
        self.counts.recount_instances()

    def append(self, value: int) -> None:
        super().append(value)
        self.counts.hold(len(self) - 1, value, 1)

    def extend(self, values: Any) -> None:
        for v in values:
            self.append(v)

    def __iadd__(self, values: Any) -> _Versions:  # type: ignore[override,misc]
        self.extend(values)
        return self


def _recounting(name: str) -> Any:
    def method(self: _Versions, *args: Any, **kwargs: Any) -> Any:
        out = getattr(list, name)(self, *args, **kwargs)
        self.counts.recount_instances()
        return out if name != "__imul__" else self
    return method


for _name in ("__delitem__", "insert", "pop", "remove", "clear", "sort", "reverse", "__imul__"):
    setattr(_Versions, _name, _recounting(_name))


@dataclass
class DoraState:
    """Everything the rules read; rebuilt from Kafka on restart by replaying the events.

    ``trajs`` and ``instance_version`` may be read, changed in place or replaced like a dict and a list;
    they keep :class:`_Counts` in step (what makes the rules cheap at thousands of instances)."""

    latest: int = -1
    next_cut: int = 0
    dispatched: int = 0
    trajs: dict[str, TrajState] = field(default_factory=dict)
    instance_version: list[int] = field(default_factory=list)
    migrating: dict[str, int] = field(default_factory=dict)  # tid -> instance cancelled on, awaiting its partial
    draining: dict[int, int] = field(default_factory=dict)  # instance -> version it takes once empty (drain policy)

    counts: ClassVar[_Counts]  # set per instance on the first assignment of trajs

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in ("trajs", "instance_version"):
            object.__setattr__(self, name, value)
            if name == "draining" and "counts" in self.__dict__:
                self.counts.emptied = None  # which of them emptied is unknown: the next switch scans them
                self.counts.epoch += 1
            return
        counts = self.__dict__.get("counts")
        if counts is None:
            counts = _Counts(self)
            object.__setattr__(self, "counts", counts)
            object.__setattr__(self, "trajs", _Trajs(counts, {}))
            object.__setattr__(self, "instance_version", _Versions(counts, []))
        if name == "trajs":
            items = dict(value)
            for t in self.__dict__["trajs"].values():
                object.__setattr__(t, "_counts", None)
            object.__setattr__(self, "trajs", _Trajs(counts, items))
            counts.recount()
        else:
            object.__setattr__(self, "instance_version", _Versions(counts, list(value)))
            counts.recount_instances()



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
