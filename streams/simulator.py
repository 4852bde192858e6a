"""A discrete-event simulator driven by the *same* scheduling code as the real processes.

The orchestrator's rules (:mod:`dora_rl.streams.scheduling`, :mod:`dora_rl.streams.dora_policy`),
the batch plans and the assembler's batching rules (:mod:`dora_rl.streams.batching`), and the
instances' rule (:mod:`dora_rl.core.instance_policy`: which version to hold, which requests start)
run unchanged; only the world around them is simulated on a virtual clock:

- **instances**: each holds one version and decodes its active trajectories together, one token
  each per decode step; the costs are the emulated model's (:mod:`dora_rl.core.emulation`): a step's
  time grows with occupancy and with the context its sequences hold (KV reads), prefill (and the
  re-prefill of a resumed partial) grows with its tokens, admission waits for KV capacity and an
  overflow preempts the newest sequence (recomputed later), a version switch costs ``switch_s``;
  lengths are the model's long-tailed ``planned_length``. Between events an instance's active set is
  fixed, so its progress is advanced in closed form (:func:`decode_steps_within`), not step by step;
- **trainer**: takes batch ``k`` when it is cut and idle, spends :func:`modelled_train_s` (``train_s_fixed +
  train_s_per_token * (prompt + response tokens)``, the real trainer's modelled time too), then publishes
  version ``k + 1`` (``colocated``: the instances share its GPUs and pause while it trains, their KV cache
  freed for the trainer's memory unless ``colocated_keeps_kv``);
- **orchestrator**: its rules run at every event and on a timer every ``tick_s`` (the real orchestrator's
  punctuate runs once per poll, whether or not a record arrived), so a timed rule fires in an idle gap;
- **migration**: a cancelled trajectory's tokens so far move to an instance of the same version.

Where the time goes (instance-seconds, :class:`LostTime`): decoding (its empty slots are the
*intra-instance bubble*), prefill of new requests, re-prefill of resumed or preempted partials,
weight switches, and idle with nothing to decode (the *inter-instance bubble*); the trainer's wait
for its next batch is ``wall - trainer busy``.

So scale (thousands of instances) can be studied on one machine, and the rules' invariants
(C1–C3, TBS exact, nothing lost) are checked over random workloads in unit tests. The simulator
imports no Kafka client (a unit test checks it).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from dora_rl.config import DoraConfig
from dora_rl.core.emulation import (
    EmulatedParams,
    for_instance,
    kv_admits,
    kv_steps_left,
    modelled_train_s,
    planned_length,
    prefill_time,
)
from dora_rl.core.instance_policy import next_version, startable

from .batching import BatchAssembler
from .rules import make_scheduler
from .scheduling import SchedulingRules
from .scheduling_events import Aborted, Completed, Consumed, Decisions, PromptQueued, Scored, Tick, VersionSeen
from .sim_instance import LostTime, SimInstance, SimTraj

STALL_TICKS = 10_000
"""Timer ticks in a row with no other event after which a run is declared stalled (an error)."""


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
    lost: LostTime = field(default_factory=lambda: LostTime())
    train_start_s: list[float] = field(default_factory=list)
    train_s: list[float] = field(default_factory=list)
    step_tokens: list[int] = field(default_factory=list)
    """Response tokens of each step's batch."""

    @property
    def throughput(self) -> float:
        """Trained tokens per simulated second."""
        return self.trained_tokens / self.wall_s if self.wall_s else 0.0


