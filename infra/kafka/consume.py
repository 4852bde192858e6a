"""The run-scoped consumer of the roles: decoding, dead-lettering bad records, resuming at committed offsets.

Delivery semantics (:mod:`~dora_rl.infra.kafka.io` has the producer side): consumers commit offsets only after
their output is produced and flushed (at-least-once), or add them to the producer's transaction
(:meth:`RunConsumer.commit_in_transaction`, exactly-once hand-off), and every consumer is idempotent on record
ids, so a redelivery never yields a duplicate downstream. Consumers read ``read_committed``.

Run scoping. A run's consumer group is ``dora.<run_id>.<component>``; a partition with no committed offset for
that group starts at the run's start offset (recorded in ``dora.runs``), so a run never re-reads older runs and
never misses its own records. Records of other runs are skipped; a value that cannot be decoded is
dead-lettered (:class:`~dora_rl.infra.kafka.io.DeadLetters`) and the role goes on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

from confluent_kafka import OFFSET_INVALID, Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from dora_rl.infra.kafka import events, topics
from dora_rl.infra.kafka.io import DeadLetters, Envelope, consumer_config
from dora_rl.infra.kafka.lag import LagProbe
from dora_rl.infra.kafka.security import check_kafka_error, security_errors_fatal
from dora_rl.schemas.codec import DecodeError
from dora_rl.schemas.records import Record

log = logging.getLogger(__name__)


def is_record(msg: Message) -> bool:
    """True for a record; False for a partition-EOF event or a retriable error (logged); raises
    :class:`KafkaSecurityError` on a security error, :class:`KafkaException` on another fatal or
    non-retriable one."""
    err = msg.error()
    if err is None:
        return True
    if err.code() == KafkaError._PARTITION_EOF:
        return False
    check_kafka_error(err, f"consuming {msg.topic()}")
    if err.fatal() or not err.retriable():
        raise KafkaException(err)
    log.warning("consumer error (retriable): %s", err)
    return False


#: Errors of a group coordinator that is not ready yet (a fresh broker, a coordinator moving): asked again.
COORDINATOR_NOT_READY = (KafkaError.NOT_COORDINATOR, KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
                         KafkaError.COORDINATOR_NOT_AVAILABLE)


def committed_offsets(consumer: Consumer, partitions: list[TopicPartition],
                      timeout: float = 30.0) -> list[TopicPartition]:
    """The group's committed offsets of ``partitions``, asked again while its coordinator is not ready
    (``COORDINATOR_NOT_READY``, or any retriable error) until ``timeout``; librdkafka raises those at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return list(consumer.committed(partitions, timeout=max(1.0, deadline - time.monotonic())))
        except KafkaException as exc:
            err = exc.args[0] if exc.args and isinstance(exc.args[0], KafkaError) else None
            if (err is None or not (err.retriable() or err.code() in COORDINATOR_NOT_READY)
                    or time.monotonic() > deadline):
                raise
            log.info("committed offsets not available yet (%s): asking again", err.str())
            time.sleep(0.2)


def resume_assigned(consumer: Consumer, partitions: list[TopicPartition],
                    start_offsets: Mapping[tuple[str, int], int]) -> list[tuple[str, int]]:
    """Assign ``partitions`` at the group's committed offsets; one without a committed offset starts at
    ``start_offsets`` (where the run began, or a snapshot's position; 0 when absent). Returns those without."""
    committed = committed_offsets(consumer, partitions)
    missing: list[tuple[str, int]] = []
    for tp in committed:
        if tp.offset == OFFSET_INVALID or tp.offset < 0:
            tp.offset = start_offsets.get((tp.topic, tp.partition), 0)
            missing.append((tp.topic, tp.partition))
    consumer.assign(committed)
    return missing


def resume_all_partitions(consumer: Consumer, topics_: Iterable[str],
                          start_offsets: Mapping[tuple[str, int], int], what: str) -> list[tuple[str, int]]:
    """Every partition of ``topics_`` assigned directly (no group membership) by :func:`resume_assigned` (its
    return: the partitions with no committed offset); ``what`` names the caller in a refused credential's
    error."""
    with security_errors_fatal(what):
        md = consumer.list_topics(timeout=30)
        partitions = [TopicPartition(t, p) for t in topics_ for p in sorted(md.topics[t].partitions)]
        return resume_assigned(consumer, partitions, start_offsets)


