"""One simulated rollout instance (:mod:`.simulator`): its active set decoded in closed form between events, its
queue per version, and the instance-seconds it spends by use (:class:`LostTime`).

Invariants: ``ctx`` is the sum of the active trajectories' contexts; each active trajectory's ``done_tokens`` is
current after :meth:`SimInstance.sync`; ``finish_at`` holds, lazily, the decode step at which each active one
finishes; ``epoch`` changes whenever the active set does, so an event scheduled before is recognised as stale.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dora_rl.core.emulation import EmulatedParams, decode_steps_within, decode_time, kv_steps_left


@dataclass
class SimTraj:
    """A trajectory as the simulated engine holds it."""

    tid: str
    group_id: str
    version: int
    length: int
    prompt: int = 16
    done_tokens: int = 0
    mark: int = 0  # the instance's step count when done_tokens was last brought up to date
    versions: set[int] = field(default_factory=set)
    kv_held: bool = False  # cancelled with its KV kept, to move to an instance of the same version

    @property
    def context(self) -> int:
        return self.prompt + self.done_tokens


@dataclass
class LostTime:
    """Instance-seconds by use, summed over instances (what each is: :mod:`.simulator`, "Where the time goes")."""

    decode_s: float = 0.0
    intra_bubble_s: float = 0.0
    prefill_s: float = 0.0
    reprefill_s: float = 0.0
    kv_move_s: float = 0.0
    switch_s: float = 0.0
    idle_s: float = 0.0
    preemptions: int = 0
    intra_by_state: dict[str, float] = field(default_factory=dict)
    """``intra_bubble_s`` split by what the instance did for the rules (``instance_state``)."""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class SimInstance:
    """One instance of the simulated engine (module docstring)."""

    def __init__(self, index: int, capacity: int, params: EmulatedParams) -> None:
        self.index, self.capacity, self.params = index, capacity, params
        self.version = -1
        self.active: dict[str, SimTraj] = {}  # in admission order: the newest is preempted first
        # waiting for a slot, KV room, or the held version to drain (C1): per version, in arrival order (the
        # instance rule only ever starts the held version's requests, first come first)
        self.queue: dict[int, deque[SimTraj]] = {}
        self.t = 0.0  # time up to which decoding has been applied
        self.steps = 0  # decode steps taken so far
        self.ctx = 0  # context tokens held by the active sequences
        self.lost = LostTime()
        self.epoch = 0  # invalidates scheduled events when the active set changes
        self.finish_at: list[tuple[int, str]] = []  # heap of (step count at which it finishes, id); lazy deletion

    def sync(self, tr: SimTraj) -> None:
        """Bring ``tr.done_tokens`` up to date (its progress is counted by the instance's steps)."""
        tr.done_tokens += self.steps - tr.mark
        tr.mark = self.steps

    def _finish_step(self, tr: SimTraj) -> int:
        return tr.mark + tr.length - tr.done_tokens

    def first_finish(self) -> int | None:
        """The step count at which the next active trajectory finishes (O(log n) amortised)."""
        while self.finish_at:
            step, tid = self.finish_at[0]
            tr = self.active.get(tid)
            if tr is not None and self._finish_step(tr) == step:
                return step
            heapq.heappop(self.finish_at)
        return None

    def finished(self) -> list[str]:
        """Ids of the active trajectories that have decoded their whole length."""
        out = []
        while True:
            step = self.first_finish()
            if step is None or step > self.steps:
                break
            tid = heapq.heappop(self.finish_at)[1]
            if tid not in out:  # re-admitted at the step it left: two equal entries
                out.append(tid)
        return out

    def add(self, tr: SimTraj) -> None:
        tr.mark = self.steps
        self.active[tr.tid] = tr
        self.ctx += tr.context
        heapq.heappush(self.finish_at, (self._finish_step(tr), tr.tid))

    def _limit(self) -> int:
        """Steps the active set can take before one finishes or the KV cache overflows."""
        first = self.first_finish()
        assert first is not None, "every active trajectory has its finish step on the heap"
        k = first - self.steps
        kv = kv_steps_left(self.ctx, len(self.active), self.params)
        return max(0, k if kv is None else min(k, kv))

    def advance(self, now: float, state: str = "") -> None:
        """Apply the whole decode steps that end by ``now`` (closed form, the active set is fixed); its
        intra-instance bubble counts towards ``state`` (what the instance did for the rules meanwhile)."""
        if self.active and self.t < now:
            n = len(self.active)
            k = min(self._limit(), decode_steps_within(now - self.t, n, self.capacity, self.ctx, self.params))
            if k > 0:
                dt = decode_time(k, n, self.capacity, self.ctx, self.params)
                self.t += dt
                self.lost.decode_s += dt
                bubble = dt * max(0.0, 1.0 - n / self.capacity)
                self.lost.intra_bubble_s += bubble
                self.lost.intra_by_state[state] = self.lost.intra_by_state.get(state, 0.0) + bubble
                self.steps += k
                self.ctx += n * k
        if not self.active and self.t < now:
            self.t = now

    def remove(self, tid: str) -> SimTraj | None:
        tr = self.active.pop(tid, None)
        if tr is not None:
            self.sync(tr)
            self.ctx -= tr.context
        return tr

    def next_event(self) -> float | None:
        if not self.active:
            return None
        k = max(1, self._limit())
        return self.t + decode_time(k, len(self.active), self.capacity, self.ctx, self.params)
