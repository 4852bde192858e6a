"""bench/orchestrator_snapshot: the orchestrator's snapshot size and restart time against the dataset's size
(issue 31: flat at 10k and 1M queued prompts).

For each dataset size ``n`` (a fresh run id each, on a real broker): ``n`` prompts are written to
``dora.prompts``; the orchestrator (its processor under the Kafka driver, dora mode, no version announced yet:
nothing is dispatched, every prompt would wait in its queue) runs for ``--seconds``; then its newest committed
snapshot is read back (bytes, and the prompts it references), and a fresh orchestrator is started on the same
run (the restart: restore the snapshot, fetch the records it references, assign its inputs at the committed
positions) and timed, ``--repeats`` times (the median is reported). ``--no-hold-back`` runs the orchestrator with
the hold-back rule switched off, as it was before (its queue, so its snapshot, holds every prompt read).

Usage: ``python bench/orchestrator_snapshot.py [--sizes 10000 1000000] [--seconds 20] [--no-hold-back]``
-> ``bench/results/orchestrator-snapshot-<time>.json``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def write_prompts(bootstrap: str, run_id: str, n: int) -> float:
    """``n`` prompts of ``run_id`` on ``dora.prompts`` (keyed by group, as the dataset role writes them)."""
    import numpy as np
    from confluent_kafka import Producer

    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.keys import make_key
    from dora_rl.schemas.records import Prompt

    t0 = time.perf_counter()
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50, "batch.size": 1_000_000,
                         "compression.type": "lz4", "queue.buffering.max.messages": 1_000_000})
    ids = np.asarray([5, 6, 7, 8], dtype=np.int32)
    prompts = topics.in_run(run_id, topics.PROMPTS)
    for i in range(n):
        p = Prompt(run_id=run_id, prompt_id=f"p{i}", group_id=f"{run_id}/p{i}", task="reverse",
                   prompt_text="abcd=", prompt_ids=ids, reference="dcba")
        value, headers = p.encode()
        while True:
            try:
                producer.produce(prompts, value, make_key(0, p.group_id).encode(), headers=headers)
                break
            except BufferError:
                producer.poll(0.1)
        if i % 10_000 == 0:
            producer.poll(0)
    assert producer.flush(300) == 0
    return time.perf_counter() - t0


def topic_ends(bootstrap: str, names: list[str]) -> dict[tuple[str, int], int]:
    """The end offset of every partition of ``names``: a run that starts now reads from there."""
    from confluent_kafka import Consumer, TopicPartition

    from dora_rl.infra.kafka.read import watermarks  # retries while a new topic elects its leaders

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"bench-ends-{uuid.uuid4().hex[:6]}"})
    try:
        out = {}
        for t in names:
            for p in c.list_topics(t, timeout=30).topics[t].partitions:
                out[(t, p)] = watermarks(c, TopicPartition(t, p), 30)[1]
        return out
    finally:
        c.close()


def measure(bootstrap: str, n: int, seconds: float, hold_back: bool, repeats: int) -> dict[str, Any]:
    from dora_rl.config import DoraConfig
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.snapshots import latest_snapshot
    from dora_rl.launcher import prepare_topics
    from dora_rl.streams.kafka_runtime import KafkaDriver
    from dora_rl.streams.orchestrator import Orchestrator, input_types

    config = DoraConfig.from_dict({"mode": "dora", "max_staleness": 1, "steps": 10_000, "train_batch_size": 64,
                                   "group_size": 8, "rollout_batch_size": 128, "num_instances": 4,
                                   "engine": "emulated"})
    run_id = f"snapbench-{n}-{uuid.uuid4().hex[:6]}"
    types = input_types(config)
    prepare_topics(bootstrap, 4, run_id=run_id)  # the run's own topics (decision 0063)
    start = topic_ends(bootstrap, [topics.in_run(run_id, t) for t in (*types, topics.STATE)])
    write_s = write_prompts(bootstrap, run_id, n)

    class Unheld(Orchestrator):
        def held_back(self) -> frozenset[str]:
            return frozenset()

    cls = Orchestrator if hold_back else Unheld
    driver = KafkaDriver(bootstrap, run_id, cls(run_id, config), types, start)
    deadline = time.monotonic() + seconds
    driver.run(stop=lambda: time.monotonic() > deadline)
    queued = driver.proc.rules.status().queued_prompts  # type: ignore[attr-defined]
    state_start = start.get((topics.in_run(run_id, topics.STATE), 0), 0)
    snap = latest_snapshot(bootstrap, run_id, "orchestrator", since=state_start)
    size = len(snap.state) if snap is not None else 0
    restarts, restored = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        again = KafkaDriver(bootstrap, run_id, cls(run_id, config), types, start)
        again.start()
        restarts.append(round(time.perf_counter() - t0, 3))
        restored = again.proc.rules.status().queued_prompts  # type: ignore[attr-defined]
        again.consumer.close()
    row = {"dataset_prompts": n, "write_s": round(write_s, 1), "queued_prompts": queued,
           "snapshot_bytes": size, "restart_s": restarts, "restart_s_median": statistics.median(restarts),
           "restored_queue": restored, "hold_back": hold_back}
    print(row, flush=True)
    return row


def main(argv: list[str] | None = None) -> int:
    from provenance import provenance, write_result

    from dora_rl.infra.broker.server import LocalBroker
    from dora_rl.infra.observability.logs import setup_logging
    from dora_rl.launcher import prepare_topics

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10_000, 1_000_000])
    ap.add_argument("--seconds", type=float, default=20.0, help="how long the orchestrator reads before the restart")
    ap.add_argument("--repeats", type=int, default=5, help="restarts timed per size (the median is reported)")
    ap.add_argument("--no-hold-back", action="store_true", help="the orchestrator as before: every prompt queued")
    ap.add_argument("--bootstrap-servers", default=None)
    args = ap.parse_args(argv)
    setup_logging("WARNING")
    broker = None
    bootstrap = args.bootstrap_servers
    if not bootstrap:
        broker = LocalBroker(Path(tempfile.mkdtemp(prefix="bench-snap-")) / "broker", port=0)
        broker.start()
        bootstrap = broker.bootstrap_servers
    try:
        prepare_topics(bootstrap, 4)
        rows = [measure(bootstrap, n, args.seconds, not args.no_hold_back, args.repeats) for n in args.sizes]
    finally:
        if broker is not None:
            broker.stop()
    out = {**provenance(), "command": " ".join(["python bench/orchestrator_snapshot.py", *(argv or sys.argv[1:])]),
           "seconds": args.seconds, "rows": rows}
    path = write_result("orchestrator-snapshot", out)
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
