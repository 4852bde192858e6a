"""Kafka clients for the roles: the record producer, client configs, dead-lettering, metrics.

Delivery semantics. Producers are idempotent (``enable.idempotence``, ``acks=all``), so a retry
never duplicates a record inside Kafka. The run-scoped consumer, its commits and run scoping live in
:mod:`~dora_rl.infra.kafka.consume`.

Bad input. A value that cannot be decoded (or that fails validation by the caller) is written to
``dora.dlq`` with the reason and the original bytes (:class:`DeadLetters`), its offset is committed, and the
role goes on.

The group-less readers (``read_all``, ``read_backwards``, …) live in :mod:`~dora_rl.infra.kafka.read` and are
re-exported here. Security. Every client gets the process's :mod:`~dora_rl.infra.kafka.security` settings. Wrong
credentials or a missing ACL (:data:`~dora_rl.infra.kafka.security.SECURITY_ERROR_NAMES`) are fatal:
whether reported to the client's error callback, in a delivery report, a consumer error or a failed call,
they raise :class:`~dora_rl.infra.kafka.security.KafkaSecurityError` naming the code from the next
poll/consume/flush, instead of being retried; other client errors keep their behaviour (logged, retried).
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from dora_rl.infra.kafka import events, topics
from dora_rl.infra.kafka.read import (
    metadata,
    now_ms,
    read_all,
    read_backwards,
    read_range,
    reader_config,
    surface_security_error,
    watermarks,
)
from dora_rl.infra.kafka.security import (
    ClientSecurity,
    KafkaSecurityError,
    client_config,
    is_security_error,
    on_client_error,
    security_errors_fatal,
)
from dora_rl.schemas.records import DeadLetter, Metric, Record

__all__ = [  # the readers live in kafka_read and are re-exported here, their long-standing home
    "DeadLetters",
    "Envelope",
    "Metrics",
    "RecordProducer",
    "RecordTooLarge",
    "consumer_config",
    "dead_letter",
    "letter_key",
    "metadata",
    "now_ms",
    "producer_config",
    "read_all",
    "read_backwards",
    "read_range",
    "reader_config",
    "surface_security_error",
    "watermarks",
]

log = logging.getLogger(__name__)


def producer_config(bootstrap: str, client_id: str, *, security: ClientSecurity | None = None,
                    **extra: Any) -> dict[str, Any]:
    """Idempotent producer settings sized for inline training batches (*security*: default the process's)."""
    cfg: dict[str, Any] = client_config(bootstrap, security=security)
    cfg.update({
        "client.id": client_id,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
        "compression.type": "lz4",
        "message.max.bytes": topics.BATCH_MAX_BYTES,
        "queue.buffering.max.kbytes": 512 * 1024,
        "error_cb": on_client_error,
    })
    cfg.update(extra)
    return cfg


def consumer_config(bootstrap: str, group_id: str, client_id: str, *, security: ClientSecurity | None = None,
                    **extra: Any) -> dict[str, Any]:
    """Manual-commit, read-committed consumer settings (*security*: default the process's)."""
    cfg: dict[str, Any] = client_config(bootstrap, security=security)
    cfg.update({
        "group.id": group_id,
        "client.id": client_id,
        "enable.auto.commit": False,
        "auto.offset.reset": "earliest",
        "isolation.level": "read_committed",
        "fetch.max.bytes": topics.BATCH_MAX_BYTES,
        "max.partition.fetch.bytes": topics.BATCH_MAX_BYTES,
        "fetch.wait.max.ms": 50,
        "session.timeout.ms": 30000,
        "max.poll.interval.ms": 600000,
        "error_cb": on_client_error,
    })
    cfg.update(extra)
    return cfg


class RecordTooLarge(ValueError):
    """A record bigger than its topic accepts (``topics.max_record_bytes``): refused before sending."""

    def __init__(self, topic: str, size: int, limit: int) -> None:
        super().__init__(f"record of {size} bytes is over the {limit}-byte limit of {topic}")
        self.topic, self.size, self.limit = topic, size, limit


class RecordProducer:
    """Produces typed records with version-carrying keys; raises on delivery failure at flush,
    :class:`RecordTooLarge` at once for a record its topic would refuse, and :class:`KafkaSecurityError`
    from the next send/flush once Kafka refused its credentials or an ACL."""

    def __init__(self, bootstrap: str, client_id: str, **extra: Any) -> None:
        self._producer = Producer(producer_config(bootstrap, client_id, **extra))
        self._errors: list[str] = []
        self._fatal: KafkaSecurityError | None = None

    @property
    def raw(self) -> Producer:
        """The underlying confluent-kafka producer."""
        return self._producer

    def _on_delivery(self, err: KafkaError | None, msg: Message) -> None:
        if err is not None and is_security_error(err):
            self._fatal = self._fatal or KafkaSecurityError(err.name(), err.str(), f"producing to {msg.topic()}")
            raise self._fatal
        if err is not None:
            self._errors.append(f"{msg.topic()}: {err}")

    def _check_fatal(self) -> None:
        if self._fatal is not None:
            raise self._fatal

    def _poll(self, timeout: float) -> None:
        with security_errors_fatal("producer poll"):
            self._producer.poll(timeout)
        self._check_fatal()

    def init_transactions(self, timeout: float = 60.0) -> None:
        """``init_transactions`` (fences and aborts a predecessor); a refused transactional id is fatal."""
        with security_errors_fatal("init_transactions"):
            self._producer.init_transactions(timeout)

    def send(self, topic: str, record: Record, key: str, partition: int | None = None) -> None:
        """Queue one record (schemaless Avro + schema headers). Non-blocking; see :meth:`flush`."""
        value, headers = record.encode()
        self.send_raw(topic, value, key.encode(), headers, partition)
        events.sent(topic, record)

    def send_raw(self, topic: str, value: bytes | None, key: bytes | None,
                 headers: list[tuple[str, bytes]] | None = None, partition: int | None = None) -> None:
        """Queue raw bytes (used for dead letters and tests of malformed input)."""
        size = len(value or b"") + len(key or b"")
        if size > (limit := topics.max_record_bytes(topic)):
            raise RecordTooLarge(topic, size, limit)
        kwargs: dict[str, Any] = {"value": value, "key": key, "headers": headers or [],
                                  "on_delivery": self._on_delivery}
        if partition is not None:
            kwargs["partition"] = partition
        self._check_fatal()
        while True:
            try:
                self._producer.produce(topic, **kwargs)
                break
            except BufferError:
                self._poll(0.05)
        self._poll(0)

    def flush(self, timeout: float = 60.0) -> None:
        """Wait for every queued record; raise RuntimeError naming the failures (KafkaSecurityError for a
        refused credential or ACL)."""
        deadline = time.monotonic() + timeout
        while True:  # in short slices: a callback's exception surfaces only when librdkafka's flush returns
            with security_errors_fatal("producer flush"):
                remaining = self._producer.flush(min(0.5, max(0.0, deadline - time.monotonic())))
            self._check_fatal()
            if not remaining or time.monotonic() >= deadline:
                break
        if remaining:
            raise RuntimeError(f"{remaining} records not delivered within {timeout}s")
        if self._errors:
            errors, self._errors = self._errors, []
            raise RuntimeError(f"delivery failed: {errors[:5]}")


@dataclass(frozen=True)
class Envelope:
    """One decoded record and where it came from."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    record: Any


def dead_letter(msg: Message, component: str, run_id: str | None, reason: str, error_type: str,
                value: bytes | None = None) -> DeadLetter:
    """The dead letter of a refused message: the reason and the original bytes and position (the source topic by
    its catalogue name: the letter is on the run's own ``dora.dlq``)."""
    try:
        source = topics.catalogue_name_of(msg.topic() or "")
    except ValueError:
        source = msg.topic() or ""
    return DeadLetter(component=component, reason=reason[:2000], error_type=error_type,
                      source_topic=source, source_partition=msg.partition() or 0,
                      source_offset=msg.offset() or 0, ts_ms=now_ms(), run_id=run_id, key=msg.key(),
                      value=msg.value() if value is None else value)


def letter_key(msg: Message) -> str:
    """Key of a dead letter: the refused record's key, else its position."""
    key = msg.key()
    return key.decode(errors="replace") if key else f"{msg.topic()}/{msg.partition()}/{msg.offset()}"


class DeadLetters:
    """Writes refused records to the run's ``dora.dlq`` and counts them."""

    def __init__(self, producer: RecordProducer, component: str, run_id: str) -> None:
        self.producer = producer
        self.component = component
        self.run_id = run_id
        self.count = 0

    def refuse(self, msg: Message | Envelope, reason: str, error_type: str,
               value: bytes | None = None) -> None:
        """Dead-letter ``msg`` with ``reason``; never raises for an oversized original value."""
        if isinstance(msg, Envelope):
            letter = DeadLetter(component=self.component, reason=reason[:2000], error_type=error_type,
                                source_topic=msg.topic, source_partition=msg.partition, source_offset=msg.offset,
                                ts_ms=now_ms(), run_id=self.run_id, key=msg.key, value=value)
            dlq_key = msg.key.decode(errors="replace") if msg.key else f"{msg.topic}/{msg.partition}/{msg.offset}"
        else:
            letter = dead_letter(msg, self.component, self.run_id, reason, error_type, value)
            dlq_key = letter_key(msg)
        value, headers = letter.encode()
        self.producer.send_raw(topics.in_run(self.run_id, topics.DLQ), value, dlq_key.encode(), headers)
        self.count += 1
        events.dead_lettered(self.component, error_type)
        log.warning("dead-lettered %s[%s]@%s from %s: %s", letter.source_topic, letter.source_partition,
                    letter.source_offset, self.component, reason)


class Metrics:
    """Emits :class:`Metric` records for one component of one run."""

    def __init__(self, producer: RecordProducer, run_id: str, component: str) -> None:
        self.producer = producer
        self.run_id = run_id
        self.component = component

    def emit(self, name: str, value: float, step: int | None = None, version: int | None = None,
             **labels: str) -> None:
        """Queue one observation."""
        self._send(Metric(run_id=self.run_id, component=self.component, name=name, value=float(value),
                          ts_ms=now_ms(), step=step, version=version, labels=dict(labels)))

    def emit_signed(self, name: str, value: float, token: str, step: int | None = None) -> None:
        """Queue one observation a reader acts on, signed with the run's ``token`` (``infra/kafka/signing.py``)."""
        from dora_rl.infra.kafka.signing import signed

        self._send(signed(Metric(run_id=self.run_id, component=self.component, name=name, value=float(value),
                                 ts_ms=now_ms(), step=step), token))

    def _send(self, m: Metric) -> None:
        self.producer.send(topics.in_run(self.run_id, topics.METRICS), m, f"{self.component}/{m.name}")