class RunConsumer:
    """A consumer group of one component of one run, decoding records and dead-lettering bad ones.

    ``record_types`` maps each subscribed catalogue topic to its record class (the consumer reads the run's own
    topics, :func:`topics.in_run`; an :class:`Envelope` names the catalogue topic). ``start_offsets`` maps
    ``(the run's topic, partition)`` to where the run begins; partitions without a committed offset start
    there (and at the beginning when absent).

    ``assign=True``: every partition of those topics is assigned directly, with no group membership (the group
    only stores offsets, as for the processors of ``streams/kafka_runtime.py``). A restarted process reads at
    once, and a paused predecessor that wakes up cannot take the partitions back: a zombie of a role that
    commits its offsets in transactions is fenced by the transactional id alone (decision 0040).
    """

    def __init__(self, bootstrap: str, run_id: str, component: str,
                 record_types: Mapping[str, type[Record]], dead_letters: DeadLetters,
                 start_offsets: Mapping[tuple[str, int], int] | None = None,
                 group_suffix: str = "", assign: bool = False, **extra: Any) -> None:
        self.run_id = run_id
        self.record_types = dict(record_types)
        self.topic_of = {topics.in_run(run_id, t): t for t in self.record_types}  # the run's topic -> catalogue
        self.dead_letters = dead_letters
        self.start_offsets = dict(start_offsets or {})
        group = self._group = f"dora.{run_id}.{component}{group_suffix}"
        self._consumer = Consumer(consumer_config(bootstrap, group, f"{component}-{run_id}", **extra))
        self.assigned: list[TopicPartition] = []  # kept here: other threads never call the consumer (LagProbe)
        self._closing = False
        if assign:
            resume_all_partitions(self._consumer, self.topic_of, self.start_offsets,
                                  f"consumer group {group}: partitions and committed offsets")
            self.assigned[:] = self._consumer.assignment()
        else:
            self._consumer.subscribe(list(self.topic_of), on_assign=self._on_assign)
        self.lag = LagProbe(group)
        events.consumer_opened(self._consumer, self.lag, bootstrap)
        self.skipped_other_runs = 0
        self.last_poll_count = 0

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        if self._closing:  # an assignment served by close() itself: nothing will be read, nothing to resume
            return
        self.assigned[:] = partitions
        resume_assigned(consumer, partitions, self.start_offsets)

    def poll(self, timeout: float = 0.5, max_records: int = 500) -> list[Envelope]:
        """Decoded records of this run; bad ones are dead-lettered, other runs' skipped."""
        out: list[Envelope] = []
        with security_errors_fatal(f"consumer group {self._group}"):
            msgs = self._consumer.consume(max_records, timeout)
        self.lag.record(self._consumer, self.assigned)
        self.last_poll_count = len(msgs)
        for msg in msgs:
            if not is_record(msg):
                continue
            topic = self.topic_of[msg.topic() or ""]
            cls = self.record_types[topic]
            try:
                record = cls.decode(msg.value(), msg.headers())
            except DecodeError as exc:
                self.dead_letters.refuse(msg, str(exc), exc.error_type)
                continue
            if getattr(record, "run_id", self.run_id) != self.run_id:
                self.skipped_other_runs += 1
                continue
            out.append(Envelope(topic, msg.partition() or 0, msg.offset() or 0, msg.key(), record))
        return out

    def commit_in_transaction(self, producer: Producer, timeout: float = 30.0) -> None:
        """Add the consumed positions to ``producer``'s open transaction (exactly-once hand-off)."""
        positions = [tp for tp in self._consumer.position(self._consumer.assignment()) if tp.offset >= 0]
        with security_errors_fatal(f"send_offsets_to_transaction, group {self._group}"):
            producer.send_offsets_to_transaction(positions, self._consumer.consumer_group_metadata(), timeout)

    def commit(self) -> None:
        """Synchronously commit what was consumed so far (call after outputs are flushed)."""
        try:
            with security_errors_fatal(f"commit, group {self._group}"):
                self._consumer.commit(asynchronous=False)
        except KafkaException as exc:
            if exc.args and exc.args[0].code() == KafkaError._NO_OFFSET:
                return
            raise

    @property
    def raw(self) -> Consumer:
        """The underlying confluent-kafka consumer."""
        return self._consumer

    def close(self) -> None:
        """Leave the group."""
        self._closing = True
        events.consumer_closing(self._consumer)
