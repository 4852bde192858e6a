"""Multi-version streaming rollout (DORA, docs/design.md §6) as pure rules: dispatch, windows, re-partition.

Notation: ``V`` latest published version, ``S`` max staleness, TBS/RBS/G as in the config. A
trajectory of version ``v`` must be consumed by a step ``k`` with ``k - v <= S``: its *deadline* is
``v + S``.

Rules:

1. **Window (C3).** At most ``S + 1`` versions are live: dispatch uses only versions ``v`` with
   ``StalenessBound.in_window(V, v)`` (:mod:`dora_rl.core.staleness`), i.e. ``V - S <= v <= V``.
2. **Feasibility (C2 + C3).** Dispatching ``n`` more trajectories of version ``v`` is allowed only if
   the earliest-deadline-first condition of :mod:`dora_rl.streams.planning` still holds, and the
   orchestrator plans every batch itself, earliest deadline first (``BatchPlan``), so every
   dispatched trajectory is trained before it becomes over-stale — nothing is ever dropped, and the
   trainer never publishes a version that leaves one over-stale.
3. **Over-provisioning.** Unplanned trajectories (in flight or complete, not yet in a batch) stay
   ``<= RBS``; in total at most ``steps * TBS`` are dispatched, so each one lands in a batch.
4. **Newest first, back-fill.** New prompts go to the newest version ``V``; an instance still
   holding an older live version ``v`` receives new prompts of ``v`` only into its idle slots and
   only when rule 2 allows it.
5. **Re-partition.** After every new version (and on demand: load pressure, timer) instances are
   spread over live versions in proportion to their pending work (in-flight trajectories; for
   ``V`` also the dispatch headroom), every version with in-flight work keeping at least one
   instance; instances keep their version when possible. An instance that switches hands its
   in-flight trajectories over: they are cancelled there and re-dispatched, with their partial
   tokens, to an instance holding the *same* version (so the continuation is exact, C1).
6. **Elastic instances.** Instances are the live members of :mod:`.membership`: a newcomer (or one
   heard again) gets work at a re-partition made at once; one silent for ``instance_timeout_s`` is
   lost: its in-flight trajectories are queued to be generated again, from scratch, on an instance of
   the *same* version (C1), and it is left out of every rule until it is heard again.

Cost (what lets one orchestrator drive thousands of instances, ``bench/orchestration.py``): the
state keeps counts in step with every change (:class:`_Counts`: load per instance, in-flight work
per version, idle instances per version), so a completion, a score or a heartbeat is ``O(1)``, a
punctuate with nothing to do ``O(S)``, placing a trajectory ``O(log instances)`` (a heap of the
version's instances), a re-partition ``O(instances + the trajectories it moves)``: no rule scans
every trajectory on an event or a poll.
"""

from __future__ import annotations

import heapq
import logging
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Generic, TypeVar

from dora_rl.config import DoraConfig

from .membership import Membership
from .planning import Planner
from .scheduling import Cancel, Dispatch, Migration

log = logging.getLogger(__name__)
LOST = -2
"""``instance_version`` of an instance that stopped heartbeating (``streams/membership.py``)."""