def simulate(config: DoraConfig, params: EmulatedParams | None = None, *, train_s_per_token: float = 2e-4,
             train_s_fixed: float = 0.2, switch_s: float = 0.05, prompt_tokens: int = 16,
             max_events: int | None = None, group_prefix: str = "g", colocated: bool = False,
             colocated_keeps_kv: bool = False, tick_s: float = 1.0,
             kv_across_versions: bool = False) -> SimResult:
    """Run ``config`` on the virtual clock; returns figures and the invariant counters.

    ``prompt_tokens`` is every prompt's length (prefill, KV and the trainer's cost count it).
    ``max_events`` (default ``100`` per trajectory of the run, at least 2M) stops a run that livelocks.
    Group ``i`` is ``f"{group_prefix}{i}"``: with a real run's prefix (``"<run id>/p"``, the dataset role's
    ids) every request draws the same emulated length as in that run (lengths hash the request id).
    ``colocated``: the trainer shares the instances' GPUs (the Kimi-style layout), so every instance pauses
    while a step trains: work in progress, a prefill included, resumes when the step ends. Its sequences' KV
    cache is freed for the trainer (verl's and Kimi's engines release it while the trainer holds the GPUs),
    so each resumes with a re-prefill of its context; ``colocated_keeps_kv`` keeps it resident instead (no
    real 32B setup has the memory for both: a favourable upper bound). ``tick_s``: the orchestrator's
    punctuate period (the rules also run at every event). ``kv_across_versions``: a trajectory moved to an
    instance of another version keeps its KV (charged as a move, not a re-prefill). No engine can do this exactly
    (the KV was computed by other weights): it prices partial rollout with its one cost that a scheduler keeping
    C1 avoids removed, so it is the ceiling of any such scheduler at the same rules (decision 0073)."""
    p = params or EmulatedParams(time_scale=0.0)
    sched: SchedulingRules[None] = make_scheduler(config)
    asm = BatchAssembler(config.train_batch_size, config.group_size, config.max_staleness)
    insts = [SimInstance(i, config.instance_concurrency, for_instance(p, i)) for i in range(config.num_instances)]
    trajs: dict[str, SimTraj] = {}
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def push(t: float, kind: str, data: Any) -> None:
        nonlocal seq
        heapq.heappush(events, (t, seq, kind, data))
        seq += 1

    def schedule(inst: SimInstance) -> None:
        inst.epoch += 1
        nf = inst.next_event()
        if nf is not None:
            push(nf, "tick", (inst.index, inst.epoch))

    for g in range(config.steps * config.train_batch_size // config.group_size + config.rollout_batch_size):
        sched.handle(PromptQueued(f"{group_prefix}{g}", None))
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
    train_start: list[float] = []
    train_s: list[float] = []
    step_tokens: list[int] = []
    sched.handle(VersionSeen(0, 0.0))

    def orchestrate(now: float) -> None:
        """As the orchestrator's punctuate: a tick (timed and pressure re-partitions, lost instances), then
        its decisions. Instances here hand a cancelled trajectory back at once, so the rules decide again
        at the same instant while a round aborted any (their resumes are placed now)."""
        sched.handle(Tick(now))
        while carry_out(sched.decide(), now):
            pass

    def carry_out(decided: Decisions[None], now: float) -> bool:
        """Carry out one round of decisions; returns whether a cancel handed a trajectory back."""
        nonlocal migrations
        aborted = False
        for d in decided.dispatches:
            inst = insts[d.instance]
            length, _ = planned_length(d.trajectory_id, config.max_new_tokens, p)
            tr = SimTraj(d.trajectory_id, d.group_id, d.version, length, prompt_tokens)
            trajs[tr.tid] = tr
            admit(inst, tr, now)
        for cancel in decided.cancels:
            inst = insts[cancel.instance]
            inst.advance(now, sched.instance_state(inst.index, inst.version))
            wanted = set(cancel.trajectory_ids)
            queued: dict[str, SimTraj] = {}
            for v, waiting in inst.queue.items():
                if any(q.tid in wanted for q in waiting):
                    queued.update((q.tid, q) for q in waiting if q.tid in wanted)
                    inst.queue[v] = deque(q for q in waiting if q.tid not in wanted)
            for tid in cancel.trajectory_ids:
                active = inst.remove(tid)
                found = active or queued.get(tid)
                if found is not None:
                    found.kv_held = active is not None and p.kv_move_s_per_token > 0
                    sched.handle(Aborted(tid, found, cancel.instance))
                    migrations += 1
                    aborted = True
            drain(inst, now)
            schedule(inst)
        for mig, target in decided.resumes:
            tr = mig.partial
            # KV of other weights is recomputed (unless the ceiling of decision 0073 is asked for)
            tr.kv_held = tr.kv_held and (kv_across_versions or tr.version == mig.version)
            tr.version = mig.version
            admit(insts[target], tr, now)
        for step, tids in decided.plans:
            asm.on_plan(step, tids)
        return aborted

    def admit(inst: SimInstance, tr: SimTraj, now: float) -> None:
        """A request reaches an instance: it queues, and the instance rule decides what starts."""
        inst.advance(now, sched.instance_state(inst.index, inst.version))
        waiting = inst.queue.setdefault(tr.version, deque())
        if tr.kv_held:
            waiting.appendleft(tr)  # its KV moves in: it resumes first
        else:
            waiting.append(tr)
        drain(inst, now)

    def start(inst: SimInstance, tr: SimTraj, now: float) -> None:
        tr.versions.add(inst.version)
        pre = prefill_time(tr.context, inst.params)  # its own speed (``for_instance``)
        if tr.kv_held:
            pre = tr.context * inst.params.kv_move_s_per_token
            inst.lost.kv_move_s += pre
            tr.kv_held = False
        elif tr.done_tokens:
            inst.lost.reprefill_s += pre
        else:
            inst.lost.prefill_s += pre
        inst.t = max(inst.t, now) + pre
        inst.add(tr)
        schedule(inst)

    def fit_kv(inst: SimInstance) -> None:
        """Preempt the newest sequences until the next decode step fits the KV cache (recomputed later)."""
        while kv_steps_left(inst.ctx, len(inst.active), p) == 0:
            tr = inst.remove(next(reversed(inst.active)))
            assert tr is not None
            tr.kv_held = False  # preempted: its KV is freed, recomputed when it starts again
            inst.queue.setdefault(tr.version, deque()).appendleft(tr)
            inst.lost.preemptions += 1

    def drain(inst: SimInstance, now: float) -> None:
        """Start queued work as the real instance does (:mod:`dora_rl.core.instance_policy`): switch
        version only when nothing decodes (C1), then start the held version's requests into free slots."""
        version = next_version(inst.version, (v for v, q in inst.queue.items() if q), len(inst.active))
        if version is None:
            return
        if version != inst.version:
            inst.version = version
            inst.t = max(inst.t, now) + switch_s
            inst.lost.switch_s += switch_s
        waiting = inst.queue.get(inst.version, deque())
        starting = startable(inst.version, waiting, lambda tr: tr.version, len(inst.active), inst.capacity)
        for tr in starting:  # the head of the held version's queue; the first that does not fit the KV cache
            if not kv_admits(inst.ctx, len(inst.active), tr.context, p):  # waits, and those after it
                break
            assert waiting[0] is tr
            waiting.popleft()
            start(inst, tr, now)

    def pause(inst: SimInstance, now: float, dur: float) -> None:
        """Hold ``inst`` still for ``[now, now + dur)``: its clock moves past the pause (not counted as use).
        Unless ``colocated_keeps_kv``, its active sequences lose their KV and queue first, in order, to be
        prefilled again when the pause ends (``resume_paused``)."""
        inst.advance(now, sched.instance_state(inst.index, inst.version))
        if not colocated_keeps_kv:
            for tid in reversed(list(inst.active)):
                tr = inst.remove(tid)
                assert tr is not None
                tr.kv_held = False
                inst.queue.setdefault(tr.version, deque()).appendleft(tr)
        inst.t = (inst.t if inst.active or inst.t > now else now) + dur
        schedule(inst)

    def resume_paused(now: float) -> None:
        """After a colocated step: every instance starts its queued work again (nothing else wakes an
        instance whose sequences were all put back to its queue)."""
        for inst in insts:
            drain(inst, now)
            schedule(inst)

    def try_train(now: float) -> None:
        nonlocal trainer_free_at, trainer_busy, trained
        while (cut := asm.cut()) is not None:
            pending_batches.append(cut)  # the batches topic: the orchestrator sees the cut
            sched.handle(Consumed(cut.train_step, tuple(t.trajectory_id for t in cut.trajectories)))
        for _ in asm.refuse_over_stale():
            nonlocal refused
            refused += 1
        if pending_batches and trainer_free_at <= now:
            cut = pending_batches.pop(0)
            tokens = sum(trajs[t.trajectory_id].length for t in cut.trajectories)
            dur = modelled_train_s(train_s_fixed, train_s_per_token, tokens + prompt_tokens * len(cut.trajectories))
            train_start.append(now)
            train_s.append(dur)
            step_tokens.append(tokens)
            trainer_free_at = now + dur
            trainer_busy += dur
            for inst in insts if colocated else ():
                pause(inst, now, dur)
            trained += tokens
            staleness.extend(cut.staleness())
            sizes.append(len(cut.trajectories))
            push(trainer_free_at, "version", cut.train_step + 1)

    orchestrate(now)
    push(tick_s, "timer", None)
    n_events = idle_ticks = 0
    limit = max_events or max(2_000_000, 100 * config.steps * config.train_batch_size)
    while events and len(step_end) < config.steps:
        n_events += 1
        if n_events > limit:
            raise RuntimeError(f"simulation did not finish (livelock, or max_events too small) at step "
                               f"{len(step_end)}, t={now:.0f}: {sched.describe()[:400]}")
        now, _, kind, data = heapq.heappop(events)
        if kind == "tick":
            idx, epoch = data
            inst = insts[idx]
            if epoch != inst.epoch:
                continue
            # past rounding: ulp(now) grows with now
            inst.advance(now + 1e-9 * max(1.0, now), sched.instance_state(inst.index, inst.version))
            for tid in inst.finished():
                tr = inst.remove(tid)
                assert tr is not None
                sched.handle(Completed(tid, tr.prompt, tr.length))  # what the trajectories topic carries
                sched.handle(Scored(tid))  # no scorer here: a reward is instant
                asm.add(_Done(tid, tr.group_id, min(tr.versions)))
            fit_kv(inst)
            drain(inst, now)
            schedule(inst)
        elif kind == "version":
            step_end.append(now)
            sched.handle(VersionSeen(int(data), now))
            if colocated:
                resume_paused(now)
        elif kind == "timer":
            idle_ticks += 1
            if idle_ticks > STALL_TICKS:
                raise RuntimeError(f"simulation stalled: nothing happened for {STALL_TICKS} ticks at step "
                                   f"{len(step_end)}, t={now:.0f}: {sched.describe()[:400]}")
            push(now + tick_s, "timer", None)
        if kind != "timer":
            idle_ticks = 0
        orchestrate(now)
        try_train(now)
    mixed = sum(1 for tr in trajs.values() if len(tr.versions) > 1)
    wall = step_end[-1] if step_end else now
    parts = [i.lost for i in insts]
    lost = LostTime(decode_s=sum(x.decode_s for x in parts), intra_bubble_s=sum(x.intra_bubble_s for x in parts),
                    prefill_s=sum(x.prefill_s for x in parts), reprefill_s=sum(x.reprefill_s for x in parts),
                    kv_move_s=sum(x.kv_move_s for x in parts),
                    intra_by_state={k: sum(x.intra_by_state.get(k, 0.0) for x in parts)
                                    for k in sorted({k for x in parts for k in x.intra_by_state})},
                    switch_s=sum(x.switch_s for x in parts), preemptions=sum(x.preemptions for x in parts))
    used = lost.decode_s + lost.prefill_s + lost.reprefill_s + lost.kv_move_s + lost.switch_s
    lost.idle_s = max(0.0, wall * len(insts) - used)
    return SimResult(steps=len(step_end), wall_s=wall, trained_tokens=trained,
                     step_end_s=step_end, staleness=staleness, batch_sizes=sizes, refused=refused,
                     mixed_version_trajectories=mixed, trainer_busy_s=trainer_busy,
                     instance_busy_s=used, dispatched=len(trajs), migrations=migrations, lost=lost,
                     train_start_s=train_start, train_s=train_s, step_tokens=step_tokens)
