"""One shape for every stream processor, and an in-memory driver that runs it without a broker.

A *processor* is the logic of a stream role with the Kafka I/O taken out (the way Kafka Streams'
``Processor`` and Faust's agents separate it): ``init`` → ``process`` each input record /
``punctuate(now)`` on time → ``snapshot`` its state → ``restore`` it after a crash → ``close``.
Outputs go through :class:`Context.emit`; the processor never touches a client.

**Exactly-once contract.** A driver runs a processor in *commits*: the outputs emitted since the
last commit, the positions of the inputs consumed, and ``snapshot()`` become visible together or
not at all (on Kafka: one transaction, see :mod:`dora_rl.streams.kafka_runtime`). After a crash the
driver builds a fresh processor, calls ``restore(last committed snapshot)`` and feeds the inputs
again from the committed positions. Hence, for a processor whose outputs are a deterministic
function of (its state, the input record, ``now``), the committed output of a run with any number of
crashes equals that of an uninterrupted run. :class:`MemoryDriver` checks exactly this in unit
tests, crashing at every record boundary.

**Snapshots hold references, not payloads.** A snapshot must stay small (it is written at every
commit), so state that is a copy of an input record is kept as an :class:`Ref` (topic, partition,
offset) and fetched again on restore with :meth:`Context.fetch`; the record is still in the log (its
retention outlives the run, ``docs/topics.md``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dora_rl.schemas.records import DeadLetter


@dataclass(frozen=True)
class Ref:
    """Where an input record lies in the log."""

    topic: str
    partition: int
    offset: int

    def to_list(self) -> list[Any]:
        return [self.topic, self.partition, self.offset]

    @classmethod
    def from_list(cls, data: Sequence[Any]) -> Ref:
        return cls(str(data[0]), int(data[1]), int(data[2]))


@dataclass(frozen=True)
class InRecord:
    """One decoded input record of the processor's run, with its position."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    record: Any

    @property
    def ref(self) -> Ref:
        return Ref(self.topic, self.partition, self.offset)


def dead_letter_for(rec: InRecord, component: str, run_id: str, reason: str, error_type: str, ts_ms: int,
                    **extra: Any) -> DeadLetter:
    """The dead letter of an input record a processor refuses: its position and key, the reason, and ``extra``
    (the original value, the group it names, ...)."""
    return DeadLetter(component=component, reason=reason, error_type=error_type, source_topic=rec.topic,
                      source_partition=rec.partition, source_offset=rec.offset, ts_ms=ts_ms, run_id=run_id,
                      key=rec.key, **extra)


@dataclass(frozen=True)
class OutRecord:
    """One output: a typed record for ``topic`` with its key (``partition`` None: from the key)."""

    topic: str
    key: str
    record: Any
    partition: int | None = None


class Context:
    """What a processor may do besides computing: emit outputs, read the clock, fetch a record."""

    def __init__(self, fetch_many: Callable[[Iterable[Ref]], Mapping[Ref, Any]], clock: Callable[[], float],
                 wall_ms: Callable[[], int] | None = None) -> None:
        self._fetch_many = fetch_many
        self._clock = clock
        self._wall_ms = wall_ms or (lambda: int(time.time() * 1000))
        self.pending: list[OutRecord] = []

    def emit(self, topic: str, record: Any, key: str, partition: int | None = None) -> None:
        """Queue an output; it becomes visible with the next commit (never before)."""
        self.pending.append(OutRecord(topic, key, record, partition))

    def now(self) -> float:
        """The driver's clock in seconds: wall-clock on Kafka (a restored state keeps its meaning across
        processes), virtual in tests."""
        return self._clock()

    def wall_ms(self) -> int:
        """Wall-clock epoch milliseconds for record timestamps (virtual in tests, so outputs are
        reproducible)."""
        return self._wall_ms()

    def fetch_many(self, refs: Iterable[Ref]) -> Mapping[Ref, Any]:
        """The decoded records at ``refs`` (``restore`` re-loads referenced payloads with it);
        LookupError names any that is no longer in the log."""
        return self._fetch_many(list(refs))

    def take(self) -> list[OutRecord]:
        out, self.pending = self.pending, []
        return out


class Processor(Protocol):
    """The shape of a stream processor (see the module docstring for the contract)."""

    name: str
    """Stable name: the consumer group, transactional id and snapshot key derive from it."""

    inputs: tuple[str, ...]
    """Topics it consumes."""

    def init(self, ctx: Context) -> None:
        """Called once after construction (and after ``restore`` when there was a snapshot)."""
        ...

    def process(self, rec: InRecord, ctx: Context) -> None:
        """Handle one input record."""
        ...

    def punctuate(self, now: float, ctx: Context) -> None:
        """Time passed (called after every poll, with or without input)."""
        ...

    def held_back(self) -> frozenset[str]:
        """Input topics not to read for now (back-pressure): the driver stops fetching them after this
        punctuate and resumes once they leave the set, so what waits stays in the log, not in the state."""
        ...

    def snapshot(self) -> bytes:
        """The whole state, small (references, not payloads)."""
        ...

    def restore(self, snapshot: bytes, ctx: Context) -> None:
        """Rebuild the state from ``snapshot()`` of an earlier incarnation."""
        ...

    def close(self) -> None:
        """Release resources (no outputs)."""
        ...


