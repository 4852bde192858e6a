"""Runs are isolated (issue 32, decision 0063): every run has its own topics, so one run's paused transaction
cannot hold back another run's read-committed readers.

A process of run A opens a transaction on every one of A's topics, writes a record to each and is SIGSTOPped (a
GC pause, a stopped container) with a transaction timeout of 5 minutes. Until then no read-committed reader
passes those records: A's batches have a last stable offset below their end all along. Run B, started meanwhile
on the same broker, trains all its steps in a fraction of that time. When the topics were shared, B's trainer,
scorer and assembler waited behind A's open transaction until the broker aborted it.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from run_helpers import emulated_run

pytestmark = pytest.mark.broker

HELD_S = 300
"""Run A's transaction timeout: how long its stopped transaction would hold shared readers back."""

OPEN_AND_STOP = """
import os, signal, sys
from confluent_kafka import Producer
p = Producer({"bootstrap.servers": sys.argv[1], "transactional.id": sys.argv[2],
              "transaction.timeout.ms": int(sys.argv[3]) * 1000})
p.init_transactions(30)
p.begin_transaction()
for topic in sys.argv[4:]:
    p.produce(topic, b"never committed", b"held", partition=0)
assert p.flush(30) == 0
print("open", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def _state(pid: int) -> str:
    """The process state letter of ``pid`` (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _ends(bootstrap: str, topic: str) -> tuple[int, int]:
    """(last stable offset, log end offset) of partition 0 of ``topic``: where a read-committed reader must stop,
    and where the log ends."""
    from confluent_kafka import Consumer, TopicPartition

    ends = []
    for isolation in ("read_committed", "read_uncommitted"):
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"dora-reader-ends-{uuid.uuid4().hex[:6]}",
                             "isolation.level": isolation})
        try:
            ends.append(int(consumer.get_watermark_offsets(TopicPartition(topic, 0), timeout=15)[1]))
        finally:
            consumer.close()
    return ends[0], ends[1]


def test_a_stopped_transaction_of_one_run_does_not_delay_another(bootstrap: str, dora_home: Path) -> None:
    from dora_rl.config import DoraConfig
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.runs import start_run
    from dora_rl.launcher import run

    run_a = start_run(bootstrap, DoraConfig.from_dict(emulated_run()), f"held-{uuid.uuid4().hex[:6]}")
    held = [topics.in_run(run_a.run_id, s.name) for s in topics.catalogue() if s.name not in topics.GLOBAL_TOPICS]
    stopped = subprocess.Popen([sys.executable, "-c", OPEN_AND_STOP, bootstrap, f"dora.{run_a.run_id}.assembler",
                                str(HELD_S), *held], stdout=subprocess.PIPE)
    try:
        assert stopped.stdout is not None and stopped.stdout.readline() == b"open\n"
        deadline = time.monotonic() + 10
        while _state(stopped.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(stopped.pid) == "T", "run A's producer should be stopped with its transaction open"
        a_batches = topics.in_run(run_a.run_id, topics.BATCHES)
        stable, end = _ends(bootstrap, a_batches)
        assert stable < end, "run A's readers are held back by its open transaction, as intended"

        t0 = time.monotonic()
        summary = run(DoraConfig.from_dict(emulated_run(steps=4, seed=23)), bootstrap, quiet=True)
        took = time.monotonic() - t0
        assert summary["steps"] == 4 and summary["failed"] is None, summary
        assert took < HELD_S / 3, f"run B took {took:.0f}s beside run A's open transaction"
        assert _state(stopped.pid) == "T" and _ends(bootstrap, a_batches) == (stable, end), \
            "run A's transaction was open for all of run B"
        print(f"run B: 4 steps in {took:.1f}s beside run A's stopped transaction (timeout {HELD_S}s)")
    finally:
        os.kill(stopped.pid, signal.SIGKILL)
        stopped.wait(timeout=30)

    # a finished run's topics can be deleted (run B's); a run not over cannot (run A's: STARTED, never ended)
    runs = [sys.executable, "-m", "dora_rl", "runs", "--bootstrap-servers", bootstrap]
    refused = subprocess.run([*runs, "--delete", run_a.run_id], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "is not over" in refused.stderr, refused.stderr[-2000:]
    deleted = subprocess.run([*runs, "--delete", summary["run_id"]], capture_output=True, text=True, timeout=120)
    assert deleted.returncode == 0 and f"deleted {len(held)} topics" in deleted.stdout, deleted.stderr[-2000:]
    listed = subprocess.run(runs, capture_output=True, text=True, timeout=120).stdout.splitlines()
    assert next(line for line in listed if line.startswith(summary["run_id"])).endswith("topics deleted"), listed
    assert not next(line for line in listed if line.startswith(run_a.run_id)).endswith("topics deleted")
