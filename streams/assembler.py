"""The batch assembler as a processor: scored trajectories + batch plans in, exactly one batch per step out.

Reads ``dora.rollout.scored`` and ``dora.schedule``; writes ``dora.train.batches`` (trajectories
inline), ``dora.dlq`` and ``dora.metrics``. The rules (groups, plans, the staleness gate, exact TBS)
are :class:`~dora_rl.streams.batching.BatchAssembler`; this module is the processor around them
(:mod:`dora_rl.streams.processor`), run by :class:`~dora_rl.streams.kafka_runtime.KafkaDriver`.

Exactly once: a batch, the snapshot of the assembler's state and the consumed offsets commit in one
transaction, so with ``read_committed`` there is exactly one batch record per train step, and a zombie
assembler is fenced. The snapshot holds the next step, the plans of the steps not yet cut, the ids of
the last ``S + 2`` batches (later copies of those are duplicates) and every pending trajectory as a
reference into ``dora.rollout.scored`` (fetched again at restore: a window of a few steps).

A scored trajectory that may not reach an update (:mod:`dora_rl.core.training_input`: a non-finite or
out-of-range reward, non-finite log-probs, ...) is refused on receipt with a dead letter naming its group,
which the orchestrator withdraws and replaces; it never enters a batch. A score not signed with the run's
scorer key (decision 0059) is refused too, with a dead letter that names no group: whoever planted it cannot
withdraw the group, nor have its reward trained; the scorer's own copy is trained when it arrives. So is a plan
not signed with the run's token; the batches it writes are signed with the token, for the trainer (decision 0060).

A complete group past its deadline that no plan names is a copy of trajectories trained already (an
instance regenerated them after a restart): it is dropped and counted (``duplicates_dropped``).

Latency (``bench/pipeline.py``): a poll returns as soon as a record is fetched (``linger_s=0``) and a cut
batch commits at once; the batch record is written from its trajectories' own bytes as read from
``dora.rollout.scored`` (kept at decode, :mod:`dora_rl.schemas.records`), not encoded again, at the price of
holding each pending trajectory's bytes beside its arrays.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Callable

from dora_rl.config import DoraConfig
from dora_rl.core.training_input import trajectory_problem
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.keys import make_key
from dora_rl.infra.kafka.signing import signature_problem, signed
from dora_rl.schemas.records import BatchPlan, DeadLetter, Metric, Record, TrainBatch, Trajectory

from .batching import BatchAssembler
from .processor import Context, InRecord, Ref, dead_letter_for

log = logging.getLogger(__name__)
COMPONENT = "assembler"
INPUTS: dict[str, type[Record]] = {topics.SCORED: Trajectory, topics.SCHEDULE: BatchPlan}


class Assembler:
    """The assembler's processor (see the module docstring)."""

    name = COMPONENT
    inputs = tuple(INPUTS)

    def __init__(self, run_id: str, config: DoraConfig, scorer_key: str = "", token: str = "") -> None:
        self.run_id, self.config = run_id, config
        self.scorer_key, self.token = scorer_key, token  # checks the scores / signs the refusals (empty: neither)
        self.rules = BatchAssembler(config.train_batch_size, config.group_size, config.max_staleness)
        self.refs: dict[str, Ref] = {}  # pending trajectory id -> where it lies on dora.rollout.scored
        self.recent: deque[list[str]] = deque(maxlen=config.max_staleness + 2)  # ids of the last batches
        self.refused = 0
        self.duplicates = 0

    def init(self, ctx: Context) -> None:
        pass

    def process(self, rec: InRecord, ctx: Context) -> None:
        if rec.topic == topics.SCHEDULE:
            forged = signature_problem(rec.record, self.token, f"the plan of step {rec.record.train_step}")
            if forged is not None:  # not the orchestrator's: the genuine plan of that step is followed
                self._letter(ctx, rec, forged)
            else:
                self.rules.on_plan(int(rec.record.train_step), rec.record.trajectory_ids)
            return
        traj: Trajectory = rec.record
        forged = signature_problem(traj, self.scorer_key, f"the score of {traj.trajectory_id}")
        if forged is not None:  # not the scorer's: refused, and its group is left alone (no withdrawal)
            self._letter(ctx, rec, forged)
            return
        problem = trajectory_problem(traj.prompt_ids, traj.response_ids, traj.behaviour_logprobs, traj.reward,
                                     traj.token_versions, self.config.vocab_size or None)
        if problem is not None:  # an external scorer may write anything: its group is refused and replaced
            self._refuse(ctx, rec, f"untrainable trajectory {traj.trajectory_id}: {problem}", "input",
                         traj.encode()[0], traj)
        elif self.rules.add(traj):
            self.refs[traj.trajectory_id] = rec.ref

    def punctuate(self, now: float, ctx: Context) -> None:
        for dup in self.rules.drop_expired_unplanned():
            self.refs.pop(dup.trajectory_id, None)
            self.duplicates += 1
        while (cut := self.rules.cut()) is not None:
            for problem in self.rules.violations(cut):  # never in a correct run: the safety gate
                self.refused += 1
                letter = DeadLetter(component=COMPONENT, reason=f"batch {cut.train_step}: {problem}",
                                    error_type="batch", source_topic=topics.SCHEDULE, source_partition=0,
                                    source_offset=-1, ts_ms=ctx.wall_ms(), run_id=self.run_id)
                ctx.emit(topics.DLQ, letter, f"step{cut.train_step}")
            batch = signed(TrainBatch(run_id=self.run_id, batch_id=f"{self.run_id}/step{cut.train_step}",
                                      train_step=cut.train_step, base_version=cut.train_step,
                                      max_staleness=self.config.max_staleness, created_ms=ctx.wall_ms(),
                                      trajectories=tuple(cut.trajectories)),  # type: ignore[arg-type]
                           self.token)  # the trainer trains no other
            ctx.emit(topics.BATCHES, batch, make_key(cut.train_step, f"step{cut.train_step}"))
            ids = [t.trajectory_id for t in cut.trajectories]
            for tid in ids:
                self.refs.pop(tid, None)
            self.recent.append(ids)
            stale = cut.staleness()
            for name, value in (("batch_emitted", len(ids)), ("batch_max_staleness", max(stale)),
                                ("batch_refused", self.refused), ("duplicates_dropped", self.duplicates)):
                m = Metric(run_id=self.run_id, component=COMPONENT, name=name, value=float(value),
                           ts_ms=ctx.wall_ms(), step=cut.train_step)
                ctx.emit(topics.METRICS, m, f"{COMPONENT}/{name}")
            log.info("batch step %d: %d trajectories, staleness max %d", cut.train_step, len(ids), max(stale))

    def held_back(self) -> frozenset[str]:
        return frozenset()  # never: its inputs are bounded by what the run has in flight

    def snapshot(self) -> bytes:
        state = {"next_step": self.rules.next_step,
                 "plans": {str(k): list(v) for k, v in self.rules._plans.items()},
                 "pending": {t: r.to_list() for t, r in self.refs.items()},
                 "recent": list(self.recent), "refused": self.refused, "duplicates": self.duplicates}
        return json.dumps(state, separators=(",", ":")).encode()

    def restore(self, snapshot: bytes, ctx: Context) -> None:
        state = json.loads(snapshot)
        self.rules = BatchAssembler(self.config.train_batch_size, self.config.group_size, self.config.max_staleness,
                                    next_step=int(state["next_step"]))
        self.recent = deque(state["recent"], maxlen=self.config.max_staleness + 2)
        self.rules._seen.update(t for ids in self.recent for t in ids)
        for step, ids in state["plans"].items():
            self.rules.on_plan(int(step), ids)
        self.refs = {t: Ref.from_list(r) for t, r in state["pending"].items()}
        records = ctx.fetch_many(self.refs.values())
        for tid, ref in self.refs.items():
            self.rules.add(records[ref])
            if records[ref].trajectory_id != tid:
                raise RuntimeError(f"assembler snapshot: {ref} holds {records[ref].trajectory_id}, not {tid}")
        self.refused, self.duplicates = int(state["refused"]), int(state["duplicates"])

    def close(self) -> None:
        log.info("assembler stopping: next step %d, %d pending", self.rules.next_step, self.rules.pending())

    def _letter(self, ctx: Context, rec: InRecord, forged: str) -> None:
        """A dead letter naming no group: a record not signed by its writer is refused, nothing withdrawn."""
        self.refused += 1
        letter = dead_letter_for(rec, COMPONENT, self.run_id, forged, "signature", ctx.wall_ms())
        ctx.emit(topics.DLQ, letter, f"{rec.topic}/{rec.partition}/{rec.offset}")

    def _refuse(self, ctx: Context, rec: InRecord, reason: str, error_type: str, value: bytes,
                traj: Trajectory) -> None:
        """A dead letter naming the trajectory's group: the orchestrator withdraws it and dispatches another."""
        self.refused += 1
        letter = signed(dead_letter_for(rec, COMPONENT, self.run_id, reason, error_type, ctx.wall_ms(), value=value,
                                        group_id=traj.group_id, trajectory_id=traj.trajectory_id), self.token)
        ctx.emit(topics.DLQ, letter, f"{rec.topic}/{rec.partition}/{rec.offset}")


def run_assembler(bootstrap: str, run_id: str, config: DoraConfig, start_offsets: dict[tuple[str, int], int],
                  stop: Callable[[], bool] = lambda: False, token: str = "", scorer_key: str = "") -> None:
    """Assemble until ``stop()``; every batch commits with the state and offsets in one transaction (its
    snapshots and refusals signed with the run's ``token``); it trains only scores signed with ``scorer_key``
    (the token when empty)."""
    from .kafka_runtime import KafkaDriver

    asm = Assembler(run_id, config, scorer_key=scorer_key or token, token=token)
    driver = KafkaDriver(bootstrap, run_id, asm, INPUTS, start_offsets, commit_interval_s=0.5, linger_s=0.0,
                         token=token)
    driver.run(stop, urgent=lambda: any(o.topic == topics.BATCHES for o in driver.ctx.pending))
