"""The orchestrator role: feeds events into the scheduling rules and emits version-tagged requests.

Reads ``dora.prompts``, ``dora.policy.versions``, ``dora.rollout.trajectories`` (decoding finished: the
instance is free of it), ``dora.rollout.scored`` (the trajectory has its reward: its group may be
planned once every member has one), ``dora.dlq`` (letters naming a ``group_id`` and signed with the run's
token: the group was refused, so it is withdrawn and a replacement prompt dispatched; an unsigned one is
dead-lettered, decision 0059), ``dora.train.batches`` (consumption) and, in
``dora``/``partial`` mode, the aborted chunks of
``dora.rollout.tokens`` (partials of migrating trajectories); writes ``dora.rollout.requests``
(partition = the target instance's index, key ``v<version>/<group_id>``), ``dora.schedule`` (batch
plans) and ``dora.metrics``.

It is a :class:`~dora_rl.streams.processor.Processor`: events go into the rules in :meth:`process`,
decisions come out in :meth:`punctuate` (once per poll: a punctuate with nothing to do costs
``O(S)``, ``S`` the max staleness, as the rules read counts kept in step instead of scanning
trajectories, :mod:`dora_rl.streams.dora_policy`; all the orchestrator does per training step costs
``O(N log N)`` for ``N`` instances, ``bench/orchestration.py``), and :meth:`snapshot` is the rules'
state with queued prompts and migrating partials kept as references into the log. Run by
:class:`~dora_rl.streams.kafka_runtime.KafkaDriver`, every commit puts the requests and plans decided,
the snapshot and the consumed positions in one transaction: a restarted orchestrator restores the
state its committed decisions were made in, so no prompt is dispatched twice or lost, and a zombie
is fenced. A commit comes at once when a request or a plan is decided (:func:`decisions_waiting`), else every
``commit_interval_s``. Recovery reads one snapshot and the referenced records, not the run's history.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dora_rl.config import DoraConfig
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.keys import make_key
from dora_rl.infra.kafka.signing import signature_problem, signed
from dora_rl.infra.weights.announcements import announcement_problem, kind_problem
from dora_rl.schemas.records import (
    BatchPlan,
    DeadLetter,
    InstanceStatus,
    Metric,
    PolicyVersion,
    Prompt,
    Record,
    RolloutRequest,
    TokenChunk,
    TrainBatch,
    Trajectory,
)

from .processor import Context, InRecord, OutRecord, Ref, dead_letter_for
from .rules import make_scheduler
from .scheduler_state import dump_state, load_state, payloads
from .scheduling_events import Aborted, Completed, Consumed, Heartbeat, PromptQueued, Refused, Scored, Tick, VersionSeen

log = logging.getLogger(__name__)
COMPONENT = "orchestrator"


def input_types(config: DoraConfig) -> dict[str, type[Record]]:
    """The topics the orchestrator reads in ``config.mode`` and their record types."""
    types: dict[str, type[Record]] = {topics.PROMPTS: Prompt, topics.VERSIONS: PolicyVersion,
                                      topics.TRAJECTORIES: Trajectory, topics.SCORED: Trajectory,
                                      topics.DLQ: DeadLetter, topics.BATCHES: TrainBatch}
    if config.mode == "dora" or config.mixes_versions:
        types[topics.TOKENS] = TokenChunk  # aborted partials of migrating trajectories
        types[topics.INSTANCES] = InstanceStatus  # heartbeats: which instances are alive
    return types


def prompt_lookahead(config: DoraConfig) -> int:
    """Prompts the orchestrator keeps queued ahead of dispatch: two rollout batches of groups, at least 16. A
    dispatch round takes at most one rollout batch (RBS in flight) plus replacements of refused groups, and a
    sync / one_step_off wave (TBS) is no larger, so the queue is never what holds dispatch back."""
    return max(16, 2 * max(config.rollout_batch_size, config.train_batch_size) // config.group_size)


class Orchestrator:
    """The orchestrator's logic (a processor; see the module docstring)."""

    name = COMPONENT

    def __init__(self, run_id: str, config: DoraConfig, token: str = "") -> None:
        self.run_id, self.config, self.token = run_id, config, token  # token: announcements' signatures
        self.inputs = tuple(input_types(config))
        self.rules = make_scheduler(config)
        self.prompts: dict[str, Prompt] = {}  # queued or dispatched-and-unconsumed groups
        self.prompt_ref: dict[str, Ref] = {}
        self.partial_ref: dict[str, Ref] = {}  # aborted chunks awaiting their resume
        self.segments: dict[str, list[int]] = {}  # partial mode: version of every token so far
        self.consumed_steps = 0
        self.sched_s = 0.0

    # -- processor -----------------------------------------------------------------------------

    def init(self, ctx: Context) -> None:
        pass

    def process(self, rec: InRecord, ctx: Context) -> None:
        r = rec.record
        t0 = time.perf_counter()
        if rec.topic == topics.PROMPTS:
            if r.group_id not in self.prompt_ref:  # a rerun of the dataset writes the same ids again
                self.prompts[r.group_id], self.prompt_ref[r.group_id] = r, rec.ref
                self.rules.handle(PromptQueued(r.group_id, r))
        elif rec.topic == topics.VERSIONS:
            problem = (announcement_problem(r, check_manifest=False, token=self.token)
                       or kind_problem(r, PolicyVersion.TRAINER))
            if problem is not None:  # the instances refuse it too: no version to schedule for
                letter = dead_letter_for(rec, COMPONENT, self.run_id, problem, "announcement", ctx.wall_ms())
                ctx.emit(topics.DLQ, letter, f"{rec.topic}/{rec.partition}/{rec.offset}")
            else:
                self.rules.handle(VersionSeen(int(r.version), ctx.now()))
        elif rec.topic == topics.TRAJECTORIES and self.token and (
                forged := signature_problem(r, self.token, f"trajectory {r.trajectory_id}")):
            letter = dead_letter_for(rec, COMPONENT, self.run_id, forged, "signature", ctx.wall_ms())
            ctx.emit(topics.DLQ, letter, f"{rec.topic}/{rec.partition}/{rec.offset}")  # it completed nothing
        elif rec.topic == topics.TRAJECTORIES:
            self.rules.handle(Completed(r.trajectory_id, len(r.prompt_ids), len(r.response_ids)))
        elif rec.topic == topics.SCORED:
            self.rules.handle(Scored(r.trajectory_id))
        elif rec.topic == topics.DLQ:
            if r.group_id and (forged := signature_problem(r, self.token, f"the refusal of group {r.group_id}")):
                letter = dead_letter_for(rec, COMPONENT, self.run_id, forged, "signature", ctx.wall_ms())
                ctx.emit(topics.DLQ, letter, f"{rec.topic}/{rec.partition}/{rec.offset}")  # names no group
            elif r.group_id and r.group_id in self.prompts:
                log.warning("group %s refused by %s (%s)", r.group_id, r.component, r.reason)
                self.rules.handle(Refused(r.group_id))
        elif rec.topic == topics.BATCHES and self.token and (
                forged := signature_problem(r, self.token, f"batch {r.batch_id}")):
            letter = dead_letter_for(rec, COMPONENT, self.run_id, forged, "signature", ctx.wall_ms())
            ctx.emit(topics.DLQ, letter, f"{rec.topic}/{rec.partition}/{rec.offset}")  # it consumed nothing
        elif rec.topic == topics.BATCHES:
            self.consumed_steps = max(self.consumed_steps, int(r.train_step) + 1)
            tids = [t.trajectory_id for t in r.trajectories]
            self.rules.handle(Consumed(int(r.train_step), tuple(tids)))
            for t in r.trajectories:
                self.segments.pop(t.trajectory_id, None)
                self.prompts.pop(t.group_id, None)
                self.prompt_ref.pop(t.group_id, None)
        elif rec.topic == topics.INSTANCES:
            self.rules.handle(Heartbeat(int(r.instance_index), ctx.now(), leaving=r.state == "STOPPED"))
        elif rec.topic == topics.TOKENS and r.aborted and self.token and (
                forged := signature_problem(r, self.token, f"the partial of {r.trajectory_id}")):
            letter = dead_letter_for(rec, COMPONENT, self.run_id, forged, "signature", ctx.wall_ms())
            ctx.emit(topics.DLQ, letter, f"{rec.topic}/{rec.partition}/{rec.offset}")  # nothing resumes from it
        elif rec.topic == topics.TOKENS and r.aborted:
            self.partial_ref[r.trajectory_id] = rec.ref
            self.rules.handle(Aborted(r.trajectory_id, r, int(r.instance_id.rsplit("-", 1)[-1])))
        self.sched_s += time.perf_counter() - t0

    def punctuate(self, now: float, ctx: Context) -> None:
        t0 = time.perf_counter()
        self.rules.handle(Tick(now))
        decided = self.rules.decide()
        out = 0
        for d in decided.dispatches:
            req = self._request(d.prompt, d.trajectory_id, d.version, d.instance, ctx)
            ctx.emit(topics.REQUESTS, req, make_key(d.version, d.group_id), partition=d.instance)
            out += 1
        for cancel in decided.cancels:
            for j, tid in enumerate(cancel.trajectory_ids):
                version = cancel.versions[j] if cancel.versions else self.rules.version_of(tid)
                req = self._request(self._prompt_of(tid), tid, version, cancel.instance, ctx).replace(
                    action="CANCEL")
                ctx.emit(topics.REQUESTS, req, make_key(version, req.group_id), partition=cancel.instance)
            if not cancel.versions:
                self._metric(ctx, "migrations_started", len(cancel.trajectory_ids))
        for mig, target in decided.resumes:
            self.partial_ref.pop(mig.trajectory_id, None)
            if mig.partial is None:  # its instance was lost: generated again from scratch, same version
                req = self._request(self._prompt_of(mig.trajectory_id), mig.trajectory_id, mig.version, target, ctx)
                ctx.emit(topics.REQUESTS, req, make_key(mig.version, req.group_id), partition=target)
                self.segments.pop(mig.trajectory_id, None)
                self._metric(ctx, "redispatched", 1)
                out += 1
                continue
            chunk: TokenChunk = mig.partial
            extra: dict[str, Any] = {}
            if self.config.mixes_versions:
                tv = self.segments.setdefault(mig.trajectory_id, [])
                tv.extend([int(chunk.policy_version)] * (len(chunk.token_ids) - len(tv)))
                extra = {"partial_versions": np.asarray(tv, dtype=np.int64)}
            kv = chunk.kv if int(chunk.policy_version) == mig.version else None  # rows of its own version only
            req = self._request(self._prompt_of(mig.trajectory_id), mig.trajectory_id, mig.version, target,
                                ctx).replace(partial_ids=chunk.token_ids, partial_logprobs=chunk.logprobs, kv=kv,
                                             **extra)
            ctx.emit(topics.REQUESTS, req, make_key(mig.version, req.group_id), partition=target)
            self._metric(ctx, "resumed", 1)
            out += 1
        for step, tids in decided.plans:
            plan = signed(BatchPlan(run_id=self.run_id, train_step=step, trajectory_ids=tuple(tids),
                                    ts_ms=ctx.wall_ms()), self.token)  # the assembler follows no other
            ctx.emit(topics.SCHEDULE, plan, make_key(step, "plan"))
            out += 1
        for gid in decided.withdrawn:  # after their cancels were built
            log.warning("group %s withdrawn: a replacement is dispatched", gid)
            self.prompts.pop(gid, None)
            self.prompt_ref.pop(gid, None)
            for tid in [t for t in self.partial_ref if t.rsplit("/", 1)[0] == gid]:
                del self.partial_ref[tid]
            self._metric(ctx, "groups_refused", 1)
        self.sched_s += time.perf_counter() - t0
        if out:
            self._metric(ctx, "scheduling_s", self.sched_s)

    def done(self) -> bool:
        """Every trajectory dispatched and every step consumed."""
        return self.rules.status().all_dispatched and self.consumed_steps >= self.config.steps

    def held_back(self) -> frozenset[str]:
        """``dora.prompts`` while :func:`prompt_lookahead` prompts are queued: the rest of the dataset waits in
        the log, so the snapshot (a reference per queued prompt) and the restore do not grow with it."""
        full = self.rules.status().queued_prompts >= prompt_lookahead(self.config)
        return frozenset({topics.PROMPTS}) if full else frozenset()

    def snapshot(self) -> bytes:
        state = {"rules": dump_state(self.rules, self._dump), "consumed_steps": self.consumed_steps,
                 "prompt_ref": {g: r.to_list() for g, r in self.prompt_ref.items()},
                 "partial_ref": {t: r.to_list() for t, r in self.partial_ref.items()},
                 "segments": self.segments, "sched_s": self.sched_s}
        return json.dumps(state, separators=(",", ":")).encode()

    def restore(self, snapshot: bytes, ctx: Context) -> None:
        state = json.loads(snapshot)
        self.prompt_ref = {g: Ref.from_list(r) for g, r in state["prompt_ref"].items()}
        self.partial_ref = {t: Ref.from_list(r) for t, r in state["partial_ref"].items()}
        records = ctx.fetch_many([*self.prompt_ref.values(), *self.partial_ref.values()])
        self.prompts = {g: records[r] for g, r in self.prompt_ref.items()}
        wanted = {tuple(p) for p in payloads(state["rules"])}
        missing = wanted - {tuple(r.to_list()) for r in (*self.prompt_ref.values(), *self.partial_ref.values())}
        if missing:
            raise RuntimeError(f"orchestrator snapshot references records it does not track: {sorted(missing)[:3]}")
        load_state(self.rules, state["rules"], lambda p: records[Ref.from_list(p)])
        self.segments = {t: [int(v) for v in vs] for t, vs in state["segments"].items()}
        self.consumed_steps = int(state["consumed_steps"])
        self.sched_s = float(state["sched_s"])

    def close(self) -> None:
        log.info("orchestrator stopping: %s", self.rules.describe())

    # -- helpers -------------------------------------------------------------------------------

    def _dump(self, payload: Any) -> list[Any] | None:
        if isinstance(payload, Prompt):
            return self.prompt_ref[payload.group_id].to_list()
        if isinstance(payload, TokenChunk):
            return self.partial_ref[payload.trajectory_id].to_list()
        raise TypeError(f"cannot reference a {type(payload).__name__} in a snapshot")

    def _prompt_of(self, trajectory_id: str) -> Prompt:
        return self.prompts[trajectory_id.rsplit("/", 1)[0]]

    def _request(self, p: Prompt, trajectory_id: str, version: int, instance: int, ctx: Context) -> RolloutRequest:
        """A GENERATE request for trajectory ``<group>/<i>`` of prompt ``p`` on ``instance``."""
        return RolloutRequest(
            run_id=self.run_id, trajectory_id=trajectory_id, group_id=p.group_id, prompt_id=p.prompt_id,
            sample_index=int(trajectory_id.rsplit("/", 1)[1]), group_size=self.config.group_size,
            policy_version=version, instance_id=f"rollout-{instance}", action="GENERATE", task=p.task,
            reference=p.reference, prompt_ids=p.prompt_ids, partial_ids=p.prompt_ids[:0],
            partial_logprobs=p.prompt_ids[:0].astype("<f4"), max_new_tokens=self.config.max_new_tokens,
            dispatched_ms=ctx.wall_ms())

    def _metric(self, ctx: Context, name: str, value: float) -> None:
        m = Metric(run_id=self.run_id, component=COMPONENT, name=name, value=float(value), ts_ms=ctx.wall_ms())
        ctx.emit(topics.METRICS, m, f"{COMPONENT}/{name}")


def run_orchestrator(bootstrap: str, run_id: str, config: DoraConfig,
                     start_offsets: dict[tuple[str, int], int], stop: Callable[[], bool] = lambda: False,
                     token: str = "") -> None:
    """Run until every trajectory is dispatched and every step consumed (or ``stop()``); ``token``: the run's
    weight-channel token, which proves an announcement genuine (unchecked when empty)."""
    from .kafka_runtime import KafkaDriver

    orch = Orchestrator(run_id, config, token)
    driver = KafkaDriver(bootstrap, run_id, orch, input_types(config), start_offsets, token=token)
    driver.run(stop, done=orch.done, urgent=lambda: decisions_waiting(driver.ctx.pending))


def decisions_waiting(pending: list[OutRecord]) -> bool:
    """Whether a decided request or batch plan waits for the commit: it is committed at once, not at the interval,
    as readers see it only then (read_committed) and someone idles until they do: an instance slot or a migrating
    trajectory for a request, the assembler and then the trainer for a plan. Metrics wait for the interval."""
    return any(o.topic in (topics.REQUESTS, topics.SCHEDULE) for o in pending)