P = TypeVar("P")


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
    ``in_flight``: version -> trajectories still decoding; ``holders``: version -> instances holding it
    (``instance_version``, -1 and ``LOST`` included); ``idle``: version -> those of its holders with no
    load; ``pos``: trajectory id -> its position in ``trajs`` (dict order)."""

    def __init__(self, state: DoraState) -> None:
        self.state = state
        self.load: dict[int, int] = {}
        self.placed: dict[int, set[str]] = {}
        self.in_flight: dict[int, int] = {}
        self.holders: dict[int, int] = {}
        self.idle: dict[int, int] = {}
        self.pos: dict[str, int] = {}
        self.next_pos = 0

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
        self.holders = dict(Counter(iv))
        self.idle = dict(Counter(v for i, v in enumerate(iv) if i not in load))

    def put(self, t: TrajState) -> None:
        """Count ``t`` (its current fields)."""
        if t.done:
            return
        in_flight = self.in_flight
        in_flight[t.version] = in_flight.get(t.version, 0) + 1  # counts are never negative: never 0 here
        i = t.instance
        if i >= 0:
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
            self._bump(self.load, i, -1)
            if i in self.load:
                self.placed[i].discard(t._key)
            else:
                del self.placed[i]
                iv = self.state.instance_version
                if i < len(iv):
                    self._bump(self.idle, iv[i], 1)

    def hold(self, instance: int, version: int, n: int) -> None:
        """Instance ``instance`` starts (``n`` = 1) or stops (-1) holding ``version``."""
        self._bump(self.holders, version, n)
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


class _Slots:
    """The instances holding one version, least loaded first, ties to the lowest index: the order in which
    ``_free_slots`` lists instances with a free slot (``capacity - load``, most first) and in which
    ``_least_loaded`` picks one. A heap over the live ``load`` counts, kept while one call places work
    (``changed`` after each placement), so placing ``n`` trajectories costs ``O(n log instances)``."""

    def __init__(self, load: dict[int, int], instances: list[int], capacity: int) -> None:
        self.load, self.capacity = load, capacity
        self.heap = [(load.get(i, 0), i) for i in instances]
        heapq.heapify(self.heap)
        self.free = sum(max(0, capacity - n) for n, _ in self.heap)  # free slots in all
        self.seen = {i: n for n, i in self.heap}

    def top(self) -> tuple[int, int] | None:
        """(load, instance) of the least loaded instance, or None when the version has none."""
        while self.heap:
            n, i = self.heap[0]
            if n == self.load.get(i, 0):
                return n, i
            heapq.heappop(self.heap)  # outdated: a newer entry for ``i`` was pushed by ``changed``
        return None

    def changed(self, instance: int) -> None:
        """``instance``'s load changed (one of this version's instances)."""
        n = self.load.get(instance, 0)
        now_free, was_free = self.capacity - n, self.capacity - self.seen[instance]
        self.free += (now_free if now_free > 0 else 0) - (was_free if was_free > 0 else 0)
        self.seen[instance] = n
        heapq.heappush(self.heap, (n, instance))


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

    counts: ClassVar[_Counts]  # set per instance on the first assignment of trajs

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in ("trajs", "instance_version"):
            object.__setattr__(self, name, value)
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


class DoraScheduler(Generic[P]):
    """The DORA dispatch policy (see the module docstring; implements ``SchedulingRules``)."""

    def __init__(self, config: DoraConfig) -> None:
        self.bound = config.staleness_bound
        self.tbs = config.train_batch_size
        self.rbs = config.rollout_batch_size
        self.G = config.group_size
        self.steps = config.steps
        self.n = config.num_instances
        self.capacity = config.instance_concurrency
        self.state = DoraState(instance_version=[-1] * self.n)
        self.planner = Planner(self.tbs, self.G, config.max_staleness, self.steps)
        self._prompts: deque[tuple[str, P]] = deque()
        self._resume: deque[tuple[Migration, int]] = deque()
        self.cancels: list[Cancel] = []
        self.repartitions = 0
        self.switches = 0
        self.refused_groups = 0
        self.repartition_s = config.repartition_s
        self._last_repartition = 0.0
        self.members = Membership(config.num_instances, config.instance_timeout_s)
        self.redispatched = 0

    # -- events -----------------------------------------------------------------------------------

    def add_prompt(self, group_id: str, prompt: P) -> None:
        self._prompts.append((group_id, prompt))

    def on_version(self, version: int, now: float) -> None:
        if version > self.state.latest:
            self.state.latest = version
            self._last_repartition = now
            self.repartition()

    def on_completed(self, trajectory_id: str) -> None:
        t = self.state.trajs.get(trajectory_id)
        if t is not None:
            t.done = True

    def on_scored(self, trajectory_id: str) -> None:
        self.planner.complete(trajectory_id)

    def on_refused(self, group_id: str) -> None:
        """Withdraw the group (see ``SchedulingRules.on_refused``): members still decoding are cancelled,
        and its share of the run's budget (``dispatched``) is given back, so rule 4 dispatches a
        replacement prompt."""
        tids = self.planner.withdraw(group_id)
        if not tids:
            return
        cancels: dict[int, list[tuple[str, int]]] = {}
        for tid in tids:
            t = self.state.trajs.pop(tid, None)
            self.state.migrating.pop(tid, None)
            if t is not None and not t.done and t.instance >= 0:
                cancels.setdefault(t.instance, []).append((tid, t.version))
        self._resume = deque(m for m in self._resume if m[0].trajectory_id not in set(tids))
        self.cancels.extend(Cancel(i, tuple(t for t, _ in m), tuple(v for _, v in m))
                            for i, m in sorted(cancels.items()))
        self.state.dispatched -= len(tids)
        self.refused_groups += 1

    def on_consumed(self, train_step: int, trajectory_ids: Sequence[str]) -> None:
        self.state.next_cut = max(self.state.next_cut, train_step + 1)
        for tid in trajectory_ids:
            self.state.trajs.pop(tid, None)

    def on_aborted(self, trajectory_id: str, partial: Any, instance: int | None = None) -> None:
        """A trajectory's partial response came back (it runs nowhere now): queue its resumption.

        Expected after a cancel; an unexpected one (the instance gave it up) is resumed too, when it
        comes from the instance the trajectory is placed on. Anything else is a stale duplicate.
        """
        expected = self.state.migrating.pop(trajectory_id, None)
        t = self.state.trajs.get(trajectory_id)
        if t is None or t.done:
            return
        if expected is None and (instance is None or t.instance != instance):
            return
        t.instance = -1
        self._resume.append((Migration(trajectory_id, t.version, partial), t.version))

    def on_heartbeat(self, instance: int, now: float, leaving: bool = False) -> None:
        """Instance ``instance`` was heard at ``now`` (rule 6): a newcomer or a returning instance joins
        at once (a re-partition gives it work); a leaving one is lost at once (its work moves now)."""
        iv = self.state.instance_version
        if leaving:
            if self.members.leave(instance, now):
                iv.extend([-1] * (self.members.size() - len(iv)))
                log.warning("rollout-%d left (graceful stop)", instance)
                self._lose(instance)
                if self.state.latest >= 0:
                    self.repartition()
            return
        joined = self.members.hear(instance, now)
        size = self.members.extent  # size(), without a call: this runs once per heartbeat
        if size > len(iv):
            iv.extend([-1] * (size - len(iv)))
        if joined:
            log.warning("rollout-%d joined (heard at %.1f): it gets work at this re-partition", instance, now)
            iv[instance] = -1
            if self.state.latest >= 0:
                self.repartition()

    def live_instances(self) -> list[int]:
        """Instances that may be given work (rule 6)."""
        return [i for i, v in enumerate(self.state.instance_version) if v != LOST]

    def _lose(self, instance: int) -> None:
        """Rule 6: ``instance`` stopped heartbeating; its in-flight work is queued to run again, from
        scratch, on an instance of the same version."""
        self.state.instance_version[instance] = LOST
        before = self.redispatched
        for tid, t in self.state.trajs.items():
            cancelled_on = self.state.migrating.get(tid)  # a cancel sent there: its partial will not come
            if not t.done and (t.instance == instance or cancelled_on == instance):
                self.state.migrating.pop(tid, None)
                t.instance = -1
                self._resume.append((Migration(tid, t.version, None), t.version))
                self.redispatched += 1
        log.warning("rollout-%d lost (left, or silent for over %.0fs): %d in-flight trajectories to generate again",
                    instance, self.members.timeout_s, self.redispatched - before)

    # -- rules ------------------------------------------------------------------------------------

    def unconsumed(self) -> int:
        """Dispatched trajectories not yet planned into a batch."""
        return self.planner.unplanned()

    def in_flight(self, version: int | None = None) -> int:
        """Trajectories still decoding (of ``version``); ``O(1)`` from the state's counts."""
        counts = self.state.counts.in_flight
        return sum(counts.values()) if version is None else counts.get(version, 0)

    def load(self) -> list[int]:
        counts = [0] * len(self.state.instance_version)
        for i, n in self.state.counts.load.items():
            counts[i] += n
        return counts

    def live_versions(self) -> list[int]:
        """Versions with unconsumed trajectories, plus the latest."""
        live = self.planner.versions() | set(self.state.counts.in_flight)
        if self.state.latest >= 0:
            live.add(self.state.latest)
        return sorted(live)

    def feasible(self, version: int, n: int) -> bool:
        """Rules 1–3: window, RBS and total budget, and the EDF condition (``planning.feasible``)."""
        st = self.state
        if version < 0 or not self.bound.in_window(st.latest, version):
            return False
        if self.unconsumed() + n > self.rbs or st.dispatched + n > self.steps * self.tbs:
            return False
        return self.planner.can_add(version, n)

    def repartition(self) -> list[Cancel]:
        """Rule 5: reassign instances to live versions; returns the cancels it caused."""
        self.repartitions += 1
        latest = self.state.latest
        if latest < 0:
            return []
        pending: dict[int, float] = {v: float(self.in_flight(v)) for v in self.live_versions()}
        headroom = max(0, min(self.rbs - self.unconsumed(), self.steps * self.tbs - self.state.dispatched))
        pending[latest] = pending.get(latest, 0.0) + headroom
        needed = [v for v in sorted(pending) if pending[v] > 0]
        if not needed:
            return []
        live = self.live_instances()
        n = len(live)
        # at least one instance per version with in-flight work (oldest first), rest proportional
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
        current = self.state.instance_version
        new = [v if v == LOST else -1 for v in current]
        for i in live:  # keep instances on their version while its quota lasts
            v = current[i]
            if v in quota and quota[v] > 0:
                new[i] = v
                quota[v] -= 1
        free = [i for i in live if new[i] < 0]
        first = 0  # free[first:] are still free
        for v in sorted(quota, reverse=True):  # newest first
            while quota[v] > 0 and first < len(free):
                new[free[first]] = v
                first += 1
                quota[v] -= 1
        for i in free[first:]:
            new[i] = latest
        cancels: list[Cancel] = []
        trajs, counts = self.state.trajs, self.state.counts
        for i in live:
            if current[i] >= 0 and new[i] != current[i]:
                self.switches += 1
                # what it decodes of its version, in trajs order (from the counts: O(its load))
                moving = tuple(sorted((tid for tid in counts.placed.get(i, ()) if trajs[tid].version == current[i]),
                                      key=counts.pos.__getitem__))
                if moving:
                    for tid in moving:
                        self.state.migrating[tid] = i
                        self.state.trajs[tid].instance = -1
                    cancels.append(Cancel(i, moving))
        self.state.instance_version = new
        self.cancels.extend(cancels)
        return cancels

    def pressure(self) -> bool:
        """Load pressure: a version has more in-flight work than its instances' slots while an
        instance of another version sits idle. ``O(versions)`` from the state's counts."""
        c = self.state.counts
        idle_live = sum(n for v, n in c.idle.items() if v != LOST)
        return any(c.in_flight.get(v, 0) > self.capacity * holders and idle_live - (c.idle.get(v, 0) if v != LOST
                                                                                     else 0) > 0
                   for v, holders in c.holders.items())

    def tick(self, now: float) -> None:
        """Lose silent instances (rule 6); re-partition on a timer (every ``repartition_s``), under load
        pressure or after a loss; ``now`` is injected."""
        lost = self.members.expire(now)
        for i in lost:
            if i < len(self.state.instance_version):
                self._lose(i)
        if self.state.latest < 0:
            return
        if lost:
            self._last_repartition = now
            self.repartition()
            return
        if now - self._last_repartition >= self.repartition_s or self.pressure():
            self._last_repartition = now
            self.repartition()

    def version_of(self, trajectory_id: str) -> int:
        return self.state.trajs[trajectory_id].version

    def take_cancels(self) -> list[Cancel]:
        """Cancels decided since the last call (each returned once)."""
        out, self.cancels = self.cancels, []
        return out

    def describe(self) -> str:
        st = self.state
        undone = [tid for tid, t in st.trajs.items() if not t.done]
        return (f"latest={st.latest} planned_steps={self.planner.next_step} dispatched={st.dispatched} "
                f"unconsumed={len(st.trajs)} in_flight={len(undone)} migrating={len(st.migrating)} "
                f"resume_queue={len(self._resume)} load={self.load()} instances={st.instance_version} "
                f"stuck={[(t, st.trajs[t].version, st.trajs[t].instance) for t in undone[:4]]}")

    def _free_slots(self, version: int) -> list[tuple[int, int]]:
        """(instance, free slots) of instances assigned to ``version``, most free first."""
        load = self.load()
        slots = [(i, self.capacity - load[i]) for i, v in enumerate(self.state.instance_version) if v == version]
        return sorted([s for s in slots if s[1] > 0], key=lambda s: (-s[1], s[0]))

    def _slots(self, version: int) -> _Slots:
        """The instances of ``version`` as a heap: what :meth:`_free_slots` and :meth:`_least_loaded` pick."""
        return _Slots(self.state.counts.load, [i for i, v in enumerate(self.state.instance_version) if v == version],
                      self.capacity)

    def resume_version(self, trajectory_id: str) -> int:
        """Version a migrating trajectory resumes under: its own (C1)."""
        return self.state.trajs[trajectory_id].version

    def resumes(self) -> list[tuple[Migration, int]]:
        """Migrations that can be placed now: (migration, target instance holding its resume version)."""
        out: list[tuple[Migration, int]] = []
        keep: deque[tuple[Migration, int]] = deque()
        heaps: dict[int, _Slots] = {}  # per version, built when first needed
        iv = self.state.instance_version
        while self._resume:
            mig, _ = self._resume.popleft()
            t = self.state.trajs.get(mig.trajectory_id)
            if t is None or t.done:
                continue
            version = self.resume_version(mig.trajectory_id)
            if version not in heaps:
                heaps[version] = self._slots(version)
            top = heaps[version].top()
            if top is None or top[0] >= self.capacity:  # no free slot on an instance of its version
                keep.append((mig, version))
                continue
            target, old = top[1], t.instance
            t.version, t.instance = version, target
            heaps[version].changed(target)
            if 0 <= old < len(iv) and iv[old] in heaps:
                heaps[iv[old]].changed(old)
            out.append((Migration(mig.trajectory_id, version, mig.partial), target))
        self._resume = keep
        return out

    def dispatch(self) -> list[Dispatch[P]]:
        """New dispatches allowed now (rules 1–4)."""
        out: list[Dispatch[P]] = []
        st = self.state
        if st.latest < 0 or not self._prompts:
            return out
        if self.unconsumed() + self.G > self.rbs or st.dispatched + self.G > self.steps * self.tbs:
            return out  # rule 3 refuses every version: nothing to place
        versions = sorted((v for v in st.counts.holders if v >= 0), reverse=True)  # newest first
        for version in versions:
            slots: _Slots | None = None
            while self._prompts and self.feasible(version, self.G):
                slots = slots or self._slots(version)
                if version < st.latest and slots.free < self.G:
                    break  # older versions only back-fill idle slots; the newest may queue (RBS bounds it)
                group_id, prompt = self._prompts.popleft()
                trajs, add, dispatched = st.trajs, self.planner.add, st.dispatched
                for i in range(self.G):
                    top = slots.top()  # most free slots, else least loaded (ties: lowest index)
                    assert top is not None  # the version is held by some instance
                    inst = top[1]
                    out.append(Dispatch(prompt, group_id, i, version, inst, dispatched // self.tbs))
                    tid = f"{group_id}/{i}"  # its trajectory_id
                    trajs[tid] = TrajState(version, inst, group_id)
                    slots.changed(inst)
                    dispatched += 1
                    add(tid, group_id, version)
                st.dispatched = dispatched
        return out

    def _least_loaded(self, version: int) -> int:
        load = self.load()
        candidates = ([i for i, v in enumerate(self.state.instance_version) if v == version]
                      or self.live_instances())
        return min(candidates, key=lambda i: (load[i], i))

    def done(self) -> bool:
        return self.state.dispatched >= self.steps * self.tbs

    def plans(self) -> list[tuple[int, list[str]]]:
        """Batches that can be planned now (EDF, see :mod:`dora_rl.streams.planning`)."""
        out = self.planner.plans()
        for _, tids in out:
            for tid in tids:
                self.state.trajs.pop(tid, None)
        return out


class PartialScheduler(DoraScheduler[P]):
    """The partial-rollout baseline: over-provision, abort stragglers, resume under new weights.

    All instances always hold the newest version. When version ``V`` is published every
    trajectory still decoding under an older version is cancelled and resumed on an instance
    holding ``V`` from its partial tokens, so one trajectory mixes versions (breaks C1 by design;
    per-token versions are recorded). No staleness window applies to dispatch: a trajectory's
    staleness is counted from its *first* token's version and is only measured.
    """

    def feasible(self, version: int, n: int) -> bool:
        st = self.state
        return (version == st.latest and self.unconsumed() + n <= self.rbs
                and st.dispatched + n <= self.steps * self.tbs)

    def repartition(self) -> list[Cancel]:
        self.repartitions += 1
        latest = self.state.latest
        cancels: dict[int, list[str]] = {}
        for tid, t in self.state.trajs.items():  # placed ones only: queued resumes take the newest version
            if not t.done and t.instance >= 0 and t.version < latest:
                cancels.setdefault(t.instance, []).append(tid)
                self.state.migrating[tid] = t.instance
                t.instance = -1
        self.state.instance_version = [v if v == LOST else latest for v in self.state.instance_version]
        out = [Cancel(i, tuple(tids)) for i, tids in sorted(cancels.items())]
        self.cancels.extend(out)
        return out

    def resume_version(self, trajectory_id: str) -> int:
        """Partial rollout resumes under the newest weights, whatever version began it."""
        return self.state.latest
