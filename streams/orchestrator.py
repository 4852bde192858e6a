"""The orchestrator role: feeds events into the scheduling rules and emits version-tagged requests.

Reads ``dora.prompts``, ``dora.policy.versions``, ``dora.rollout.trajectories`` (completions) and
``dora.train.batches`` (consumption); writes ``dora.rollout.requests`` with partition = the target
instance's index and key ``v<version>/<group_id>``.

Recovery: the orchestrator commits no offsets. On (re)start it reads every input from the run's
start offsets and *also* its own past output (``dora.rollout.requests``) so that a prompt already
dispatched is never dispatched twice; its state is therefore a pure function of the topics.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from dora_rl.config import DoraConfig
from dora_rl.infra import topics
from dora_rl.infra.kafka_io import DeadLetters, Metrics, RecordProducer, RunConsumer, now_ms
from dora_rl.infra.keys import make_key
from dora_rl.schemas.records import (
    BatchPlan,
    PolicyVersion,
    Prompt,
    RolloutRequest,
    TokenChunk,
    TrainBatch,
    Trajectory,
)

from .scheduling import Dispatch, make_scheduler

log = logging.getLogger(__name__)
COMPONENT = "orchestrator"


def request_for(run_id: str, d: Dispatch[Prompt], config: DoraConfig) -> RolloutRequest:
    """The request record of one dispatch."""
    p = d.prompt
    return RolloutRequest(
        run_id=run_id, trajectory_id=d.trajectory_id, group_id=d.group_id, prompt_id=p.prompt_id,
        sample_index=d.sample_index, group_size=config.group_size, policy_version=d.version,
        instance_id=f"rollout-{d.instance}", action="GENERATE", task=p.task, reference=p.reference,
        prompt_ids=p.prompt_ids, partial_ids=p.prompt_ids[:0], partial_logprobs=p.prompt_ids[:0].astype("<f4"),
        max_new_tokens=config.max_new_tokens, dispatched_ms=now_ms())


def run_orchestrator(bootstrap: str, run_id: str, config: DoraConfig,
                     start_offsets: dict[tuple[str, int], int], stop: Callable[[], bool] = lambda: False) -> None:
    """Run until every trajectory is dispatched and every step consumed (or ``stop()``)."""
    producer = RecordProducer(bootstrap, f"{COMPONENT}-{run_id}")
    dlq = DeadLetters(producer, COMPONENT, run_id)
    metrics = Metrics(producer, run_id, COMPONENT)
    inputs: dict[str, type[Any]] = {topics.PROMPTS: Prompt, topics.VERSIONS: PolicyVersion,
                                    topics.TRAJECTORIES: Trajectory, topics.BATCHES: TrainBatch,
                                    topics.REQUESTS: RolloutRequest}
    if config.mode in ("dora", "partial"):
        inputs[topics.TOKENS] = TokenChunk  # aborted partials of migrating trajectories
    consumer = RunConsumer(bootstrap, run_id, COMPONENT, inputs, dlq, start_offsets, group_suffix=f".{now_ms()}")
    scheduler = make_scheduler(config)
    requests: dict[str, RolloutRequest] = {}
    segments: dict[str, list[int]] = {}  # partial mode: version of every token generated so far
    already: set[str] = set()
    sched_s = 0.0
    consumed_steps = 0
    try:
        while not stop():
            envelopes = consumer.poll(0.1)
            t0 = time.perf_counter()
            for env in envelopes:
                rec = env.record
                if env.topic == topics.PROMPTS:
                    if rec.group_id not in already:
                        scheduler.add_prompt(rec.group_id, rec)
                elif env.topic == topics.VERSIONS:
                    scheduler.on_version(int(rec.version), time.monotonic())
                elif env.topic == topics.TRAJECTORIES:
                    scheduler.on_completed(rec.trajectory_id)
                elif env.topic == topics.BATCHES:
                    consumed_steps = max(consumed_steps, int(rec.train_step) + 1)
                    scheduler.on_consumed(int(rec.train_step), [t.trajectory_id for t in rec.trajectories])
                elif env.topic == topics.REQUESTS:
                    already.add(rec.group_id)  # dispatched by an earlier incarnation
                elif env.topic == topics.TOKENS and rec.aborted:
                    scheduler.on_aborted(rec.trajectory_id, rec, int(rec.instance_id.rsplit("-", 1)[-1]))
            scheduler.tick(time.monotonic())
            out = 0
            for d in scheduler.dispatch():
                req = request_for(run_id, d, config)
                requests[req.trajectory_id] = req
                producer.send(topics.REQUESTS, req, make_key(d.version, d.group_id), partition=d.instance)
                already.add(d.group_id)
                out += 1
            for cancel in scheduler.take_cancels():
                for tid in cancel.trajectory_ids:
                    req = requests[tid].replace(action="CANCEL", dispatched_ms=now_ms())
                    producer.send(topics.REQUESTS, req, make_key(int(req.policy_version), req.group_id),
                                  partition=cancel.instance)
                metrics.emit("migrations_started", len(cancel.trajectory_ids))
            for mig, target in scheduler.resumes():
                chunk: TokenChunk = mig.partial
                prev = requests[mig.trajectory_id]
                extra: dict[str, Any] = {}
                if config.mode == "partial":
                    tv = segments.setdefault(mig.trajectory_id, [])
                    tv.extend([int(chunk.policy_version)] * (len(chunk.token_ids) - len(tv)))
                    extra = {"policy_version": mig.version, "partial_versions": np.asarray(tv, dtype=np.int64)}
                req = prev.replace(
                    instance_id=f"rollout-{target}", action="GENERATE", partial_ids=chunk.token_ids,
                    partial_logprobs=chunk.logprobs, dispatched_ms=now_ms(), **extra)
                requests[mig.trajectory_id] = req
                producer.send(topics.REQUESTS, req, make_key(mig.version, req.group_id), partition=target)
                out += 1
            for step, tids in scheduler.plans():
                plan = BatchPlan(run_id=run_id, train_step=step, trajectory_ids=tuple(tids), ts_ms=now_ms())
                producer.send(topics.SCHEDULE, plan, make_key(step, "plan"))
                out += 1
            sched_s += time.perf_counter() - t0
            if out:
                producer.flush()
                metrics.emit("scheduling_s", sched_s)
            if scheduler.done() and consumed_steps >= config.steps:
                break
    finally:
        log.info("orchestrator stopping: %s", scheduler.describe())
        producer.flush()
        consumer.close()

