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
5. **Re-partition.** After every new version (and on demand: load pressure, an instance
   idle on an old version with no work in flight, timer) instances are
   spread over live versions in proportion to their pending work (in-flight trajectories; for
   ``V`` also the dispatch headroom), every version with in-flight work keeping at least one
   instance; instances keep their version when possible, a version that gives some up freeing its least loaded
   (:mod:`.repartition`). Under the ``migrate``
   policy an instance that switches hands its in-flight trajectories over: they are cancelled there
   and re-dispatched, with their partial tokens, to an instance holding the *same* version (so the
   continuation is exact, C1). Under ``drain`` it keeps its version, gets no new work, and switches
   at a tick once empty; the newest version then queues at most ``G`` beyond a full instance and a
   version due at the next step (``v + S <= V``) gets no back-fill.
6. **Elastic instances.** Instances are the live members of :mod:`.membership`: a newcomer (or one
   heard again) gets work at a re-partition made at once; one silent for ``instance_timeout_s`` is
   lost: its in-flight trajectories are queued to be generated again, from scratch, on an instance of
   the *same* version (C1), and it is left out of every rule until it is heard again.

Cost (what lets one orchestrator drive thousands of instances, ``bench/orchestration.py``): the state keeps counts
in step with every change (:mod:`dora_rl.streams.dora_state`: load per instance, in-flight work per version, idle
instances per version), so a completion, a score or a heartbeat is ``O(1)``, a punctuate with nothing to do
``O(S)``, placing a trajectory ``O(log instances)`` (a heap of the version's instances, kept across calls while no
instance changes version: each load change is pushed into it, so a punctuate does not rebuild it), a re-partition
``O(versions + the instances it frees + the trajectories it moves)`` (each version's holders are kept sorted, so
only the tail beyond its quota is looked at; a version that shrinks has its holders ordered by load), and one that
would decide nothing — the same newest version, quotas and holders as the last one left them, no draining instance
emptied since (under ``drain``, which frees by load: none draining) — ``O(versions)``: it is skipped, with the same
outcome (``tests/unit/test_dora_policy.py``). A draining instance is switched when it empties (the counts note who
emptied), not found by a scan. No rule scans every trajectory or every instance on an event or a poll;
``consolidate``'s levelling scans the instances once per re-partition that levels (``O(instances + the trajectories
it moves)``). Rules 1-3 and 5 (feasibility, re-partition) and the version a moved trajectory resumes under are a
:class:`~.dora_policy.VersionRules` value, DORA's in :mod:`.dora_rules`; the partial-rollout baseline runs this
scheduler with its own (:mod:`dora_rl.streams.partial_policy`).
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Generic, Protocol, TypeVar

from dora_rl.config import DoraConfig

from .dora_state import LOST, DoraState, ResumeQueue, TrajState
from .kv_room import LengthMoments
from .membership import Membership
from .planning import Planner
from .repartition import drained
from .scheduling_events import (
    Aborted,
    Cancel,
    Completed,
    Consumed,
    Decisions,
    Dispatch,
    Event,
    Heartbeat,
    Migration,
    PromptQueued,
    Refused,
    RulesStatus,
    Scored,
    Tick,
    VersionSeen,
    decisions,
)
from .slot_heaps import SlotHeaps, VersionSlots, place_resumes

log = logging.getLogger(__name__)
P = TypeVar("P")


class VersionRules(Protocol):
    """What a mode decides about versions on the shared machinery: which version may take new work, how
    instances are re-partitioned, and which version a moved trajectory resumes under. DORA's are
    :class:`DoraScheduler`'s own; the partial-rollout baselines pass theirs
    (:class:`~dora_rl.streams.partial_policy.PartialRules`), so no mode subclasses another."""

    def feasible(self, s: DoraScheduler[Any], version: int, n: int) -> bool: ...

    def repartition(self, s: DoraScheduler[Any]) -> list[Cancel]: ...

    def resume_version(self, s: DoraScheduler[Any], trajectory_id: str) -> int: ...


