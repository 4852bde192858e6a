"""The staleness gate and batch assembler as a faust-streaming app (wiring only; rules live in
:mod:`dora_rl.streams.batching`).

Reads ``dora.rollout.scored``; writes ``dora.train.batches`` (trajectories inline) and ``dora.dlq``.

State: trajectories buffered but not yet in a batch live in a changelog-backed Faust table
(``pending``: trajectory id -> raw record bytes), so a restarted assembler recovers its buffer
from Kafka. The step counter and the ids of the last ``S + 2`` batches are recovered from the end of
``dora.train.batches``, and the plans of the steps not yet cut from the end of ``dora.schedule``,
before the worker starts. A complete group past its deadline that no plan names is a copy of
trajectories trained already (an instance regenerated them after a restart): it is dropped and
counted (``duplicates_dropped``), never batched. Duplicates (redeliveries) are dropped by trajectory id; the trainer is
idempotent on ``batch_id`` as a second line of defence.

One assembler is active per run (it needs the global view to cut batches across partitions); a
second worker in the same app joins as a standby and takes over on failure.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import faust

from dora_rl.config import DoraConfig
from dora_rl.infra import topics
from dora_rl.infra.crashpoints import crash_point
from dora_rl.infra.kafka_io import now_ms, read_backwards
from dora_rl.infra.keys import make_key
from dora_rl.schemas.codec import DecodeError
from dora_rl.schemas.records import BatchPlan, DeadLetter, Metric, TrainBatch, Trajectory

from .batching import BatchAssembler

log = logging.getLogger(__name__)
COMPONENT = "assembler"


def recover_progress(bootstrap: str, run_id: str, start: Mapping[int, int],
                     keep_steps: int) -> tuple[int, list[Trajectory]]:
    """(next train step, trajectories of the last ``keep_steps`` batches) of ``run_id``, read backwards
    from the end of ``dora.train.batches`` (no replay of the run: batches carry whole trajectories)."""
    batches: list[TrainBatch] = []
    for window in read_backwards(bootstrap, topics.BATCHES, 0, stop_at=start.get(0, 0), window=16):
        for msg in reversed(window):
            try:
                batch = TrainBatch.decode(msg.value(), msg.headers())
            except DecodeError:
                continue
            if batch.run_id == run_id:
                batches.append(batch)
        if len(batches) >= keep_steps:
            break
    if not batches:
        return 0, []
    next_step = max(int(b.train_step) for b in batches) + 1
    return next_step, [t for b in batches[:keep_steps] for t in b.trajectories]


def recover_plans(bootstrap: str, run_id: str, start: Mapping[int, int], next_step: int) -> list[BatchPlan]:
    """The plans of steps ``>= next_step`` (the orchestrator sends each plan once), read backwards from
    the end of ``dora.schedule`` until an older step is reached."""
    plans: list[BatchPlan] = []
    for window in read_backwards(bootstrap, topics.SCHEDULE, 0, stop_at=start.get(0, 0)):
        older = False
        for msg in window:
            try:
                plan = BatchPlan.decode(msg.value(), msg.headers())
            except DecodeError:
                continue
            if plan.run_id != run_id:
                continue
            if int(plan.train_step) >= next_step:
                plans.append(plan)
            else:
                older = True
        if older:
            break
    return plans


def _headers(event: Any) -> list[tuple[str, bytes]]:
    raw = getattr(event, "headers", None) or []
    items = raw.items() if isinstance(raw, Mapping) else raw
    return [(k if isinstance(k, str) else k.decode(), bytes(v)) for k, v in items]


def build_app(bootstrap: str, run_id: str, config: DoraConfig, start_offsets: dict[tuple[str, int], int]) -> faust.App:
    """The Faust app of one run's assembler (call ``faust.Worker(app).execute_from_commandline()``)."""
    app = faust.App(
        f"dora-{run_id}-assembler", broker=f"kafka://{bootstrap}", store="memory://", web_enabled=False,
        topic_partitions=config.num_partitions, producer_max_request_size=topics.BATCH_MAX_BYTES,
        consumer_max_fetch_size=topics.BATCH_MAX_BYTES, producer_acks=-1, broker_commit_every=100,
        consumer_auto_offset_reset="earliest", stream_wait_empty=False, table_cleanup_interval=3600.0,
        # a restarted worker rejoins after the dead one's session expires: keep that short
        broker_session_timeout=10.0, broker_heartbeat_interval=2.0,
    )
    scored = app.topic(topics.SCORED, key_type=bytes, value_type=bytes, key_serializer="raw",
                       value_serializer="raw", partitions=config.num_partitions)
    batches = app.topic(topics.BATCHES, key_serializer="raw", value_serializer="raw", partitions=1)
    schedule = app.topic(topics.SCHEDULE, key_type=bytes, value_type=bytes, key_serializer="raw",
                         value_serializer="raw", partitions=1)
    dlq = app.topic(topics.DLQ, key_serializer="raw", value_serializer="raw", partitions=1)
    metrics = app.topic(topics.METRICS, key_serializer="raw", value_serializer="raw", partitions=1)
    # use_partitioner: the plan agent (1-partition source) also deletes keys, so the changelog partition
    # comes from the key, not from the source event's partition
    pending = app.Table("pending", default=None, key_type=bytes, value_type=bytes,  # bytes => raw codec
                        partitions=config.num_partitions, use_partitioner=True)

    batches_start = {p: o for (t, p), o in start_offsets.items() if t == topics.BATCHES}
    scored_start = {p: o for (t, p), o in start_offsets.items() if t == topics.SCORED}
    schedule_start = {p: o for (t, p), o in start_offsets.items() if t == topics.SCHEDULE}
    state: dict[str, Any] = {"assembler": None, "refused": 0, "duplicates": 0}

    def assembler() -> BatchAssembler:
        if state["assembler"] is None:
            next_step, batched = recover_progress(bootstrap, run_id, batches_start, config.max_staleness + 2)
            asm = BatchAssembler(config.train_batch_size, config.group_size, config.max_staleness, next_step)
            asm.mark_seen(batched)
            for plan in recover_plans(bootstrap, run_id, schedule_start, next_step):
                asm.on_plan(int(plan.train_step), plan.trajectory_ids)
            for _tid, value in list(pending.items()):  # recovered from the changelog
                asm.add(Trajectory.decode(value))  # ids batched already count as duplicates
            state["assembler"] = asm
            log.info("assembler ready: next step %d, %d batched ids, %d pending", next_step, len(batched),
                     asm.pending())
        asm_out: BatchAssembler = state["assembler"]
        return asm_out

    async def refuse(event: Any, reason: str, error_type: str) -> None:
        letter = DeadLetter(component=COMPONENT, reason=reason, error_type=error_type,
                            source_topic=event.message.topic, source_partition=event.message.partition,
                            source_offset=event.message.offset, ts_ms=now_ms(), run_id=run_id,
                            key=event.key, value=event.value)
        value, headers = letter.encode()
        await dlq.send(key=event.key or b"", value=value, headers=headers)

    async def metric(name: str, value: float, step: int | None = None) -> None:
        m = Metric(run_id=run_id, component=COMPONENT, name=name, value=float(value), ts_ms=now_ms(), step=step)
        v, h = m.encode()
        await metrics.send(key=f"{COMPONENT}/{name}".encode(), value=v, headers=h)

    async def try_cut(event: Any) -> None:
        asm = assembler()
        for dup in asm.drop_expired_unplanned():  # copies of trajectories trained already (regenerated)
            state["duplicates"] += 1
            pending.pop(dup.trajectory_id.encode(), None)
        while (cut := asm.cut()) is not None:
            for problem in asm.violations(cut):  # never in a correct run: the safety gate
                state["refused"] += 1
                await refuse(event, f"batch {cut.train_step}: {problem}", "batch")
            batch = TrainBatch(run_id=run_id, batch_id=f"{run_id}/step{cut.train_step}",
                               train_step=cut.train_step, base_version=cut.train_step,
                               max_staleness=config.max_staleness, created_ms=now_ms(),
                               trajectories=tuple(cut.trajectories))  # type: ignore[arg-type]
            value, headers = batch.encode()
            await batches.send(key=make_key(cut.train_step, f"step{cut.train_step}").encode(),
                               value=value, headers=headers)
            crash_point("assembler.after_batch")
            for t in cut.trajectories:
                pending.pop(t.trajectory_id.encode(), None)
            stale = cut.staleness()
            await metric("batch_emitted", len(cut.trajectories), cut.train_step)
            await metric("batch_max_staleness", max(stale), cut.train_step)
            await metric("batch_refused", state["refused"], cut.train_step)
            await metric("duplicates_dropped", state["duplicates"], cut.train_step)
            log.info("batch step %d: %d trajectories, staleness max %d", cut.train_step,
                     len(cut.trajectories), max(stale))

    @app.agent(scored)
    async def assemble(stream: Any) -> None:
        try:
            await _assemble(stream)
        except Exception:  # an agent crash must end the worker, never leave it running idle
            log.exception("assembler agent crashed")
            os._exit(3)

    @app.agent(schedule)
    async def plans(stream: Any) -> None:
        try:
            await _plans(stream)
        except Exception:
            log.exception("plan agent crashed")
            os._exit(3)

    async def _assemble(stream: Any) -> None:
        async for event in stream.events():
            msg = event.message
            if msg.offset < scored_start.get(msg.partition, 0):
                continue  # before this run
            try:
                traj = Trajectory.decode(event.value, _headers(event))
            except DecodeError as exc:
                await refuse(event, str(exc), exc.error_type)
                continue
            if traj.run_id != run_id:
                continue
            if traj.reward is None:
                await refuse(event, "trajectory on dora.rollout.scored has no reward", "schema")
                continue
            if not assembler().add(traj):
                continue
            pending[traj.trajectory_id.encode()] = event.value
            await try_cut(event)

    async def _plans(stream: Any) -> None:
        async for event in stream.events():
            if event.message.offset < schedule_start.get(event.message.partition, 0):
                continue
            try:
                plan = BatchPlan.decode(event.value, _headers(event))
            except DecodeError as exc:
                await refuse(event, str(exc), exc.error_type)
                continue
            if plan.run_id != run_id:
                continue
            assembler().on_plan(int(plan.train_step), plan.trajectory_ids)
            await try_cut(event)

    return app


def run_assembler(bootstrap: str, run_id: str, config: DoraConfig, start_offsets: dict[tuple[str, int], int],
                  loglevel: str = "warning") -> None:
    """Run the Faust worker until it is stopped (SIGTERM/SIGINT)."""
    app = build_app(bootstrap, run_id, config, start_offsets)
    worker = faust.Worker(app, loglevel=loglevel, quiet=True)
    worker.execute_from_commandline()
