"""Staleness gate and batch assembly as pure logic (no Kafka, no clock): unit-testable rules.

Vocabulary: the update of train step ``k`` starts from policy version ``V = k`` (version ``v`` is
the policy after ``v`` updates) and publishes ``k + 1``. A trajectory of version ``v`` has
staleness ``V - v`` in that update.

Rules, for each batch in step order:

1. **Groups are atomic.** A trajectory waits until all ``group_size`` trajectories of its group
   have arrived; advantages need the whole group. A group may mix versions across trajectories
   (never within one trajectory, C1). Duplicates (same trajectory id) are ignored (idempotency).
2. **Staleness gate (C3).** A complete group is eligible for step ``k`` only if the rule of
   :mod:`dora_rl.core.staleness` allows every member in the update based on ``k``. A group whose
   oldest member is past its deadline (``k > deadline(v)``) can never become eligible again: the
   whole group is *refused* (returned to the caller, which dead-letters it).
   In a correct run the orchestrator never lets this happen, so refusals are counted as errors.
3. **Exactly TBS.** A batch holds exactly ``train_batch_size`` trajectories, i.e. TBS / G groups.
4. **Order.** Groups containing the oldest version go first (so no version outlives its window),
   then completion order (the order in which groups became complete).

5. **Plans.** In the running system the orchestrator decides each batch's exact members
   (:class:`~dora_rl.schemas.records.BatchPlan`, earliest deadline first, see
   :mod:`dora_rl.streams.planning`); the assembler then cuts batch ``k`` from its plan once every
   planned trajectory has arrived, re-checking rules 1–3 as a safety gate. Without plans
   (``require_plans=False``) it applies rules 1–4 greedily on its own.

The assembler never holds a group back when it is eligible and the batch is not full, so every
complete, non-refused group ends in exactly one batch (C2).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Protocol

from dora_rl.core.staleness import StalenessBound


class HasVersion(Protocol):
    """What the rules need from a trajectory."""

    @property
    def trajectory_id(self) -> str: ...
    @property
    def group_id(self) -> str: ...
    @property
    def policy_version(self) -> int: ...


@dataclass
class _Group:
    members: dict[str, HasVersion] = field(default_factory=dict)
    completed_seq: int = -1
    cached_min: int | None = None
    """``min_version()`` as last computed; every change of ``members`` resets it to None."""

    def min_version(self) -> int:
        if self.cached_min is None:
            self.cached_min = min(int(t.policy_version) for t in self.members.values())
        return self.cached_min


@dataclass(frozen=True)
class AssembledBatch:
    """One batch for ``train_step`` (= base version), trajectories in batch order."""

    train_step: int
    trajectories: tuple[HasVersion, ...]

    def staleness(self) -> list[int]:
        """``train_step - policy_version`` per trajectory."""
        return [StalenessBound.staleness(self.train_step, t.policy_version) for t in self.trajectories]


class BatchAssembler:
    """Buffers trajectories into complete groups and cuts batches under the staleness gate."""

    def __init__(self, train_batch_size: int, group_size: int, max_staleness: int, next_step: int = 0,
                 require_plans: bool = True) -> None:
        if train_batch_size % group_size:
            raise ValueError("train_batch_size must be a multiple of group_size")
        self.train_batch_size = train_batch_size
        self.group_size = group_size
        self.max_staleness = max_staleness
        self.bound = StalenessBound(max_staleness)
        self.next_step = next_step
        self._groups: dict[str, _Group] = {}
        self._complete: dict[str, _Group] = {}
        self._seen: set[str] = set()
        self._seq = 0
        self._stale_checked: tuple[int, int] | None = None  # (next_step, _seq) of the last over-stale check
        self._completed_since_check: list[str] = []  # groups completed since then, in completion order
        # (kept only once a check was made: the planned assembler never checks, and must not accumulate ids)
        self._plans: dict[int, tuple[str, ...]] = {}
        self._by_id: dict[str, HasVersion] = {}
        self.require_plans = require_plans
        self.duplicates = 0

    @property
    def groups_per_batch(self) -> int:
        """TBS / G."""
        return self.train_batch_size // self.group_size

    def add(self, trajectory: HasVersion) -> bool:
        """Buffer one trajectory; False if it is a duplicate (already seen)."""
        tid = trajectory.trajectory_id
        if tid in self._seen:
            self.duplicates += 1
            return False
        self._seen.add(tid)
        self._by_id[tid] = trajectory
        group = self._groups.setdefault(trajectory.group_id, _Group())
        group.members[tid] = trajectory
        group.cached_min = None
        if len(group.members) == self.group_size:
            group.completed_seq = self._seq
            self._seq += 1
            self._complete[trajectory.group_id] = self._groups.pop(trajectory.group_id)
            if self._stale_checked is not None:  # before any check, the first one scans every group anyway
                self._completed_since_check.append(trajectory.group_id)
        return True

    def mark_seen(self, trajectories: Iterable[HasVersion]) -> None:
        """Record trajectories consumed by earlier batches (recovery): duplicates from now on."""
        self._seen.update(t.trajectory_id for t in trajectories)

    def on_plan(self, train_step: int, trajectory_ids: Iterable[str]) -> None:
        """The orchestrator planned ``train_step`` (rule 5)."""
        if train_step >= self.next_step:
            self._plans[train_step] = tuple(trajectory_ids)

    def waiting_for(self) -> list[str]:
        """Planned trajectories of the next step that have not arrived yet."""
        return [t for t in self._plans.get(self.next_step, ()) if t not in self._by_id]

    def pending(self) -> int:
        """Trajectories buffered and not yet in a batch."""
        return sum(len(g.members) for g in self._groups.values()) + sum(
            len(g.members) for g in self._complete.values())

    def pending_by_version(self) -> dict[int, int]:
        """Buffered trajectory counts by policy version."""
        out: dict[int, int] = {}
        for g in [*self._groups.values(), *self._complete.values()]:
            for t in g.members.values():
                out[int(t.policy_version)] = out.get(int(t.policy_version), 0) + 1
        return out

    def refuse_over_stale(self) -> list[HasVersion]:
        """Remove and return complete groups that are over-stale for ``next_step`` (C3 gate).

        Incremental, O(groups completed since the last check) within a step: a check leaves no over-stale
        group behind, a complete group's oldest version only rises (a cut removes members, never adds), so
        until ``next_step`` moves only the groups completed since can be over-stale; a new step (or a
        restore) checks every complete group. Refused in completion order, as a full scan would."""
        key = (self.next_step, self._seq)
        if key == self._stale_checked:
            return []
        if self._stale_checked is not None and self._stale_checked[0] == self.next_step:
            candidates = [g for g in self._completed_since_check if g in self._complete]
        else:
            candidates = list(self._complete)
        self._completed_since_check.clear()
        refused: list[HasVersion] = []
        for gid in candidates:
            if self.next_step > self.bound.deadline(self._complete[gid].min_version()):
                refused.extend(self._complete.pop(gid).members.values())
        self._stale_checked = key
        return refused

    def drop_expired_unplanned(self) -> list[HasVersion]:
        """With plans: remove and return complete groups past their deadline that no plan names.

        The planner plans every dispatched trajectory once, before its deadline, so such a group is a
        copy of trajectories batched already (regenerated after a restart), not a refusal."""
        planned = {t for ids in self._plans.values() for t in ids}
        out: list[HasVersion] = []
        for gid in [g for g, grp in self._complete.items()
                    if self.next_step > self.bound.deadline(grp.min_version())
                    and not planned.intersection(grp.members)]:
            out.extend(self._complete.pop(gid).members.values())
        for t in out:
            self._by_id.pop(t.trajectory_id, None)
        return out

    def cut(self) -> AssembledBatch | None:
        """The batch for ``next_step``: with plans, once every planned trajectory has arrived; without,
        once enough eligible complete groups exist. None while it must wait."""
        if self.require_plans:
            return self._cut_planned()
        eligible = [(gid, g) for gid, g in self._complete.items()
                    if all(self.bound.allows(self.next_step, t.policy_version) for t in g.members.values())]
        if len(eligible) < self.groups_per_batch:
            return None
        eligible.sort(key=lambda item: (item[1].min_version(), item[1].completed_seq))
        chosen = eligible[: self.groups_per_batch]
        trajectories: list[HasVersion] = []
        for gid, g in chosen:
            del self._complete[gid]
            trajectories.extend(sorted(g.members.values(), key=lambda t: t.trajectory_id))
        for t in trajectories:
            self._by_id.pop(t.trajectory_id, None)
        batch = AssembledBatch(self.next_step, tuple(trajectories))
        self.next_step += 1
        return batch

    def _cut_planned(self) -> AssembledBatch | None:
        plan = self._plans.get(self.next_step)
        if plan is None or self.waiting_for():
            return None
        members = [self._by_id.pop(t) for t in plan]
        for t in members:
            gid = t.group_id
            grp = self._complete.get(gid) or self._groups.get(gid)
            if grp is not None:
                grp.members.pop(t.trajectory_id, None)
                grp.cached_min = None
                if not grp.members:
                    self._complete.pop(gid, None)
                    self._groups.pop(gid, None)
        del self._plans[self.next_step]
        batch = AssembledBatch(self.next_step, tuple(members))
        self.next_step += 1
        return batch

    def violations(self, batch: AssembledBatch) -> list[str]:
        """Safety gate on a batch: size, whole groups, staleness within [0, S]."""
        out = []
        if len(batch.trajectories) != self.train_batch_size:
            out.append(f"{len(batch.trajectories)} trajectories instead of {self.train_batch_size}")
        sizes: dict[str, int] = {}
        for t in batch.trajectories:
            sizes[t.group_id] = sizes.get(t.group_id, 0) + 1
        out.extend(f"group {g} has {n} of {self.group_size} members" for g, n in sizes.items()
                   if n != self.group_size)
        out.extend(f"{t.trajectory_id}: staleness {s} outside [0, {self.max_staleness}]"
                   for t, s in zip(batch.trajectories, batch.staleness(), strict=True)
                   if not self.bound.allows(batch.train_step, t.policy_version))
        return out
