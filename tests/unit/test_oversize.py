"""An oversize record is refused before it is sent, naming its size and its topic's limit."""

from __future__ import annotations

import pytest

from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.io import RecordProducer, RecordTooLarge


def test_every_topic_has_a_record_limit_and_the_producer_checks_it() -> None:
    assert topics.max_record_bytes(topics.BATCHES) == topics.BATCH_MAX_BYTES
    assert topics.max_record_bytes(topics.PROMPTS) == topics.BROKER_DEFAULT_MAX_BYTES
    producer = RecordProducer("127.0.0.1:1", "oversize-test", **{"log_level": 0})  # refused before sending
    limit = topics.max_record_bytes(topics.TRAJECTORIES)
    with pytest.raises(RecordTooLarge, match=f"over the {limit}-byte limit of {topics.TRAJECTORIES}") as err:
        producer.send_raw(topics.TRAJECTORIES, b"x" * limit, b"k")
    assert (err.value.size, err.value.limit) == (limit + 1, limit)
    producer.send_raw(topics.TRAJECTORIES, b"x" * (limit - 1), b"k")  # at the limit: queued
    assert len(producer.raw) == 1
    producer.raw.purge()  # nothing is ever delivered: drop it, and the client with it
    del producer, err
