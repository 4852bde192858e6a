"""The reward scorer: a stream processor from ``dora.rollout.trajectories`` to ``dora.rollout.scored``.

Exactly-once: each poll's output (scored trajectories and dead letters) and the consumed offsets
commit in one Kafka transaction (``transactional.id`` fixed per run and scorer index, so a
restarted scorer fences its zombie predecessor). Downstream consumers read ``read_committed``.

Pluggable: the reward comes from :class:`dora_rl.core.rewards.RewardRunner` running ``reward_fn``
(``DoraConfig.reward_fn``: ``task`` = the trajectory's task's own verifier, or a ``module:function``)
in a worker process, ``reward_timeout_s`` per call; each poll's trajectories go to it in one batch.
Any other service can take this role at topic level (consume trajectories, produce scored records).
A trajectory without a reward (unknown task, exception, non-finite or out-of-range value, timeout,
worker crash: a :class:`~dora_rl.core.rewards.RewardError`) is dead-lettered with error type
``reward`` and the error's message; the scorer keeps running.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

from dora_rl.core.rewards import RewardError, RewardRequest, RewardRunner
from dora_rl.infra import topics
from dora_rl.infra.kafka_io import DeadLetters, Envelope, Metrics, RecordProducer, RunConsumer, now_ms
from dora_rl.infra.keys import make_key, partition_for
from dora_rl.schemas.records import Trajectory

log = logging.getLogger(__name__)
COMPONENT = "scorer"


def score(trajectories: Sequence[Trajectory], runner: RewardRunner) -> list[Trajectory | RewardError]:
    """For each trajectory, in order: its scored copy, or the :class:`RewardError` saying why it has none."""
    outcomes = runner.score_many([RewardRequest(t.task, t.reference, t.response_text, t.trajectory_id)
                                  for t in trajectories])
    return [o if isinstance(o, RewardError) else t.replace(reward=o, scored_ms=now_ms())
            for t, o in zip(trajectories, outcomes, strict=True)]


def run_scorer(bootstrap: str, run_id: str, start_offsets: dict[tuple[str, int], int],
               num_partitions: int, index: int = 0, stop: Callable[[], bool] = lambda: False,
               reward_fn: str = "task", reward_timeout_s: float = 10.0) -> None:
    """Score until ``stop()`` is true (checked between polls)."""
    runner = RewardRunner(reward_fn, reward_timeout_s)  # an unresolvable reward_fn fails here, before Kafka
    consumer: RunConsumer | None = None
    try:
        producer = RecordProducer(bootstrap, f"{COMPONENT}-{run_id}-{index}",
                                  **{"transactional.id": f"dora.{run_id}.{COMPONENT}.{index}"})
        producer.raw.init_transactions(60)
        dlq = DeadLetters(producer, COMPONENT, run_id)
        metrics = Metrics(producer, run_id, COMPONENT)
        consumer = RunConsumer(bootstrap, run_id, COMPONENT, {topics.TRAJECTORIES: Trajectory}, dlq, start_offsets,
                               **{"group.instance.id": f"dora.{run_id}.{COMPONENT}.{index}",  # static: no
                                  "session.timeout.ms": "10000"})  # session timeout to wait out on restart
        seen: set[str] = set()
        scored = errors = 0
        while not stop():
            producer.raw.begin_transaction()
            envelopes: list[Envelope] = consumer.poll(0.5)
            if consumer.last_poll_count == 0:
                producer.raw.abort_transaction()
                continue
            t0 = time.perf_counter()
            fresh: dict[str, Envelope] = {}  # by trajectory id: one reward call per trajectory and poll
            for env in envelopes:
                if env.record.trajectory_id not in seen:  # else: redelivery, already scored and committed
                    fresh.setdefault(env.record.trajectory_id, env)
            batch = list(fresh.values())
            for env, out in zip(batch, score([env.record for env in batch], runner), strict=True):
                if isinstance(out, RewardError):
                    dlq.refuse(env, out.message, "reward", value=env.record.encode()[0])
                    errors += 1
                    continue
                seen.add(out.trajectory_id)
                producer.send(topics.SCORED, out, make_key(int(out.policy_version), out.group_id),
                              partition=partition_for(out.group_id, num_partitions))
                scored += 1
            if envelopes:
                metrics.emit("scored_total", scored)
                metrics.emit("reward_errors_total", errors)
                metrics.emit("score_s", time.perf_counter() - t0)
            consumer.commit_in_transaction(producer.raw)
            producer.raw.commit_transaction(60)
    finally:
        if consumer is not None:
            consumer.close()
        runner.close()
