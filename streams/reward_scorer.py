"""The reward scorer: a stream processor from ``dora.rollout.trajectories`` to ``dora.rollout.scored``.

Exactly-once: each poll's output (scored trajectories and dead letters) and the consumed offsets
commit in one Kafka transaction (``transactional.id`` fixed per run and scorer index, so a
restarted scorer fences its zombie predecessor). Downstream consumers read ``read_committed``.

Pluggable: the reward is ``Task.reward(reference, completion)`` of the trajectory's task; any
other service can take this role at topic level (consume trajectories, produce scored records).
A trajectory whose task is unknown, or whose reward is not a finite number in [0, 1], is
dead-lettered with the reason; the scorer keeps running.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable

from dora_rl.infra import topics
from dora_rl.infra.kafka_io import DeadLetters, Envelope, Metrics, RecordProducer, RunConsumer, now_ms
from dora_rl.infra.keys import make_key, partition_for
from dora_rl.schemas.records import Trajectory

log = logging.getLogger(__name__)
COMPONENT = "scorer"

RewardFn = Callable[[str, str, str], float]


def task_reward(task: str, reference: str, completion: str) -> float:
    """Reward of ``completion`` for ``task`` (KeyError for an unknown task)."""
    from dora_rl.producers.tasks import get_task

    return float(get_task(task).reward(reference, completion))


def score(trajectory: Trajectory, reward_fn: RewardFn = task_reward) -> Trajectory:
    """The scored copy of ``trajectory``; ValueError/KeyError when it cannot be scored."""
    reward = reward_fn(trajectory.task, trajectory.reference, trajectory.response_text)
    if not math.isfinite(reward) or not 0.0 <= reward <= 1.0:
        raise ValueError(f"reward {reward!r} is not a finite number in [0, 1]")
    return trajectory.replace(reward=reward, scored_ms=now_ms())


def run_scorer(bootstrap: str, run_id: str, start_offsets: dict[tuple[str, int], int],
               num_partitions: int, index: int = 0, stop: Callable[[], bool] = lambda: False,
               reward_fn: RewardFn = task_reward) -> None:
    """Score until ``stop()`` is true (checked between polls)."""
    producer = RecordProducer(bootstrap, f"{COMPONENT}-{run_id}-{index}",
                              **{"transactional.id": f"dora.{run_id}.{COMPONENT}.{index}"})
    producer.raw.init_transactions(60)
    dlq = DeadLetters(producer, COMPONENT, run_id)
    metrics = Metrics(producer, run_id, COMPONENT)
    consumer = RunConsumer(bootstrap, run_id, COMPONENT, {topics.TRAJECTORIES: Trajectory}, dlq, start_offsets)
    seen: set[str] = set()
    scored = 0
    try:
        while not stop():
            producer.raw.begin_transaction()
            envelopes: list[Envelope] = consumer.poll(0.5)
            if consumer.last_poll_count == 0:
                producer.raw.abort_transaction()
                continue
            t0 = time.perf_counter()
            for env in envelopes:
                traj: Trajectory = env.record
                if traj.trajectory_id in seen:
                    continue  # redelivery after a restart: already scored in a committed transaction
                try:
                    out = score(traj, reward_fn)
                except (ValueError, KeyError) as exc:
                    dlq.refuse(env, f"cannot score: {exc}", "reward", value=traj.encode()[0])
                    continue
                seen.add(traj.trajectory_id)
                producer.send(topics.SCORED, out, make_key(int(out.policy_version), out.group_id),
                              partition=partition_for(out.group_id, num_partitions))
                scored += 1
            if envelopes:
                metrics.emit("scored_total", scored)
                metrics.emit("score_s", time.perf_counter() - t0)
            consumer.commit_in_transaction(producer.raw)
            producer.raw.commit_transaction(60)
    finally:
        consumer.close()
