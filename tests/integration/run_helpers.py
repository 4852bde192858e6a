"""Helpers shared by the integration tests that follow a live run (tests/integration is on sys.path)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any


def _metrics(bootstrap: str, run_id: str) -> list[Any]:
    """The decodable records of ``dora.metrics`` from the run's start (garbage on the topic is passed over)."""
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.runs import get_run, read_run
    from dora_rl.schemas.codec import DecodeError
    from dora_rl.schemas.records import Metric

    out = []
    for msg in read_run(bootstrap, get_run(bootstrap, run_id), topics.METRICS):
        try:
            out.append(Metric.decode(msg.value(), msg.headers()))
        except DecodeError:
            continue
    return out


def steps_done(bootstrap: str, run_id: str) -> int:

    steps = set()
    for m in _metrics(bootstrap, run_id):
        if m.run_id == run_id and m.component == "trainer" and m.name == "reward_mean" and m.step is not None:
            steps.add(int(m.step))
    return len(steps)


def wait_for(cond: Any, timeout: float, what: str | Callable[[], str]) -> None:
    """Poll ``cond`` every 0.5 s until true; past ``timeout`` fail with ``what`` (a callable: called then, so
    that the message can show the state at the time of the failure)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what() if callable(what) else what}")
        time.sleep(0.5)


def announcements(bootstrap: str, run_id: str) -> list[Any]:
    """Every committed announcement of the run: the trainer's first ones on VERSIONS, then every holder's
    (the trainer's after a restore, the instances') on HOLDERS, each decoded as a ``PolicyVersion``."""
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.runs import get_run, read_run
    from dora_rl.schemas.records import PolicyVersion

    info = get_run(bootstrap, run_id)
    return [PolicyVersion.decode(m.value(), m.headers()) for topic in (topics.VERSIONS, topics.HOLDERS)
            for m in read_run(bootstrap, info, topic)]


def emulated_run(**overrides: Any) -> dict[str, Any]:
    """A small dora-mode run config on the emulated engine (2 instances, TBS 16, G 4), with overrides;
    ``emulated`` overrides are merged into the engine's parameters."""
    engine = {"vocab": 59, "eos_id": 2, "base_step_s": 0.03, "cap_fraction": 0.1, **overrides.pop("emulated", {})}
    return {"mode": "dora", "max_staleness": 1, "steps": 8, "train_batch_size": 16, "group_size": 4,
            "rollout_batch_size": 32, "num_instances": 2, "instance_concurrency": 16, "max_new_tokens": 96,
            "engine": "emulated", "sft_steps": 0, "weight_transport": "tcp", "seed": 0, **overrides,
            "emulated": engine}


def trajectories(bootstrap: str, run_id: str) -> list[Any]:
    """The run's trajectories on ``dora.rollout.trajectories``, in log order."""
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.runs import get_run, read_run
    from dora_rl.schemas.records import Trajectory

    decoded = (Trajectory.decode(msg.value(), msg.headers())
               for msg in read_run(bootstrap, get_run(bootstrap, run_id), topics.TRAJECTORIES))
    return [t for t in decoded if t.run_id == run_id]


def trajectories_by_instance(bootstrap: str, run_id: str) -> dict[str, int]:
    out: dict[str, int] = {}
    for t in trajectories(bootstrap, run_id):
        out[t.instance_id] = out.get(t.instance_id, 0) + 1
    return out


def metric_total(bootstrap: str, run_id: str, component: str, name: str) -> float:

    total = 0.0
    for m in _metrics(bootstrap, run_id):
        if m.run_id == run_id and m.component == component and m.name == name:
            total += m.value
    return total


def launch_run(bootstrap: str, dora_home: Path, tmp_path: Path, config: dict[str, Any],
               json_out: Path | None = None, output: int | None = subprocess.PIPE, extra: tuple[str, ...] = (),
               marker: str = "pids.json") -> tuple[subprocess.Popen[bytes], Path]:
    """``dora-rl run`` of ``config`` (plus ``extra`` arguments) as a child process (stdout+stderr to ``output``);
    returns it and the new run's directory once every role is up (its ``marker`` file exists: ``pids.json``,
    or ``placement.json`` for a run placed by Ray). The caller kills it on failure."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config))
    runs = dora_home / "runs"
    known = {d.name for d in runs.iterdir()} if runs.exists() else set()  # the session's earlier runs
    args = [sys.executable, "-m", "dora_rl", "run", "--bootstrap-servers", bootstrap, "--config", str(cfg), "--quiet",
            *extra]
    launcher = subprocess.Popen(args + (["--json", str(json_out)] if json_out else []), stdout=output,
                                stderr=subprocess.STDOUT if output == subprocess.PIPE else output, env=dict(os.environ))
    try:
        wait_for(lambda: runs.exists() and any((d / marker).exists() for d in runs.iterdir()
                                               if d.name not in known), 120, "the roles")
    except BaseException:
        launcher.kill()
        raise
    return launcher, next(d for d in runs.iterdir() if d.name not in known and (d / marker).exists())


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


def _state(pid: int) -> str:
    """The process state letter of ``pid`` (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


@contextlib.contextmanager
def stalled_neighbour(bootstrap: str, held_s: int) -> Iterator[tuple[str, Callable[[], None]]]:
    """A run beside the caller's whose transactional producer wrote to every one of its topics and was SIGSTOPped
    (a GC pause, a stopped container) with a transaction timeout of ``held_s``: until then no read-committed reader
    passes those records. Yields the run's id and a check that it still holds its readers back (its batches' last
    stable offset below their end, the producer stopped); kills the producer on exit (decision 0063)."""
    from dora_rl.config import DoraConfig
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.runs import start_run

    run = start_run(bootstrap, DoraConfig.from_dict(emulated_run()), f"held-{uuid.uuid4().hex[:6]}").run_id
    held = [topics.in_run(run, s.name) for s in topics.catalogue() if s.name not in topics.GLOBAL_TOPICS]
    stopped = subprocess.Popen([sys.executable, "-c", OPEN_AND_STOP, bootstrap, f"dora.{run}.assembler",
                                str(held_s), *held], stdout=subprocess.PIPE)
    batches = topics.in_run(run, topics.BATCHES)
    try:
        assert stopped.stdout is not None and stopped.stdout.readline() == b"open\n"
        wait_for(lambda: _state(stopped.pid) == "T", 10, "the neighbour's producer stopped")
        stable, end = _ends(bootstrap, batches)
        assert stable < end, "the neighbour's readers are held back by its open transaction"

        def still_held() -> None:
            assert _state(stopped.pid) == "T" and _ends(bootstrap, batches) == (stable, end), \
                "the neighbour's transaction must stay open all along"

        yield run, still_held
    finally:
        os.kill(stopped.pid, signal.SIGKILL)
        stopped.wait(timeout=30)
