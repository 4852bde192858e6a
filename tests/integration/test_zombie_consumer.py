"""A trainer's input without group membership: a woken zombie is fenced by its transactional id alone.

The trainer reads ``dora.train.batches`` with partitions assigned directly (``RunConsumer(assign=True)``,
decision 0040). With static membership, a paused trainer that woke up rejoined the group under the same
``group.instance.id`` and fenced its live replacement's consumer, so both died (``bench/chaos.py``,
``chaos-20261125-075910.json``). This checks, on a real broker, what the change must keep: the zombie
still cannot commit, and the replacement reads and commits as if the zombie were not there.
"""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.consume import RunConsumer
from dora_rl.infra.kafka.io import DeadLetters, RecordProducer
from dora_rl.schemas.records import Metric


def records(consumer: RunConsumer, n: int, tries: int = 60) -> list[int]:
    """Offsets of the next ``n`` records ``consumer`` reads (one poll of up to 0.5 s per try)."""
    got: list[int] = []
    for _ in range(tries):
        got += [e.offset for e in consumer.poll(0.5, max_records=n - len(got))]
        if len(got) >= n:
            return got
    raise AssertionError(f"read {got}, wanted {n} records")


def test_a_woken_zombie_is_fenced_and_leaves_its_replacement_alone(bootstrap: str) -> None:
    run = f"zombie-{uuid.uuid4().hex[:8]}"
    topic = topics.in_run(run, topics.METRICS)  # a run's own topic, one partition (decision 0063)
    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept referenced until the topic exists
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(timeout=30)
    feeder = RecordProducer(bootstrap, "feeder")
    for i in range(4):
        feeder.send(topic, Metric(run_id=run, component="test", name="batch", value=float(i), ts_ms=i), f"k{i}")
    feeder.flush(30)
    dlq = DeadLetters(RecordProducer(bootstrap, "dlq"), "trainer", run)
    tid = {"transactional.id": f"dora.{run}.trainer"}

    zombie_p = RecordProducer(bootstrap, "trainer-a", **tid)
    zombie_p.init_transactions(30)
    zombie_c = RunConsumer(bootstrap, run, "trainer", {topics.METRICS: Metric}, dlq, assign=True)
    assert records(zombie_c, 1) == [0]  # ... then it pauses before committing

    live_p = RecordProducer(bootstrap, "trainer-b", **tid)
    live_p.init_transactions(30)  # fences the paused one
    live_c = RunConsumer(bootstrap, run, "trainer", {topics.METRICS: Metric}, dlq, assign=True)
    assert records(live_c, 1) == [0]  # nothing was committed: the replacement starts where the run did

    assert records(zombie_c, 1) == [1]  # the zombie wakes up, reads on, and tries to commit
    with pytest.raises(KafkaException) as refused:
        zombie_p.raw.begin_transaction()
        zombie_c.commit_in_transaction(zombie_p.raw)
        zombie_p.raw.commit_transaction(30)
    err = refused.value.args[0]  # fenced by its replacement's init_transactions: nothing else refuses it here
    assert err.fatal() and err.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED), err

    assert records(live_c, 2) == [1, 2]  # the replacement is untouched: it reads and commits on
    live_p.raw.begin_transaction()
    live_c.commit_in_transaction(live_p.raw)
    live_p.raw.commit_transaction(30)

    check = Consumer({"bootstrap.servers": bootstrap, "group.id": f"dora.{run}.trainer"})
    try:
        [tp] = check.committed([TopicPartition(topic, 0)], timeout=30)
    finally:
        check.close()
    assert tp.offset == 3  # the replacement's position, never the zombie's
    for c in (zombie_c, live_c):
        c.close()
