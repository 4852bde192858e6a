"""Snapshots of a role's state on ``dora.state``: key ``<run_id>/<name>``, the newest record wins.

Written by the stream processors (inside their commit's transaction, ``streams/kafka_runtime.py``) and
by the rollout instances (their poison-input tries, ``dora_rl.core.attempts``, flushed before each engine
call). Read back by the next incarnation of the same role, from the end of the topic backwards down to the
run's start offset, so finding it costs O(records written since), not O(run length) nor O(topic history).
The topic is compacted: only the newest snapshot per key survives, which is all a restore needs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.io import RecordProducer, now_ms, read_backwards
from dora_rl.infra.kafka.signing import signature_problem, signed
from dora_rl.schemas.codec import DecodeError
from dora_rl.schemas.records import InputPosition, ProcessorSnapshot

log = logging.getLogger(__name__)


def snapshot_key(run_id: str, name: str) -> str:
    return f"{run_id}/{name}"


def latest_snapshot(bootstrap: str, run_id: str, name: str, since: int = 0,
                    token: str = "") -> ProcessorSnapshot | None:
    """The newest committed snapshot of ``name`` of ``run_id``, or None (a fresh start). ``since`` is the run's
    start offset on ``dora.state`` (its :class:`~dora_rl.schemas.records.RunInfo`): nothing of the run lies
    before it, so a fresh start reads only the run's own records, not every earlier run's on the shared topic
    (without it, a new run's first start grew with the topic's history: 0.1 s -> 22 s over ten runs).

    A record under the key that does not decode, or (``token`` given) is not signed with the run's token, is
    passed by with a warning: anyone may write the topic, and only the processor's own snapshots count."""
    key = snapshot_key(run_id, name).encode()
    for window in read_backwards(bootstrap, topics.in_run(run_id, topics.STATE), stop_at=since):
        for msg in reversed(window):
            if msg.key() != key:
                continue
            try:
                snap = ProcessorSnapshot.decode(msg.value(), msg.headers())
            except DecodeError as exc:
                log.warning("snapshot of %s at offset %d is unreadable, passed by: %s", name, msg.offset(), exc)
                continue
            problem = signature_problem(snap, token, f"snapshot of {name} at offset {msg.offset()}")
            if problem is not None:
                log.warning("%s: passed by", problem)
                continue
            return snap
    return None


def send_snapshot(producer: RecordProducer, run_id: str, name: str, commit: int, state: bytes,
                  positions: Iterable[tuple[str, int, int]] = (), token: str = "") -> None:
    """Queue one snapshot with the input ``positions`` (topic, partition, next offset) committed alongside it,
    signed with ``token`` (the caller flushes, or commits its transaction)."""
    snap = ProcessorSnapshot(run_id=run_id, processor=name, commit=commit, ts_ms=now_ms(), state=state,
                             positions=tuple(InputPosition(topic=t, partition=p, offset=o) for t, p, o in positions))
    snap = signed(snap, token)
    producer.send(topics.in_run(run_id, topics.STATE), snap, snapshot_key(run_id, name), partition=0)
