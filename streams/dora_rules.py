"""DORA's own version rules (rules 1-3 and 5 of :mod:`.dora_policy`): feasibility, re-partition, resume version.

A :class:`~.dora_policy.VersionRules` value, as the partial-rollout baseline's :class:`~.partial_policy.PartialRules`
is: :class:`~.dora_policy.DoraScheduler` keeps the state and the events, and asks its rules what is feasible,
how instances are re-partitioned and under which version a moved trajectory resumes. Costs: see
:mod:`.dora_policy`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dora_rl.config import DoraConfig

from .dora_policy import DoraScheduler
from .dora_state import LOST
from .kv_room import consolidated_quotas, excess, kv_slots, straggler_slots, urgency
from .repartition import assign, drain_moves, least_loaded_freed, quotas
from .scheduling_events import Cancel


def dora_scheduler(config: DoraConfig) -> DoraScheduler[Any]:
    """The scheduler of the ``dora`` mode: the scheduling machinery under :class:`DoraRules`."""
    return DoraScheduler(config, DoraRules())


class DoraRules:
    """DORA: every live version keeps instances for its work; a move resumes under the trajectory's own version."""

    def feasible(self, s: DoraScheduler[Any], version: int, n: int) -> bool:
        """Rules 1–3: window, RBS and total budget, and the EDF condition (``planning.feasible``)."""
        st = s.state
        if version < 0 or not s.bound.in_window(st.latest, version):
            return False
        if s.unconsumed() + n > s.rbs or st.dispatched + n > s.steps * s.tbs:
            return False
        return s.planner.can_add(version, n)

    def repartition(self, s: DoraScheduler[Any]) -> list[Cancel]:
        """Rule 5: reassign instances to live versions; returns the cancels it caused."""
        s.repartitions += 1
        latest = s.state.latest
        if latest < 0:
            return []
        counts = s.state.counts
        n_live = len(s.state.instance_version) - len(counts.members.get(LOST, ()))
        members: Mapping[int, Sequence[int]] = counts.members
        # under drain, loads pick which holders a shrinking version frees: while an instance drains, the same quotas
        # may not mean the same holders
        by_load = s.drain and s.free_least_loaded
        if s.consolidate:
            quota, members = _consolidated(s, n_live)
        else:
            pending: dict[int, float] = {v: float(s.in_flight(v)) for v in s.live_versions()}
            headroom = max(0, min(s.rbs - s.unconsumed(), s.steps * s.tbs - s.state.dispatched))
            pending[latest] = pending.get(latest, 0.0) + headroom
            quota = quotas(pending, n_live)
            if by_load:
                members = least_loaded_freed(members, quota, counts.load)
        if not quota:
            return []
        same = (latest, quota, counts.epoch, s.slots)
        emptied, draining = counts.emptied, s.state.draining
        if same == s._unchanged and not (draining and (by_load or emptied is None
                                                       or any(i in draining for i in emptied))):
            s.unchanged_repartitions += 1
            # what it would decide is what holds now: nothing moves, the same instances drain
            return _levelled(s) if _levelling(s) else []
        current = s.state.instance_version
        moves = assign(members, quota, latest, LOST)  # the free instances only: O(versions + moved)
        if s.drain:  # moved instances still decoding keep their version until empty (nothing cancelled)
            s.state.drain(drain_moves(current, moves, counts.load))
            counts.emptied = set()  # every draining instance decodes now
        cancels: list[Cancel] = []
        trajs = s.state.trajs
        for i, version in moves.items():
            if current[i] >= 0 and version != current[i]:
                s.switches += 1
                # what it decodes of its version, in trajs order (from the counts: O(its load))
                moving = tuple(sorted((tid for tid in counts.placed.get(i, ()) if trajs[tid].version == current[i]),
                                      key=counts.pos.__getitem__))
                if moving:
                    cancels.append(_move_off(s, i, moving))
        for i, version in moves.items():
            if version != current[i]:
                s.state.hold(i, version)
        s._unchanged = (latest, quota, counts.epoch, s.slots)
        s.cancels.extend(cancels)
        if _levelling(s):
            cancels += _levelled(s)
        return cancels

    def resume_version(self, s: DoraScheduler[Any], trajectory_id: str) -> int:
        """A migrating trajectory resumes under its own version (C1)."""
        return s.state.trajs[trajectory_id].version


