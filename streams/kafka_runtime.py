"""Runs a :class:`~dora_rl.streams.processor.Processor` against Kafka, exactly once, restartable.

Wiring only (the logic is the processor). One *commit* is one Kafka transaction holding:

1. the outputs the processor emitted since the last commit,
2. its ``snapshot()``, written to ``dora.state`` with key ``<run_id>/<processor>``,
3. the positions of every input consumed, in the consumer group ``dora.<run_id>.<processor>``.

So outputs, state and progress become visible together or not at all (consumers read
``read_committed``). The transactional id ``dora.<run_id>.<processor>`` is fixed: a restarted
processor's ``init_transactions`` aborts its predecessor's open transaction and fences it, so a
zombie (paused, then resumed after its replacement started) can never publish — its next commit
fails with a fatal error and it exits.

Restore: the latest committed snapshot is found by reading ``dora.state`` backwards from its end
(O(number of processors committing meanwhile), not O(run length)); inputs resume from the group's
committed positions, which were committed in the snapshot's own transaction. Partitions are
assigned directly (no group membership, so a restarted process gets its partitions at once, with no
session timeout or rebalance to wait out); the group only stores offsets.

Commits happen every ``commit_interval_s`` when anything was consumed or emitted, and at once when
the processor asks for it (``urgent``: e.g. after cutting a batch); a poll waits no longer than the next
commit is due. A short interval is a group commit: what arrives while a transaction commits goes into the
next one, so the transactions grow with the load and a record waits for about one.

Polling: by default a poll collects records for its whole timeout (``consume(500, timeout)``: one
``punctuate`` per 50 ms at most, for processors whose ``punctuate`` is costly). With ``linger_s`` it
returns ``linger_s`` after the first record arrives (0: at once, with what is already fetched), so a
record waits for no timer; ``bench/pipeline.py`` measures the difference.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from confluent_kafka import Consumer, KafkaException, TopicPartition

from dora_rl.infra.crashpoints import crash_point
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.consume import is_record, resume_all_partitions
from dora_rl.infra.kafka.io import (
    RecordProducer,
    consumer_config,
    dead_letter,
    letter_key,
    now_ms,
    read_range,
    reader_config,
)
from dora_rl.infra.kafka.lag import LagProbe
from dora_rl.infra.kafka.read import consume_ready
from dora_rl.infra.kafka.security import security_errors_fatal
from dora_rl.infra.kafka.snapshots import latest_snapshot, send_snapshot
from dora_rl.infra.observability import prom
from dora_rl.schemas.codec import DecodeError
from dora_rl.schemas.records import Record

from .processor import Context, InRecord, OutRecord, Processor, Ref

log = logging.getLogger(__name__)


REF_READS = {"fetch.max.bytes": 2 * 1024 * 1024, "max.partition.fetch.bytes": 2 * 1024 * 1024,
             "queued.max.messages.kbytes": 4096}
"""A reference fetch reads short ranges: fetches of 2 MiB (a larger record batch still comes whole, KIP-74) and
little read-ahead. With the readers' 64 MiB fetches, restoring 500 prompt references read ahead through the whole
dataset behind them: the restart grew with it (0.39 s at 10k prompts, 2.05 s at 1M)."""


class RefFetcher:
    """Random-access reads of records by (topic, partition, offset), grouped per partition."""

    def __init__(self, bootstrap: str, run_id: str, record_types: Mapping[str, type[Record]]) -> None:
        self.bootstrap, self.run_id = bootstrap, run_id
        self.record_types = dict(record_types)  # by catalogue name, as the processor's references name them

    def fetch_many(self, refs: Iterable[Ref], timeout: float = 30.0) -> dict[Ref, Any]:
        wanted: dict[tuple[str, int], set[int]] = {}
        for r in refs:
            wanted.setdefault((r.topic, r.partition), set()).add(r.offset)
        out: dict[Ref, Any] = {}
        if not wanted:
            return out
        consumer = Consumer({**reader_config(self.bootstrap, f"dora-ref-reader-{now_ms()}"), **REF_READS})
        try:
            for (topic, partition), offsets in wanted.items():
                tp = TopicPartition(topics.in_run(self.run_id, topic), partition)
                for msg in read_range(consumer, tp, min(offsets), max(offsets) + 1, timeout):
                    if msg.offset() in offsets:
                        ref = Ref(topic, partition, msg.offset() or 0)
                        out[ref] = self.record_types[topic].decode(msg.value(), msg.headers())
            missing = [r for r in (Ref(t, p, o) for (t, p), os in wanted.items() for o in os) if r not in out]
            if missing:
                raise LookupError(f"records no longer in the log (retention?): {missing[:5]}")
            return out
        finally:
            consumer.close()


class KafkaDriver:
    """Runs one processor of one run against the cluster (see the module docstring)."""

    def __init__(self, bootstrap: str, run_id: str, processor: Processor,
                 record_types: Mapping[str, type[Record]], start_offsets: Mapping[tuple[str, int], int],
                 commit_interval_s: float = 0.2, linger_s: float | None = None, max_records: int = 500,
                 token: str = "") -> None:
        self.bootstrap, self.run_id, self.proc = bootstrap, run_id, processor
        self.token = token  # signs the snapshots; only signed ones are restored (decision 0054)
        self.record_types = dict(record_types)  # by catalogue name: what the processor sees and emits
        self.topic_of = {topics.in_run(run_id, t): t for t in self.record_types}  # the run's topic -> catalogue
        self.start_offsets = dict(start_offsets)  # by the run's topic names (Kafka's positions)
        self.commit_interval_s = commit_interval_s
        self.linger_s, self.max_records = linger_s, max_records
        name = processor.name
        self.producer = RecordProducer(bootstrap, f"{name}-{run_id}",
                                       **{"transactional.id": f"dora.{run_id}.{name}"})
        self.producer.init_transactions(60)  # fences and aborts any predecessor; a refused id is fatal
        self.consumer = Consumer(consumer_config(bootstrap, f"dora.{run_id}.{name}", f"{name}-{run_id}"))
        self.lag = LagProbe(f"dora.{run_id}.{name}")  # recorded after each poll; read by the metrics endpoint
        prom.watch_consumer(self.consumer, self.lag, bootstrap)
        self.assigned: list[TopicPartition] = []  # set by start()
        self.fetcher = RefFetcher(bootstrap, run_id, self.record_types)
        self._cache: dict[Ref, Any] = {}
        self.ctx = Context(self._fetch_many, time.time)
        self.commits = 0
        self.restored_from: int | None = None
        self._held: frozenset[str] = frozenset()

    def _fetch_many(self, refs: Iterable[Ref]) -> dict[Ref, Any]:
        need = [r for r in refs if r not in self._cache]
        self._cache.update(self.fetcher.fetch_many(need))
        return self._cache

    def start(self) -> None:
        """Restore the processor from its latest snapshot (if any) and assign every input partition."""
        t0 = time.perf_counter()
        snap = latest_snapshot(self.bootstrap, self.run_id, self.proc.name,
                               since=self.start_offsets.get((topics.in_run(self.run_id, topics.STATE), 0), 0),
                               token=self.token)
        start = dict(self.start_offsets)
        if snap is not None:
            self.proc.restore(snap.state, self.ctx)
            self.restored_from = int(snap.commit)
            self.commits = int(snap.commit)
            start.update(((p.topic, p.partition), int(p.offset)) for p in snap.positions)
        self.proc.init(self.ctx)
        self._cache.clear()
        missing = resume_all_partitions(self.consumer, self.topic_of, start,
                                        f"{self.proc.name}: inputs and committed offsets")
        self.assigned = list(self.consumer.assignment())
        if snap is None and len(missing) < len(self.consumer.assignment()):
            raise RuntimeError(f"{self.proc.name}: its group committed input offsets but no snapshot of it is "
                               "found (each commit writes both): its state is lost, e.g. a record written under "
                               "its key was compacted over it; refusing to resume with an empty state")
        if snap is not None and missing:  # offsets expired (offsets.retention.minutes) or deleted
            log.warning("%s: no committed offset for %d input partitions: resuming them from snapshot %d's "
                        "positions", self.proc.name, len(missing), snap.commit)
        self._hold_back()
        log.info("%s: %s in %.2fs", self.proc.name,
                 f"restored from commit {self.restored_from}" if snap is not None else "fresh start",
                 time.perf_counter() - t0)

    def poll(self, timeout: float) -> int:
        """Feed what arrives within ``timeout`` to the processor; returns the records consumed."""
        with security_errors_fatal(f"{self.proc.name}: consume"):
            if self.linger_s is None:
                msgs = self.consumer.consume(self.max_records, timeout)
            else:  # wait for the first record only, then take what is fetched (or arrives within linger_s)
                msgs = consume_ready(self.consumer, self.max_records, timeout, self.linger_s)
        self.lag.record(self.consumer, self.assigned)
        n = 0
        for msg in msgs:
            if not is_record(msg):
                continue
            n += 1
            topic = self.topic_of[msg.topic() or ""]
            try:
                record = self.record_types[topic].decode(msg.value(), msg.headers(), keep_wire=True)
            except DecodeError as exc:  # refused in the next commit's transaction, with its position
                letter = dead_letter(msg, self.proc.name, self.run_id, str(exc), exc.error_type)
                self.ctx.emit(topics.DLQ, letter, letter_key(msg))
                log.warning("dead-lettered %s[%s]@%s: %s", topic, msg.partition(), msg.offset(), exc)
                continue
            if getattr(record, "run_id", self.run_id) != self.run_id:
                continue
            self.proc.process(InRecord(topic, msg.partition() or 0, msg.offset() or 0, msg.key(), record), self.ctx)
        self.proc.punctuate(self.ctx.now(), self.ctx)
        self._hold_back()
        return n

    def _hold_back(self) -> None:
        """Pause the partitions of the topics the processor holds back, resume those it no longer does."""
        held = self.proc.held_back()
        if held == self._held:
            return
        parts = self.consumer.assignment()
        pause = [tp for tp in parts if self.topic_of[tp.topic] in held and self.topic_of[tp.topic] not in self._held]
        resume = [tp for tp in parts if self.topic_of[tp.topic] in self._held and self.topic_of[tp.topic] not in held]
        if pause:
            self.consumer.pause(pause)
        if resume:
            self.consumer.resume(resume)
        self._held = held

    def commit(self) -> None:
        """Outputs + snapshot + input positions in one transaction."""
        outs: list[OutRecord] = self.ctx.take()
        t0 = time.perf_counter()
        self.producer.raw.begin_transaction()
        try:
            for o in outs:
                self.producer.send(topics.in_run(self.run_id, o.topic), o.record, o.key, partition=o.partition)
            self.commits += 1
            positions = [tp for tp in self.consumer.position(self.consumer.assignment()) if tp.offset >= 0]
            send_snapshot(self.producer, self.run_id, self.proc.name, self.commits, self.proc.snapshot(),
                          [(tp.topic, tp.partition, tp.offset) for tp in positions], self.token)
            self.producer.raw.send_offsets_to_transaction(positions, self.consumer.consumer_group_metadata(), 60)
            crash_point(f"{self.proc.name}.before_commit")
            t1 = time.perf_counter()
            self.producer.raw.commit_transaction(60)
            log.debug("%s: commit %d: %d outputs in %.1f ms (commit_transaction %.1f ms)", self.proc.name, self.commits,
                      len(outs), 1000 * (time.perf_counter() - t0), 1000 * (time.perf_counter() - t1))
        except KafkaException:
            log.exception("%s: commit %d failed (fenced by a newer incarnation, or the broker)",
                          self.proc.name, self.commits)
            with security_errors_fatal(f"{self.proc.name}: commit {self.commits}"):
                raise  # a refused credential/ACL becomes KafkaSecurityError naming its code

    def run(self, stop: Callable[[], bool], done: Callable[[], bool] = lambda: False,
            urgent: Callable[[], bool] = lambda: False) -> None:
        """Poll, process and commit until ``stop()`` or ``done()``; the last state is committed."""
        self.start()
        last_commit = time.monotonic()
        dirty = False
        try:
            while not stop():  # a poll waits no longer than the next commit is due
                due = self.commit_interval_s - (time.monotonic() - last_commit) if dirty else 0.05
                n = self.poll(min(0.05, max(0.0, due)))
                dirty = dirty or n > 0 or bool(self.ctx.pending)
                if dirty and (urgent() or time.monotonic() - last_commit >= self.commit_interval_s):
                    self.commit()
                    last_commit, dirty = time.monotonic(), False
                if done() and not dirty:
                    break
            if dirty:
                self.commit()
        finally:
            self.proc.close()
            prom.release_consumer(self.consumer)
