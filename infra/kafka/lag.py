"""Consumer lag: how many records of each topic-partition a consumer still has to read.

Formula, per assigned partition ``(topic, p)`` of a consumer group ``g``::

    lag(g, topic, p) = max(0, high(topic, p) - position(g, topic, p))

``high`` is the partition's high watermark (for a ``read_committed`` reader the broker reports its last
stable offset, so records of an open transaction are not counted as lag); ``position`` is the offset of
the next record the consumer will read. A partition whose position or high watermark is not known yet
(a consumer that has not fetched since its assignment) has no lag sample rather than a guessed one.

Two sources of positions, both reduced by :func:`lag_rows`:

- a live consumer's in-memory positions, recorded by its owner after each poll (:class:`LagProbe`; what
  the role's Prometheus endpoint reports; a scrape never calls the role's consumer);
- the committed offsets of a run's consumer groups ``dora.<run>.<component>`` (:func:`committed_lag`,
  through the AdminClient; what ``dora-rl monitor`` shows for roles on any host). A group commits after
  its outputs are flushed, so committed lag is an upper bound of the live one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from confluent_kafka import Consumer, TopicPartition

from dora_rl.infra.kafka.read import now_ms, reader_config, watermarks
from dora_rl.infra.kafka.security import client_config

TP = tuple[str, int]


@dataclass(frozen=True)
class PartitionLag:
    """The lag of one consumer group on one topic-partition (see the module docstring)."""

    group: str
    topic: str
    partition: int
    position: int
    """Next offset the group reads (live position, or its committed offset)."""
    high: int
    """High watermark (last stable offset for ``read_committed``)."""

    @property
    def lag(self) -> int:
        """``max(0, high - position)``: records still to read."""
        return max(0, self.high - self.position)


def lag_rows(group: str, positions: Mapping[TP, int], highs: Mapping[TP, int]) -> list[PartitionLag]:
    """The lag of ``group`` on every partition with a known (non-negative) position and high watermark,
    sorted by topic and partition."""
    return [PartitionLag(group, t, p, pos, highs[(t, p)]) for (t, p), pos in sorted(positions.items())
            if pos >= 0 and highs.get((t, p), -1) >= 0]


class LagProbe:
    """A consumer's positions and cached high watermarks as its owner last read them, after each poll and in
    its own thread. confluent-kafka serialises the calls on one consumer, so a call from another thread waits
    for the owner's ``consume`` and can wait as long as the owner keeps polling an idle topic (measured: every
    scrape of a trainer waiting for batches hung). Scrapes read the probe, never the consumer.

    Invariant: :meth:`rows` is the lag of one :meth:`record` (its two maps are replaced together).
    """

    def __init__(self, group: str) -> None:
        self.group = group
        self._read: tuple[dict[TP, int], dict[TP, int]] = ({}, {})

    def record(self, consumer: Consumer, assigned: Sequence[TopicPartition]) -> None:
        """Read ``consumer``'s positions and cached watermarks on ``assigned`` (the owner's thread only)."""
        parts = [TopicPartition(tp.topic, tp.partition) for tp in assigned]
        positions = {(tp.topic, tp.partition): int(tp.offset) for tp in consumer.position(parts)} if parts else {}
        highs = {(tp.topic, tp.partition): int(consumer.get_watermark_offsets(tp, cached=True)[1]) for tp in parts}
        self._read = (positions, highs)

    def rows(self, high_of: Callable[[TopicPartition], int] | None = None) -> list[PartitionLag]:
        """The lag of the last record; ``high_of`` (a side reader's query) fills watermarks not cached yet."""
        positions, cached = self._read
        highs = {tp: h if h >= 0 or high_of is None else int(high_of(TopicPartition(*tp))) for tp, h in cached.items()}
        return lag_rows(self.group, positions, highs)


class HighWatermarks:
    """A side reader that asks the broker for high watermarks (never joins a group, never commits)."""

    def __init__(self, bootstrap: str) -> None:
        self._consumer = Consumer(reader_config(bootstrap, f"dora-lag-{now_ms()}"))

    def __call__(self, tp: TopicPartition, timeout: float = 2.0) -> int:
        try:
            return watermarks(self._consumer, tp, timeout)[1]
        except Exception:  # an unreachable broker: no sample, never a failed scrape
            return -1

    def close(self) -> None:
        self._consumer.close()


ENDED_STATES = ("FINISHED", "FAILED")


def for_run_state(rows: Iterable[PartitionLag], state: str) -> list[PartitionLag]:
    """``rows`` as a run in ``state`` owes them: a run that ended (:data:`ENDED_STATES`) has no lag. Its
    roles stopped reading; what came after their last commit (the instances' last heartbeats, the final
    announcements, a transaction's commit marker) was never theirs to read, so no row counts it."""
    if state not in ENDED_STATES:
        return list(rows)
    return [dataclasses.replace(r, position=max(r.position, r.high)) for r in rows]


def run_groups(group_ids: Iterable[str], run_id: str) -> list[str]:
    """The consumer groups of run ``run_id`` (``dora.<run>.<component>``), sorted."""
    prefix = f"dora.{run_id}."
    return sorted(g for g in group_ids if g.startswith(prefix))


def committed_lag(bootstrap: str, run_id: str, timeout: float = 10.0) -> list[PartitionLag]:
    """Lag of every consumer group of run ``run_id`` from its committed offsets (groups that never
    committed, such as the tools' own readers, have no rows)."""
    from confluent_kafka import ConsumerGroupTopicPartitions
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(client_config(bootstrap))
    listed = admin.list_consumer_groups(request_timeout=timeout).result(timeout)
    groups = run_groups((g.group_id for g in listed.valid), run_id)
    if not groups:
        return []
    committed: dict[str, dict[TP, int]] = {}
    for group in groups:  # the API takes one group per request
        fut = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(group)], request_timeout=timeout)
        found = fut[group].result(timeout)
        committed[group] = {(tp.topic, tp.partition): int(tp.offset) for tp in found.topic_partitions or []
                            if tp.offset >= 0}
    highs = HighWatermarks(bootstrap)
    try:
        wanted = {tp for offsets in committed.values() for tp in offsets}
        high = {tp: highs(TopicPartition(*tp), timeout) for tp in sorted(wanted)}
    finally:
        highs.close()
    return [row for group in sorted(committed) for row in lag_rows(group, committed[group], high)]


__all__ = [
    "ENDED_STATES",
    "HighWatermarks",
    "LagProbe",
    "PartitionLag",
    "committed_lag",
    "for_run_state",
    "lag_rows",
    "run_groups",
]