def _move_off(s: DoraScheduler[Any], instance: int, tids: tuple[str, ...]) -> Cancel:
    """Cancel ``tids`` on ``instance``; each resumes, with its partial, on an instance of its version."""
    for tid in tids:
        s.state.migrating[tid] = instance
        s.state.place(tid, -1)
    return Cancel(instance, tids)


def _levelling(s: DoraScheduler[Any]) -> bool:
    """``consolidate`` levels (rather than packs) now: the newest version can take nothing."""
    return s.consolidate and s.level and not newest_can_take(s)


def newest_can_take(s: DoraScheduler[Any]) -> bool:
    """Whether the newest version could be given a group now (prompts left, rules 1-3 allow it)."""
    return bool(s._prompts) and s.feasible(s.state.latest, s.G)


def _levelled(s: DoraScheduler[Any]) -> list[Cancel]:
    """``consolidate`` while the newest version can take nothing: each version's in-flight work moved
    (with its KV) off its fullest instances to its emptiest (:func:`~.kv_room.excess`)."""
    counts, trajs, out = s.state.counts, s.state.trajs, []  # O(instances): a re-partition, not an event
    for v, holders in counts.members.items():
        if v < 0 or len(holders) < 2:
            continue
        for i, n in excess({i: counts.load.get(i, 0) for i in holders}).items():
            placed = [t for t in counts.placed.get(i, ()) if not trajs[t].done and trajs[t].version == v]
            moving = tuple(sorted(placed, key=counts.pos.__getitem__)[-n:])
            if moving:
                out.append(_move_off(s, i, moving))
    s.cancels.extend(out)
    return out


def _consolidated(s: DoraScheduler[Any], n_live: int) -> tuple[dict[int, int], dict[int, Sequence[int]]]:
    """``consolidate``: the slots per instance from KV room (what an instance is given only with
    ``kv_admission``); while levelling, each version's share of the instances by :func:`~.kv_room.urgency`, else
    its quota by what its in-flight work needs counted at the cap (:func:`~.kv_room.straggler_slots`; at the busy
    context without ``pack_at_cap``), and its holders in the order :func:`assign` keeps them (least loaded freed
    first); see :mod:`.kv_room`."""
    need_slots = kv_slots(s.kv_tokens, s.lengths, s.capacity)
    slots = need_slots if s.kv_admission else s.capacity
    if slots != s.slots:
        s.slots = slots
        s._heaps.reset()
    counts, latest = s.state.counts, s.state.latest
    if _levelling(s):  # spread, the version due soonest weighted up: stragglers decode faster on emptier instances
        in_flight = {v: n for v, n in counts.in_flight.items() if v >= 0}
        steps_left = {v: s.bound.deadline(v) - s.planner.next_step + 1 for v in in_flight}
        return quotas(urgency(in_flight, steps_left, s.level_by_deadline), n_live), dict(counts.members)
    in_flight = {v: n for v, n in counts.in_flight.items() if 0 <= v < latest}
    held = {v: len(h) for v, h in counts.members.items() if v >= 0}
    due = latest - s.bound.max_staleness if s.unpack_due else -1  # trained at the next step
    loaded = ({v: len(h) - counts.idle.get(v, 0) for v, h in counts.members.items() if 0 <= v <= due}
              if s.free_empty_due else None)  # holders decoding its work, from the counts: O(versions)
    pack = straggler_slots(s.kv_tokens, s.lengths, s.max_new_tokens, need_slots) if s.pack_at_cap else need_slots
    quota = consolidated_quotas(in_flight, held, latest, n_live, pack, due=due, loaded=loaded)
    return quota, (least_loaded_freed(counts.members, quota, counts.load) if s.free_least_loaded
                   else dict(counts.members))
