"""Where the scheduler places work: a heap of one version's instances by load (:class:`VersionSlots`),
those heaps kept across calls (:class:`SlotHeaps`) so a punctuate does not rebuild them, and the placing of
trajectories waiting to resume (:func:`place_resumes`).

Invariant (what makes a kept heap exact): every instance in a heap has an entry with its current load —
each load change since the heap was built is pushed into it (the counts' ``touched``), stale entries are
dropped when they reach the top — so :meth:`VersionSlots.top` is the least loaded instance, ties to the
lowest index, exactly as a heap built now would give. A heap is built again when that cannot be known:
an instance changed version or the draining set changed (the counts' ``epoch``), more load changes than
``TOUCHED_MAX`` were missed, or stale entries outnumber live ones four to one.
"""

from __future__ import annotations

import heapq
from typing import TYPE_CHECKING

from .scheduling_events import Migration

if TYPE_CHECKING:
    from collections.abc import Callable

    from .dora_state import DoraState, ResumeQueue


class VersionSlots:
    """The instances holding one version, least loaded first, ties to the lowest index (so the one with the
    most free slots, ``capacity - load``, comes first): where the scheduler places work. A heap over the
    live ``load`` counts, kept while
    one call places work (``changed`` after each placement), so placing ``n`` trajectories costs
    ``O(n log instances)``."""

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


class SlotHeaps:
    """One :class:`VersionSlots` per version, kept while the instances hold what they held."""

    def __init__(self) -> None:
        self.heaps: dict[int, VersionSlots] = {}
        self.key: tuple[int, int, int] | None = None  # (the counts' epoch, the draining set's id and size)

    def get(self, state: DoraState, version: int, capacity: int) -> VersionSlots:
        """The heap of ``version``'s instances that take work (draining ones do not), up to date."""
        c, draining = state.counts, state.draining
        key = (c.epoch, id(draining), len(draining))
        heaps = self.heaps
        if key != self.key or c.touched is None:
            heaps.clear()
            self.key = key
        elif c.touched:
            iv = state.instance_version
            for i in c.touched:
                heap = heaps.get(iv[i]) if i < len(iv) else None
                if heap is not None and i in heap.seen:
                    heap.changed(i)
        c.touched = []
        slots = heaps.get(version)
        if slots is None or len(slots.heap) > 4 * len(slots.seen) + 64:
            holders = [i for i in c.members.get(version, ()) if i not in draining]
            slots = heaps[version] = VersionSlots(c.load, holders, capacity)
        return slots

    def reset(self) -> None:
        """Forget every heap (the next call builds them again)."""
        self.key = None


def place_resumes(queue: ResumeQueue, state: DoraState, resume_version: Callable[[str], int],
                  slots_of: Callable[[int], VersionSlots], slots: int) -> list[tuple[Migration, int]]:
    """Take from ``queue`` what can be placed now: ``(migration, target instance)``, the target the instance with
    the most free slots among those holding the trajectory's ``resume_version`` (its own under DORA: C1), each
    retagged in ``state``; finished or forgotten trajectories are dropped from the queue.

    ``O(versions + placed)``: a FIFO whose head finds its version full (no instance under ``slots``) waits whole
    (:class:`~dora_rl.streams.dora_state.ResumeQueue`)."""
    out: list[tuple[Migration, int]] = []
    heaps: dict[int, VersionSlots] = {}  # per version, built when first needed
    iv = state.instance_version
    for key in queue.versions():
        while (item := queue.head(key)) is not None:
            mig = item[0]
            t = state.trajs.get(mig.trajectory_id)
            if t is None or t.done:
                queue.pop(key)
                continue
            version = resume_version(mig.trajectory_id)
            if version not in heaps:
                heaps[version] = slots_of(version)
            top = heaps[version].top()
            if top is None or top[0] >= slots:  # no free slot on an instance of its version
                break
            queue.pop(key)
            target, old = top[1], t.instance
            state.retag(mig.trajectory_id, version, target)
            heaps[version].changed(target)
            if 0 <= old < len(iv) and iv[old] in heaps:
                heaps[iv[old]].changed(old)
            out.append((Migration(mig.trajectory_id, version, mig.partial), target))
    return out
