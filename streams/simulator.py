"""A discrete-event simulator driven by the *same* scheduling code as the real processes.

The orchestrator's rules (:mod:`dora_rl.streams.scheduling`, :mod:`dora_rl.streams.dora_policy`),
the batch plans and the assembler's batching rules (:mod:`dora_rl.streams.batching`), and the
instances' rule (:mod:`dora_rl.core.instance_policy`: which version to hold, which requests start)
run unchanged; only the world around them is simulated on a virtual clock:

- **instances**: each holds one version and decodes its active trajectories together, one token
  each per decode step of ``step_time(active, capacity)`` seconds (the emulated model of
  :mod:`dora_rl.core.emulation`), plus ``prefill_time(prompt + partial tokens)`` when a trajectory
  is admitted; lengths are the emulated model's long-tailed ``planned_length``;
- **trainer**: takes batch ``k`` when it is cut and idle, spends ``train_s_per_token * tokens +
  train_s_fixed``, then publishes version ``k + 1`` (switching an instance costs ``switch_s``);
- **migration**: a cancelled trajectory's tokens so far move to an instance of the same version.

So scale (thousands of instances) can be studied on one machine, and the rules' invariants
(C1–C3, TBS exact, nothing lost) are checked over random workloads in unit tests. The simulator
imports no Kafka client (a unit test checks it).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any

from dora_rl.config import DoraConfig
from dora_rl.core.emulation import EmulatedParams, planned_length, prefill_time, step_time
from dora_rl.core.instance_policy import next_version, startable

from .batching import BatchAssembler
from .scheduling import SchedulingRules, make_scheduler


@dataclass
class _Traj:
    tid: str
    group_id: str
    version: int
    length: int
    done_tokens: int = 0
    versions: set[int] = field(default_factory=set)


@dataclass(frozen=True)
class _Done:
    trajectory_id: str
    group_id: str
    policy_version: int


@dataclass
class SimResult:
    """What a simulated run produced."""

    steps: int
    wall_s: float
    trained_tokens: int
    step_end_s: list[float]
    staleness: list[int]
    batch_sizes: list[int]
    refused: int
    mixed_version_trajectories: int
    trainer_busy_s: float
    instance_busy_s: float
    dispatched: int
    migrations: int

    @property
    def throughput(self) -> float:
        """Trained tokens per simulated second."""
        return self.trained_tokens / self.wall_s if self.wall_s else 0.0


class _Instance:
    def __init__(self, index: int, capacity: int, params: EmulatedParams) -> None:
        self.index, self.capacity, self.params = index, capacity, params
        self.version = -1
        self.active: dict[str, _Traj] = {}
        self.queue: list[_Traj] = []  # waiting for a slot, or for the held version to drain (C1)
        self.t = 0.0  # time up to which decoding has been applied
        self.busy_s = 0.0
        self.epoch = 0  # invalidates scheduled events when the active set changes

    def advance(self, now: float) -> None:
        """Apply decoding up to ``now`` (whole steps only)."""
        while self.active and self.t < now:
            dt = step_time(len(self.active), self.capacity, self.params)
            if self.t + dt > now + 1e-12:
                break
            self.t += dt
            self.busy_s += dt
            for tr in self.active.values():
                tr.done_tokens += 1
        if not self.active:
            self.t = max(self.t, now)

    def next_finish(self) -> float | None:
        if not self.active:
            return None
        k = min(tr.length - tr.done_tokens for tr in self.active.values())
        return self.t + max(1, k) * step_time(len(self.active), self.capacity, self.params)


def simulate(config: DoraConfig, params: EmulatedParams | None = None, *, train_s_per_token: float = 2e-4,
             train_s_fixed: float = 0.2, switch_s: float = 0.05, max_events: int = 2_000_000) -> SimResult:
    """Run ``config`` on the virtual clock; returns figures and the invariant counters."""
    p = params or EmulatedParams(time_scale=0.0)
    sched: SchedulingRules[None] = make_scheduler(config)
    asm = BatchAssembler(config.train_batch_size, config.group_size, config.max_staleness)
    insts = [_Instance(i, config.instance_concurrency, p) for i in range(config.num_instances)]
    trajs: dict[str, _Traj] = {}
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def push(t: float, kind: str, data: Any) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, data))
        seq += 1

    def schedule(inst: _Instance) -> None:
        inst.epoch += 1
        nf = inst.next_finish()
        if nf is not None:
            push(nf, "tick", (inst.index, inst.epoch))

    for g in range(config.steps * config.train_batch_size // config.group_size + config.rollout_batch_size):
        sched.add_prompt(f"g{g}", None)
    now = 0.0
    trainer_free_at = 0.0
    trainer_busy = 0.0
    step_end: list[float] = []
    staleness: list[int] = []
    sizes: list[int] = []
    trained = 0
    refused = 0
    migrations = 0
    pending_batches: list[Any] = []
    sched.on_version(0, 0.0)

    def orchestrate(now: float) -> None:
        nonlocal migrations
        for d in sched.dispatch():
            inst = insts[d.instance]
            length, _ = planned_length(d.trajectory_id, config.max_new_tokens, p)
            tr = _Traj(d.trajectory_id, d.group_id, d.version, length)
            trajs[tr.tid] = tr
            admit(inst, tr, now)
        for cancel in sched.take_cancels():
            inst = insts[cancel.instance]
            inst.advance(now)
            for tid in cancel.trajectory_ids:
                found = inst.active.pop(tid, None)
                if found is None:
                    queued = [q for q in inst.queue if q.tid == tid]
                    inst.queue = [q for q in inst.queue if q.tid != tid]
                    found = queued[0] if queued else None
                if found is not None:
                    tr = found
                    sched.on_aborted(tid, tr, cancel.instance)
                    migrations += 1
            drain(inst, now)
            schedule(inst)
        for mig, target in sched.resumes():
            tr = mig.partial
            tr.version = mig.version
            admit(insts[target], tr, now)
        for step, tids in sched.plans():
            asm.on_plan(step, tids)

    def admit(inst: _Instance, tr: _Traj, now: float) -> None:
        """A request reaches an instance: it queues, and the instance rule decides what starts."""
        inst.advance(now)
        inst.queue.append(tr)
        drain(inst, now)

    def start(inst: _Instance, tr: _Traj, now: float) -> None:
        tr.versions.add(inst.version)
        inst.t = max(inst.t, now) + prefill_time(tr.done_tokens + 16, p)
        inst.active[tr.tid] = tr
        schedule(inst)

    def drain(inst: _Instance, now: float) -> None:
        """Start queued work as the real instance does (:mod:`dora_rl.core.instance_policy`): switch
        version only when nothing decodes (C1), then start the held version's requests into free slots."""
        version = next_version(inst.version, (tr.version for tr in inst.queue), len(inst.active))
        if version is None:
            return
        if version != inst.version:
            inst.version = version
            inst.t = max(inst.t, now) + switch_s
        starting = startable(inst.version, inst.queue, lambda tr: tr.version, len(inst.active), inst.capacity)
        if starting:
            ids = {tr.tid for tr in starting}
            inst.queue = [tr for tr in inst.queue if tr.tid not in ids]
            for tr in starting:
                start(inst, tr, now)

    def try_train(now: float) -> None:
        nonlocal trainer_free_at, trainer_busy, trained
        while (cut := asm.cut()) is not None:
            pending_batches.append(cut)  # the batches topic: the orchestrator sees the cut
            sched.on_consumed(cut.train_step, [t.trajectory_id for t in cut.trajectories])
        for _ in asm.refuse_over_stale():
            nonlocal refused
            refused += 1
        if pending_batches and trainer_free_at <= now:
            cut = pending_batches.pop(0)
            tokens = sum(trajs[t.trajectory_id].length for t in cut.trajectories)
            dur = train_s_fixed + train_s_per_token * tokens
            trainer_free_at = now + dur
            trainer_busy += dur
            trained += tokens
            staleness.extend(cut.staleness())
            sizes.append(len(cut.trajectories))
            push(trainer_free_at, "version", cut.train_step + 1)

    orchestrate(now)
    n_events = 0
    while events and len(step_end) < config.steps:
        n_events += 1
        if n_events > max_events:
            raise RuntimeError("simulation did not finish (deadlock or max_events too small)")
        now, _, kind, data = heapq.heappop(events)
        if kind == "tick":
            idx, epoch = data
            inst = insts[idx]
            if epoch != inst.epoch:
                continue
            inst.advance(now + 1e-12)
            for tid in [t for t, tr in inst.active.items() if tr.done_tokens >= tr.length]:
                tr = inst.active.pop(tid)
                sched.on_completed(tid)
                sched.on_scored(tid)  # no scorer here: a reward is instant
                asm.add(_Done(tid, tr.group_id, min(tr.versions)))
            drain(inst, now)
            schedule(inst)
        elif kind == "version":
            step_end.append(now)
            sched.on_version(int(data), now)
        orchestrate(now)
        try_train(now)
    mixed = sum(1 for tr in trajs.values() if len(tr.versions) > 1)
    return SimResult(steps=len(step_end), wall_s=step_end[-1] if step_end else now, trained_tokens=trained,
                     step_end_s=step_end, staleness=staleness, batch_sizes=sizes, refused=refused,
                     mixed_version_trajectories=mixed, trainer_busy_s=trainer_busy,
                     instance_busy_s=sum(i.busy_s for i in insts), dispatched=len(trajs), migrations=migrations)
