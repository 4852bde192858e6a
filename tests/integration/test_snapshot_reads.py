"""Restoring a role reads only its own run's records of the shared ``dora.state`` topic (real broker).

Runs share topics (decision 0008). Before, a fresh start read ``dora.state`` backwards to its very
beginning looking for a snapshot it could not have, so a new run's first start grew with every earlier
run on the cluster (bench/modes: 0.1 s on the first run of a broker, 22 s on its tenth).
"""

from __future__ import annotations

import time

import pytest
from confluent_kafka.admin import AdminClient

from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.io import RecordProducer
from dora_rl.infra.kafka.runs import end_offsets
from dora_rl.infra.kafka.snapshots import latest_snapshot, send_snapshot
from dora_rl.infra.kafka.topic_admin import ensure_topics

pytestmark = pytest.mark.broker


def _state_end(bootstrap: str, run_id: str) -> int:
    """The end offset of the run's ``dora.state`` (its topics made first, as ``start_run`` does)."""
    ensure_topics(AdminClient({"bootstrap.servers": bootstrap}), 4, run_id=run_id)
    state = topics.in_run(run_id, topics.STATE)
    return {(o.topic, o.partition): o.offset for o in end_offsets(bootstrap, run_id)}[(state, 0)]


def test_a_fresh_start_does_not_read_before_its_run(bootstrap: str) -> None:
    producer = RecordProducer(bootstrap, "snapshot-test")
    _state_end(bootstrap, "new-run")
    for i in range(600):  # history before the run began, with a record under the key the run will look for
        send_snapshot(producer, "new-run", f"p{i % 7}", i, b"x" * 2000)
    send_snapshot(producer, "new-run", "orchestrator", 1, b"stale: written before the run began")
    producer.flush()
    since = _state_end(bootstrap, "new-run")

    assert latest_snapshot(bootstrap, "new-run", "orchestrator") is not None, "the record is there to find"
    t0 = time.perf_counter()
    assert latest_snapshot(bootstrap, "new-run", "orchestrator", since=since) is None
    assert time.perf_counter() - t0 < 5

    send_snapshot(producer, "new-run", "orchestrator", 2, b"mine")
    producer.flush()
    snap = latest_snapshot(bootstrap, "new-run", "orchestrator", since=since)
    assert snap is not None and snap.commit == 2 and snap.state == b"mine"


def test_reading_backwards_yields_every_record_once_in_every_window(bootstrap: str) -> None:
    """Every window of ``read_backwards`` must hold exactly its records. When one consumer was re-assigned
    to each older window, a window was skipped (a position left from the newer window read as "done"); that made a
    restarted assembler restore an older snapshot than its committed offsets: it waited for trajectories it
    had already consumed, and the run stalled (bench/chaos.py --steps 100, decision 0036)."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    from dora_rl.infra.kafka.io import read_backwards

    topic = f"test.backwards.{time.time_ns()}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    for i in range(3000):
        producer.produce(topic, key=str(i).encode(), value=b"v" * 100)
    producer.flush(30)
    for window in (64, 1000):
        for trial in range(2):
            got: list[int] = []
            for msgs in read_backwards(bootstrap, topic, 0, window=window):
                offs = [m.offset() for m in msgs]
                assert offs == sorted(offs)
                got = offs + got
            assert got == list(range(3000)), (window, trial, len(got), sorted(set(range(3000)) - set(got))[:10])


def test_a_processor_restores_only_its_own_signed_snapshot(bootstrap: str) -> None:
    """Decision 0054: anyone may write ``dora.state``. A record under a processor's key that does not decode, is
    unsigned, or is signed with another key is passed by; the newest snapshot signed with the run's token wins."""
    producer = RecordProducer(bootstrap, "snapshot-forgery")
    since = _state_end(bootstrap, "signed-run")
    send_snapshot(producer, "signed-run", "assembler", 7, b"genuine", [("dora.rollout.scored", 0, 42)], "run-token")
    send_snapshot(producer, "signed-run", "assembler", 8, b"forged, signed elsewhere", (), "attacker")
    send_snapshot(producer, "signed-run", "assembler", 9, b"forged, unsigned")
    producer.send_raw(topics.in_run("signed-run", topics.STATE), b"\x00garbage", b"signed-run/assembler", partition=0)
    producer.flush()
    snap = latest_snapshot(bootstrap, "signed-run", "assembler", since=since, token="run-token")
    assert snap is not None and snap.commit == 7 and snap.state == b"genuine"
    assert [(p.topic, p.partition, p.offset) for p in snap.positions] == [("dora.rollout.scored", 0, 42)]
    unchecked = latest_snapshot(bootstrap, "signed-run", "assembler", since=since)
    assert unchecked is not None and unchecked.commit == 9, "without the token the newest decodable record wins"
