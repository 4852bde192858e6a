"""Where replay reads a run's records: the live topics, or an archive of the run (``--from-archive DIR``).

A :class:`RawRecord` is one record as the log holds it (topic, partition, offset, key, value bytes,
headers, timestamp). :class:`KafkaSource` and :class:`~.archive.ArchiveSource` yield the same raw
records for the same run, so every verb decodes exactly the bytes the roles wrote, whichever it reads.

Invariants of a source (both kinds):

- it yields only records at or after the run's start offsets (``RunInfo.start_offsets``), in offset
  order within a partition; records of other runs sharing the topics are dropped by :func:`decoded`
  (by the decoded ``run_id``);
- the version filter uses the key only (``v<version:010d>/...``, :mod:`dora_rl.infra.kafka.keys`): a value of
  another version is never decoded;
- nothing is silently missing: before reading a topic, :class:`KafkaSource` compares each partition's
  start offset with the partition's first retained offset (its low watermark) and raises
  :class:`RetentionDeleted` naming what retention deleted (:func:`retention_losses`, pure), instead of
  replaying a run with holes. An archive holds what was there when it was made, and says so.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from confluent_kafka import Consumer, TopicPartition

from dora_rl.infra.broker.dist import dora_home
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.io import read_all
from dora_rl.infra.kafka.keys import parse_key
from dora_rl.infra.kafka.read import metadata, now_ms, reader_config, watermarks
from dora_rl.infra.kafka.runs import get_run, offsets_map, topic_start
from dora_rl.schemas.codec import DecodeError
from dora_rl.schemas.records import Record, RunInfo

R = TypeVar("R", bound=Record)


@dataclass(frozen=True)
class RawRecord:
    """One record of a topic as stored: key and value bytes undecoded."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: tuple[tuple[str, bytes], ...]
    timestamp_ms: int

    @property
    def version(self) -> int | None:
        """The key's version (None: no version, or a key that is not ``v<version>/...``)."""
        if not self.key:
            return None
        try:
            return parse_key(self.key)[0]
        except (ValueError, UnicodeDecodeError):
            return None


class RetentionDeleted(RuntimeError):
    """Records a replay needs were deleted by retention (the message names topic, partition, offsets)."""


class RecordSource(Protocol):
    """A run's records, from the topics or from an archive."""

    @property
    def where(self) -> str:
        """Human description (``kafka <bootstrap>`` or ``archive <dir>``)."""
        ...

    def run_info(self) -> RunInfo:
        """The run's record (config, start offsets, state)."""
        ...

    def raw(self, topic: str, version: int | None = None) -> Iterator[RawRecord]:
        """The run's records of ``topic`` (only key version ``version`` when given)."""
        ...

    def checkpoints_dir(self) -> Path:
        """Where the trainer's replay checkpoints of the run are (may not exist)."""
        ...


def retention_losses(topic: str, start: Mapping[int, int], low: Mapping[int, int]) -> list[str]:
    """Why ``topic`` cannot be replayed from ``start`` (partition -> run's start offset) given each
    partition's first retained offset ``low``: one line per partition whose start lies below it."""
    out = []
    for p in sorted(start):
        first = low.get(p, 0)
        if start[p] < first:
            out.append(f"{topic}[{p}]: the run's records start at offset {start[p]}, but retention deleted "
                       f"everything below {first}")
    return out


def by_version(records: Iterator[RawRecord], version: int | None) -> Iterator[RawRecord]:
    """``records`` whose key carries ``version`` (all of them when None); values stay undecoded."""
    for r in records:
        if version is None or r.version == version:
            yield r


class KafkaSource:
    """A run on the cluster at ``bootstrap`` (the latest run when ``run_id`` is None)."""

    def __init__(self, bootstrap: str, run_id: str | None) -> None:
        self.bootstrap = bootstrap
        self._info = get_run(bootstrap, run_id)

    @property
    def where(self) -> str:
        return f"kafka {self.bootstrap}"

    def run_info(self) -> RunInfo:
        return self._info

    def _topic(self, topic: str) -> str:
        """The run's own topic of catalogue topic ``topic`` (decision 0063)."""
        return topics.in_run(self._info.run_id, topic)

    def start(self, topic: str) -> dict[int, int]:
        """The run's start offset of every partition of (catalogue) ``topic``."""
        return topic_start(offsets_map(self._info), self._topic(topic))

    def check_retention(self, topic: str) -> None:
        """Raise :class:`RetentionDeleted` when retention deleted records of this run in ``topic``."""
        start = self.start(topic)
        if not start:
            return
        consumer = Consumer(reader_config(self.bootstrap, f"dora-replay-{now_ms()}"))
        try:
            metadata(consumer, self._topic(topic))
            low = {p: watermarks(consumer, TopicPartition(self._topic(topic), p))[0] for p in start}
        finally:
            consumer.close()
        losses = retention_losses(topic, start, low)
        if losses:
            retention = topics.spec(topic).retention_ms
            kept = f"{retention / 86_400_000:g} d" if retention else "the broker default"
            raise RetentionDeleted(f"run {self._info.run_id}: cannot replay {topic}, retention ({kept}) deleted "
                                   f"records of the run: {'; '.join(losses)}. Replay an archive of the run "
                                   "instead (`dora-rl replay archive`, then `--from-archive DIR`)")

    def raw(self, topic: str, version: int | None = None) -> Iterator[RawRecord]:
        self.check_retention(topic)
        msgs = (RawRecord(topic, int(m.partition() or 0), int(m.offset() or 0), m.key(), m.value(),
                          _headers(m.headers()), int(m.timestamp()[1]))
                for m in read_all(self.bootstrap, self._topic(topic), self.start(topic)))
        return by_version(msgs, version)

    def checkpoints_dir(self) -> Path:
        return dora_home() / "runs" / self._info.run_id / "checkpoints"


def _headers(headers: Any) -> tuple[tuple[str, bytes], ...]:
    """Kafka headers as ``(key, bytes)`` pairs (a null header value as empty bytes)."""
    return tuple((str(k), bytes(v or b"")) for k, v in (headers or []))


def decoded(source: RecordSource, topic: str, cls: type[R], version: int | None = None,
            errors: list[str] | None = None) -> Iterator[tuple[RawRecord, R]]:
    """The run's records of ``topic`` decoded as ``cls``, each with its raw record; records of other runs
    are skipped, and undecodable ones (dead-lettered by the roles) too, each noted in ``errors``."""
    run_id = source.run_info().run_id
    for raw in source.raw(topic, version):
        try:
            record = cls.decode(raw.value, list(raw.headers))
        except DecodeError as exc:
            if errors is not None:
                errors.append(f"{topic}[{raw.partition}]@{raw.offset}: {exc}")
            continue
        if getattr(record, "run_id", run_id) == run_id:
            yield raw, record