@dataclass
class _Committed:
    outputs: list[OutRecord] = field(default_factory=list)
    snapshot: bytes | None = None
    position: dict[str, int] = field(default_factory=dict)  # per topic: how many of its inputs were fed


class MemoryDriver:
    """Runs a processor over a recorded input with commits, crashes and restores, in memory.

    ``inputs`` is the whole input in log order; ``times[i]`` is the clock when record ``i`` is fed (default
    ``i``; a record fed late is fed at the latest time already fed). The next record fed is the earliest one of a
    topic the processor does not hold back (:meth:`Processor.held_back`, asked after every punctuate), so with
    nothing held back the order is the log's. A commit happens after every ``commit_every`` records and at the
    end. :meth:`run` feeds everything but what is held back once nothing else is left (a real driver would wait
    until the processor wants it); ``crash_after=k`` discards what was emitted and consumed since the last
    commit once ``k`` records were fed (the process died there), builds a fresh processor with ``factory``,
    restores it from the committed snapshot and goes on from the committed positions.
    """

    def __init__(self, factory: Callable[[], Processor], inputs: Sequence[InRecord],
                 times: Sequence[float] | None = None, commit_every: int = 1) -> None:
        self.factory = factory
        self.inputs = list(inputs)
        self.times = list(times) if times is not None else [float(i) for i in range(len(self.inputs))]
        self.commit_every = max(1, commit_every)
        self.by_ref = {r.ref: r.record for r in self.inputs}
        self.by_topic: dict[str, list[int]] = {}
        for i, r in enumerate(self.inputs):
            self.by_topic.setdefault(r.topic, []).append(i)
        self.committed = _Committed(position={t: 0 for t in self.by_topic})
        self.restores = 0

    def _fetch_many(self, refs: Iterable[Ref]) -> dict[Ref, Any]:
        missing = [r for r in refs if r not in self.by_ref]
        if missing:
            raise LookupError(f"no record at {missing[:5]}")
        return self.by_ref

    def _next(self, cursor: dict[str, int], held: frozenset[str]) -> str | None:
        """The topic whose next record is fed now (see the class docstring), or None at the end."""
        free = {t: self.by_topic[t][k] for t, k in cursor.items() if k < len(self.by_topic[t]) and t not in held}
        return min(free, key=free.__getitem__) if free else None

    def _clock_at(self, cursor: dict[str, int]) -> float:
        """The clock once the records before ``cursor`` were fed: a record held back is fed at the time it
        is let in, never back in time."""
        return max((self.times[self.by_topic[t][k - 1]] for t, k in cursor.items() if k), default=0.0)

    def run(self, crash_after: Iterable[int] = ()) -> list[OutRecord]:
        """Feed every input; crash after each count in ``crash_after``; returns the committed outputs."""
        crashes = sorted(set(crash_after))
        cursor = dict(self.committed.position)
        fed = 0
        proc, ctx = self._start()
        held = proc.held_back()  # a function of the state: the restored one holds back what the committed one did
        while (topic := self._next(cursor, held)) is not None:
            i = self.by_topic[topic][cursor[topic]]
            rec, now = self.inputs[i], max(self.times[i], self._clock_at(cursor))
            ctx._clock = lambda now=now: now  # type: ignore[misc]
            ctx._wall_ms = lambda now=now: int(now * 1000)  # type: ignore[misc]
            proc.process(rec, ctx)
            proc.punctuate(now, ctx)
            held = proc.held_back()
            cursor[topic] += 1
            fed += 1
            if crashes and fed == crashes[0]:
                crashes.pop(0)
                proc.close()
                ctx.take()  # uncommitted outputs are lost with the process
                fed = sum(self.committed.position.values())
                cursor = dict(self.committed.position)
                proc, ctx = self._start()
                held = proc.held_back()
                continue
            if fed % self.commit_every == 0:
                self._commit(proc, ctx, cursor)
        self._commit(proc, ctx, cursor)
        proc.close()
        return list(self.committed.outputs)

    def _commit(self, proc: Processor, ctx: Context, cursor: dict[str, int]) -> None:
        self.committed.outputs.extend(ctx.take())
        self.committed.snapshot = proc.snapshot()
        self.committed.position = dict(cursor)

    def _start(self) -> tuple[Processor, Context]:
        ctx = Context(self._fetch_many, lambda: 0.0)
        proc = self.factory()
        if self.committed.snapshot is not None:
            proc.restore(self.committed.snapshot, ctx)
            self.restores += 1
        proc.init(ctx)
        return proc, ctx