class DoraScheduler(Generic[P]):
    """The multi-version scheduling machinery (see the module docstring; implements ``SchedulingRules``) under
    a mode's :class:`VersionRules`: DORA's (:mod:`.dora_rules`) or the partial baselines' (:mod:`.partial_policy`)."""

    def __init__(self, config: DoraConfig, versions: VersionRules) -> None:
        self.versions = versions
        self.bound = config.staleness_bound
        self.tbs = config.train_batch_size
        self.rbs = config.rollout_batch_size
        self.G = config.group_size
        self.steps = config.steps
        self.n = config.num_instances
        self.capacity = config.instance_concurrency
        self.state = DoraState(self.n)
        self.planner = Planner(self.tbs, self.G, config.max_staleness, self.steps)
        self._prompts: deque[tuple[str, P]] = deque()
        self._resume = ResumeQueue()
        self.cancels: list[Cancel] = []
        self._withdrawn: list[str] = []  # groups withdrawn since the last decide
        self.repartitions = 0
        self.switches = 0
        self.refused_groups = 0
        self.repartition_s = config.repartition_s
        self._last_repartition = 0.0
        self.members = Membership(config.num_instances, config.instance_timeout_s)
        self.redispatched = 0
        self.drain = config.repartition_policy == "drain"
        self.consolidate = config.repartition_policy == "consolidate"
        self.kv_tokens = config.instance_kv_tokens
        self.lengths = LengthMoments()  # completed trajectories' token counts (:mod:`.kv_room`)
        self.unpack_due = config.consolidate_unpack_due
        self.free_empty_due = config.consolidate_free_empty_due
        self.free_least_loaded = config.repartition_free_least_loaded
        self.on_idle = config.repartition_on_idle
        self.kv_admission = config.consolidate_kv_admission
        self.level = config.consolidate_level
        self.level_by_deadline = config.consolidate_level_by_deadline
        self.pack_at_cap = config.consolidate_pack_at_cap
        self.max_new_tokens = config.max_new_tokens
        self.slots = self.capacity  # requests one instance is given (``kv_slots`` with ``kv_admission``)
        # (latest, quotas, instances' epoch, slots) as the last re-partition left them: the same again decides nothing
        self._unchanged: tuple[int, dict[int, int], int, int] | None = None
        self.unchanged_repartitions = 0
        self._heaps = SlotHeaps()
        self._route: dict[type, Callable[[Any], None]] = {
            Heartbeat: self._on_heartbeat,  # bound methods for the frequent ones: no extra call
            Completed: self._on_completed,
            Scored: lambda e: self.planner.complete(e.trajectory_id),
            PromptQueued: lambda e: self._prompts.append((e.group_id, e.prompt)),
            VersionSeen: lambda e: self._on_version(e.version, e.now),
            Refused: lambda e: self._on_refused(e.group_id),
            Consumed: lambda e: self._on_consumed(e.train_step, e.trajectory_ids),
            Aborted: lambda e: self._on_aborted(e.trajectory_id, e.partial, e.instance),
            Tick: lambda e: self._tick(e.now)}

    # -- the interface (``SchedulingRules``) --------------------------------------------------------

    def handle(self, event: Event) -> None:
        self._route[type(event)](event)  # one lookup: ~2.5M heartbeats a step at 8,192 instances

    def decide(self) -> Decisions[P]:
        """Dispatches, then cancels, resumes and plans, as the caller carries them out."""
        dispatches = self._dispatch()
        cancels, self.cancels = self.cancels, []
        resumes = self._resumes()
        withdrawn, self._withdrawn = self._withdrawn, []
        return decisions(dispatches, cancels, resumes, self._plans(), withdrawn)

    def status(self) -> RulesStatus:
        return RulesStatus(len(self._prompts), self.state.dispatched >= self.steps * self.tbs)

    # -- events -----------------------------------------------------------------------------------

    def _on_version(self, version: int, now: float) -> None:
        if version > self.state.latest:
            self.state.latest = version
            self._last_repartition = now
            self.repartition()

    def _on_completed(self, e: Completed) -> None:
        t = self.state.trajs.get(e.trajectory_id)
        if t is not None:
            self.state.finish(e.trajectory_id)
            if e.response_tokens is not None:
                self.lengths.add(e.prompt_tokens, e.response_tokens)

    def _on_refused(self, group_id: str) -> None:
        """Withdraw the group (see :class:`~.scheduling_events.Refused`): members still decoding are cancelled,
        and its share of the run's budget (``dispatched``) is given back, so rule 4 dispatches a
        replacement prompt."""
        tids = self.planner.withdraw(group_id)
        if not tids:
            return
        cancels = self.state.forget(tids)
        self._resume.discard(set(tids))
        self.cancels.extend(Cancel(i, tuple(t for t, _ in m), tuple(v for _, v in m))
                            for i, m in sorted(cancels.items()))
        self.state.dispatched -= len(tids)
        self.refused_groups += 1
        self._withdrawn.append(group_id)

    def _on_consumed(self, train_step: int, trajectory_ids: Sequence[str]) -> None:
        self.state.next_cut = max(self.state.next_cut, train_step + 1)
        for tid in trajectory_ids:
            self.state.remove(tid)

    def _on_aborted(self, trajectory_id: str, partial: Any, instance: int | None = None) -> None:
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
        self.state.place(trajectory_id, -1)
        self._resume.append((Migration(trajectory_id, t.version, partial), t.version))

    def _on_heartbeat(self, e: Heartbeat) -> None:
        """Instance ``instance`` was heard at ``now`` (rule 6): a newcomer or a returning instance joins
        at once (a re-partition gives it work); a leaving one is lost at once (its work moves now)."""
        st, (instance, now, leaving) = self.state, e
        if leaving:
            if self.members.leave(instance, now):
                st.grow(self.members.size())
                log.warning("rollout-%d left (graceful stop)", instance)
                self._lose(instance)
                if self.state.latest >= 0:
                    self.repartition()
            return
        joined = self.members.hear(instance, now)
        size = self.members.extent  # size(), without a call: this runs once per heartbeat
        if size > len(st.instance_version):
            st.grow(size)
        if joined:
            log.warning("rollout-%d joined (heard at %.1f): it gets work at this re-partition", instance, now)
            st.hold(instance, -1)
            st.stop_draining(instance)
            if self.state.latest >= 0:
                self.repartition()

    def live_instances(self) -> list[int]:
        """Instances that may be given work (rule 6)."""
        return [i for i, v in enumerate(self.state.instance_version) if v != LOST]

    def _lose(self, instance: int) -> None:
        """Rule 6: ``instance`` stopped heartbeating; its in-flight work is queued to run again, from
        scratch, on an instance of the same version."""
        self.state.hold(instance, LOST)
        self.state.stop_draining(instance)
        orphans = self.state.unplace_on(instance)
        for tid, version in orphans:
            self._resume.append((Migration(tid, version, None), version))
        self.redispatched += len(orphans)
        log.warning("rollout-%d lost (left, or silent for over %.0fs): %d in-flight trajectories to generate again",
                    instance, self.members.timeout_s, len(orphans))

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
        """Whether ``n`` more trajectories of ``version`` may be dispatched now (the version rules)."""
        return self.versions.feasible(self, version, n)

    def repartition(self) -> list[Cancel]:
        """Re-partition instances among live versions (the version rules); returns the cancels it caused."""
        return self.versions.repartition(self)

    def pressure(self) -> bool:
        """Load pressure: a version has more in-flight work than its instances' slots while an
        instance of another version sits idle; or (``drain``, with ``repartition_on_idle``) an instance sits
        idle on an old version with no work in flight while the newest version could be given work: an
        orphan, cleared now rather than at the next timed re-partition. ``O(versions)`` from the state's
        counts, plus the feasibility check only when such an instance exists."""
        c = self.state.counts
        idle_live = sum(n for v, n in c.idle.items() if v != LOST)
        if any(c.in_flight.get(v, 0) > self.slots * len(holders) and idle_live - (c.idle.get(v, 0) if v != LOST
                                                                                 else 0) > 0
               for v, holders in c.members.items()):
            return True
        return self.drain and self.on_idle and self.state.orphaned() and bool(self._prompts) and self.feasible(
            self.state.latest, self.G)

    def _tick(self, now: float) -> None:
        """Lose silent instances (rule 6); re-partition on a timer (every ``repartition_s``), under load
        pressure or after a loss; ``now`` is injected."""
        lost = self.members.expire(now)
        for i in lost:
            if i < len(self.state.instance_version):
                self._lose(i)
        if self.state.latest < 0:
            return
        if self.state.draining:
            self._switch_drained()
        elif self.state.counts.emptied:
            self.state.counts.emptied = set()  # nothing drains: who emptied does not matter
        if lost:
            self._last_repartition = now
            self.repartition()
            return
        if now - self._last_repartition >= self.repartition_s or self.pressure():
            self._last_repartition = now
            self.repartition()

    def _switch_drained(self) -> None:
        """Draining instances with no trajectory left take their target version (``drain`` policy); only
        those that emptied since the last tick are looked at (all of them after a restore)."""
        st = self.state
        emptied = st.counts.emptied
        done = drained(st.draining, st.draining if emptied is None else emptied, st.counts.load,
                       set(self.live_versions()), st.latest)
        st.counts.emptied = set()
        for i, version in done.items():
            st.stop_draining(i)
            st.hold(i, version)
            self.switches += 1

    def version_of(self, trajectory_id: str) -> int:
        return self.state.trajs[trajectory_id].version

    def instance_state(self, instance: int, holds: int) -> str:
        """See ``SchedulingRules.instance_state``: draining first, then by the version it holds."""
        st = self.state
        if instance in st.draining:
            return "draining"
        if holds >= st.latest:
            return "newest"
        return "due" if self.bound.deadline(holds) <= st.latest else "old"

    def describe(self) -> str:
        st = self.state
        undone = [tid for tid, t in st.trajs.items() if not t.done]
        return (f"latest={st.latest} planned_steps={self.planner.next_step} dispatched={st.dispatched} "
                f"unconsumed={len(st.trajs)} in_flight={len(undone)} migrating={len(st.migrating)} "
                f"resume_queue={len(self._resume)} load={self.load()} instances={st.instance_version} "
                f"stuck={[(t, st.trajs[t].version, st.trajs[t].instance) for t in undone[:4]]}")

    def _slots(self, version: int) -> VersionSlots:
        """The instances of ``version`` that take work (draining ones do not), as a heap: the one with the
        most free slots first, else the least loaded (ties: lowest index); kept across calls
        (:class:`~dora_rl.streams.slot_heaps.SlotHeaps`)."""
        return self._heaps.get(self.state, version, self.slots)

    def resume_version(self, trajectory_id: str) -> int:
        """Version a migrating trajectory resumes under (the version rules; DORA's: its own, C1)."""
        return self.versions.resume_version(self, trajectory_id)

    def _resumes(self) -> list[tuple[Migration, int]]:
        """Migrations that can be placed now (:func:`~.slot_heaps.place_resumes`)."""
        return place_resumes(self._resume, self.state, self.resume_version, self._slots, self.slots)

    def _dispatch(self) -> list[Dispatch[P]]:
        """New dispatches allowed now (rules 1–4)."""
        out: list[Dispatch[P]] = []
        st = self.state
        if st.latest < 0 or not self._prompts:
            return out
        if self.unconsumed() + self.G > self.rbs or st.dispatched + self.G > self.steps * self.tbs:
            return out  # rule 3 refuses every version: nothing to place
        versions = sorted((v for v in st.counts.members if v >= 0), reverse=True)  # newest first
        for version in versions:
            slots: VersionSlots | None = None
            while self._prompts and self.feasible(version, self.G):
                slots = slots or self._slots(version)
                due = ((self.drain or self.consolidate)  # trained at the next step
                       and self.bound.deadline(version) <= st.latest)
                if version < st.latest and (slots.free < self.G or due):
                    break  # older versions only back-fill idle slots (under drain: not when due next step)
                if self.consolidate and slots.free < self.G:
                    break  # a group only into free slots (KV room with kv_admission); the rest waits untagged
                if self.drain and version == st.latest:  # the newest queues at most G beyond a full instance
                    top = slots.top()
                    if top is None or top[0] > self.capacity:
                        break
                group_id, prompt = self._prompts.popleft()
                add, dispatched = self.planner.add, st.dispatched
                for i in range(self.G):
                    top = slots.top()  # most free slots, else least loaded (ties: lowest index)
                    assert top is not None  # the version is held by some instance
                    inst = top[1]
                    out.append(Dispatch(prompt, group_id, i, version, inst, dispatched // self.tbs))
                    tid = f"{group_id}/{i}"  # its trajectory_id
                    st.add(tid, TrajState(version, inst, group_id))
                    slots.changed(inst)
                    dispatched += 1
                    add(tid, group_id, version)
                st.dispatched = dispatched
        return out

    def _plans(self) -> list[tuple[int, list[str]]]:
        """Batches that can be planned now (EDF, see :mod:`dora_rl.streams.planning`)."""
        out = self.planner.plans()
        for _, tids in out:
            for tid in tids:
                self.state.remove(tid)
        return out
