"""Group-less readers of the run topics: a topic to its end, a partition backwards, offsets and metadata.

These readers assign partitions explicitly and never commit (their ``dora-reader-*``-style group ids
only satisfy librdkafka). They read ``read_committed``: transaction markers occupy offsets but are never
delivered, so progress is measured by positions, not by counting records. Security: every reader gets
the process's :mod:`~dora_rl.infra.kafka.security` settings; a refused credential or ACL raises
:class:`~dora_rl.infra.kafka.security.KafkaSecurityError` naming the code (metadata is asked in 1 s
slices with the error callback served in between, so that happens within about a second).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.security import ClientSecurity, check_kafka_error, client_config, on_client_error

__all__ = ["consume_ready", "metadata", "now_ms", "read_all", "read_backwards", "read_range", "reader_config",
           "surface_security_error", "watermarks"]


def now_ms() -> int:
    """Wall clock in Unix epoch milliseconds."""
    return int(time.time() * 1000)


def consume_ready(consumer: Consumer, max_records: int, timeout: float, linger_s: float = 0.0) -> list[Message]:
    """Up to ``max_records`` messages: waits at most ``timeout`` for the first, then takes what is already fetched
    or arrives within ``linger_s``. ``consumer.consume(n, timeout)`` alone waits the whole ``timeout`` unless ``n``
    arrive (librdkafka's batch consume), which would hold every message that arrives meanwhile for up to ``timeout``."""
    first = consumer.consume(1, timeout)
    return first + consumer.consume(max_records - 1, linger_s) if first and max_records > 1 else first


def reader_config(bootstrap: str, group_id: str, security: ClientSecurity | None = None) -> dict[str, Any]:
    """A group-less reader's settings (assign only, never commits): read-committed, batch-sized fetches."""
    return client_config(bootstrap, security=security, **{
        "group.id": group_id, "enable.auto.commit": False, "isolation.level": "read_committed",
        "fetch.max.bytes": topics.BATCH_MAX_BYTES, "max.partition.fetch.bytes": topics.BATCH_MAX_BYTES,
        "error_cb": on_client_error})


def watermarks(consumer: Consumer, tp: TopicPartition, timeout: float = 15.0) -> tuple[int, int]:
    """(low, high) watermarks, retrying while a new partition's leader is still being elected."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            low, high = consumer.get_watermark_offsets(tp, timeout=timeout)
            return int(low), int(high)
        except KafkaException as exc:
            err = exc.args[0] if exc.args else None
            retriable = isinstance(err, KafkaError) and (err.retriable() or err.code() in (
                KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                KafkaError.UNKNOWN_TOPIC_OR_PART))
            if not retriable or time.monotonic() > deadline:
                surface_security_error(consumer)
                check_kafka_error(err if isinstance(err, KafkaError) else None, f"offsets of {tp.topic}")
                raise
            time.sleep(0.2)


def surface_security_error(consumer: Consumer) -> None:
    """After a blocking call failed (e.g. metadata timed out), serve the consumer's callbacks once, so a
    security error waiting for the error callback is raised instead of the vaguer failure."""
    with contextlib.suppress(KafkaException):
        consumer.poll(0)


def metadata(consumer: Consumer, topic: str | None = None, timeout: float = 10.0) -> Any:
    """``list_topics`` asked in 1 s slices, serving the error callback in between: a refused credential
    raises :class:`KafkaSecurityError` within about a second instead of after *timeout*."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return consumer.list_topics(topic, timeout=max(0.1, min(1.0, deadline - time.monotonic())))
        except KafkaException:
            surface_security_error(consumer)
            if time.monotonic() >= deadline:
                raise


def read_all(bootstrap: str, topic: str, start: Mapping[int, int] | None = None,
             timeout: float = 10.0, idle_s: float = 1.0) -> Iterable[Message]:
    """Read a topic from ``start`` offsets (default: beginning) to its current end, no group.

    Yields raw messages; stops when every partition reached the high watermark seen at start.
    """
    consumer = Consumer(reader_config(bootstrap, f"dora-reader-{now_ms()}"))
    try:
        md = metadata(consumer, topic, timeout)
        if topic in md.topics:
            check_kafka_error(md.topics[topic].error, f"metadata of {topic}")
        if topic not in md.topics or md.topics[topic].error is not None:
            raise RuntimeError(f"topic {topic} does not exist")
        assignment: list[TopicPartition] = []
        ends: dict[int, int] = {}
        for p in md.topics[topic].partitions:
            low, high = watermarks(consumer, TopicPartition(topic, p), timeout)
            first = max(low, (start or {}).get(p, low))
            if first < high:
                assignment.append(TopicPartition(topic, p, first))
                ends[p] = high
        if not assignment:
            return
        consumer.assign(assignment)
        last = time.monotonic()
        while True:
            msgs = consumer.consume(500, 0.3)
            for msg in msgs:
                check_kafka_error(msg.error(), f"reading {topic}")
            if not msgs:
                # Transaction markers occupy offsets but are never delivered: compare positions.
                positions = consumer.position([TopicPartition(topic, p) for p in ends])
                if all(tp.offset >= ends[tp.partition] for tp in positions if tp.offset >= 0):
                    if all(tp.offset >= 0 for tp in positions):
                        return
                if time.monotonic() - last > max(idle_s, timeout):
                    raise TimeoutError(f"reading {topic}: stalled before the end offsets {ends}")
                continue
            last = time.monotonic()
            for msg in msgs:
                if msg.error() is None and (msg.offset() or 0) < ends[msg.partition() or 0]:
                    yield msg
    finally:
        consumer.close()


def read_range(consumer: Consumer, tp: TopicPartition, start: int, end: int, timeout: float = 15.0) -> list[Message]:
    """Committed records of ``tp`` in ``[start, end)`` (transaction markers occupy offsets but are skipped).

    ``consumer`` must not have read ``tp`` before: librdkafka keeps a partition's application position
    across a re-assignment until the first record of the new one is delivered, so a second range of the
    same partition on the same consumer may see the first range's position, already past ``end``, and
    return nothing (measured: ``read_backwards`` on one consumer lost 632 of 3,000 records)."""
    consumer.assign([TopicPartition(tp.topic, tp.partition, start)])
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    while True:
        pos = consumer.position([TopicPartition(tp.topic, tp.partition)])[0].offset
        if pos >= end:
            return out
        if time.monotonic() > deadline:
            raise TimeoutError(f"reading {tp.topic}[{tp.partition}] {start}..{end}: stalled at {pos}")
        for msg in consumer.consume(500, 0.2):
            check_kafka_error(msg.error(), f"reading {tp.topic}[{tp.partition}]")
            if msg.error() is None and (msg.offset() or 0) < end:
                out.append(msg)


def read_backwards(bootstrap: str, topic: str, partition: int = 0, stop_at: int = 0, window: int = 256,
                   timeout: float = 15.0) -> Iterable[list[Message]]:
    """Windows of a partition's committed records from its end towards ``stop_at`` (newest window
    first, records in log order inside a window): finds the latest records without reading the log.
    Each window is read by a consumer of its own (see :func:`read_range`: a consumer re-assigned to an
    older range of the same partition can skip it)."""
    tp = TopicPartition(topic, partition)
    first = Consumer(reader_config(bootstrap, f"dora-backwards-{now_ms()}"))
    consumer: Consumer | None = first
    try:
        low, end = watermarks(first, tp, timeout)
        low = max(low, stop_at)
        while end > low:
            start = max(low, end - window)
            consumer = consumer or Consumer(reader_config(bootstrap, f"dora-backwards-{now_ms()}"))
            msgs = read_range(consumer, tp, start, end, timeout)
            consumer.close()
            consumer = None  # the next, older window needs a consumer that has not read tp
            yield msgs
            end = start
    finally:
        if consumer is not None:
            consumer.close()
