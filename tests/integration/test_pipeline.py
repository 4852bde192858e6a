"""The whole loop against the real broker: every role a process, Avro on the wire, audit after the run.

One small sync run (tiny model, short warm-up) is shared by the tests of this module. While it
runs, malformed records are injected into every input topic: each must end in ``dora.dlq`` with
a reason, and the run must still finish.
"""

from __future__ import annotations

import io
import json
import threading
import time
from pathlib import Path
from typing import Any

import fastavro
import numpy as np
import pytest

from dora_rl.config import DoraConfig
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.io import RecordProducer, read_all
from dora_rl.infra.kafka.runs import list_runs
from dora_rl.schemas import codec
from dora_rl.schemas.records import DeadLetter

pytestmark = pytest.mark.broker

SMALL = dict(steps=3, train_batch_size=16, rollout_batch_size=16, group_size=4, sft_steps=10,
             max_new_tokens=24)  # weight_transport: the default, UCX

#: input topic -> partition to inject into (requests: instance 0's partition)
INPUTS = {topics.PROMPTS: 0, topics.REQUESTS: 0, topics.TRAJECTORIES: 0, topics.SCORED: 0,
          topics.BATCHES: 0, topics.VERSIONS: 0}


def _inject_garbage_when_run_starts(bootstrap: str, known: set[str], out: dict[str, Any]) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        new = set(list_runs(bootstrap)) - known
        if new:
            out["run_id"] = sorted(new)[-1]
            producer = RecordProducer(bootstrap, "garbage")
            for topic, partition in INPUTS.items():  # the run's own topics
                producer.send_raw(topics.in_run(out["run_id"], topic), b"\x07not avro at all", b"v0000000000/garbage",
                                  partition=partition)
            # a well-formed Avro body under the wrong schema header
            producer.send_raw(topics.in_run(out["run_id"], topics.TRAJECTORIES), b"\x00", b"v0000000000/wrong",
                              [(codec.HEADER_SCHEMA, b"dora.v1.Metric")], partition=1)
            producer.flush()
            return
        time.sleep(0.5)


@pytest.fixture(scope="module")
def sync_run(bootstrap: str, dora_home: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from dora_rl.launcher import run

    known = set(list_runs(bootstrap))
    injected: dict[str, Any] = {}
    t = threading.Thread(target=_inject_garbage_when_run_starts, args=(bootstrap, known, injected), daemon=True)
    t.start()
    out = tmp_path_factory.mktemp("run") / "summary.json"
    summary = run(DoraConfig.from_dict(SMALL), bootstrap, out, quiet=True)
    t.join(5)
    assert injected.get("run_id") == summary["run_id"]
    summary["json_file"] = out
    return summary


def test_run_finishes_and_writes_the_summary(sync_run: dict[str, Any]) -> None:
    on_disk = json.loads(Path(sync_run["json_file"]).read_text())
    for key in ("mode", "steps", "wall_s", "reward_per_step", "trained_tokens", "throughput_tokens_per_s"):
        assert key in on_disk
    assert on_disk["mode"] == "sync" and on_disk["steps"] == 3
    assert len(on_disk["reward_per_step"]) == 3
    assert all(0.0 <= r <= 1.0 for r in on_disk["reward_per_step"])
    assert on_disk["trained_tokens"] > 0 and on_disk["throughput_tokens_per_s"] > 0


def test_audit_passes_for_the_sync_run(bootstrap: str, sync_run: dict[str, Any]) -> None:
    from dora_rl.consumers.audit import audit_run

    report = audit_run(bootstrap, sync_run["run_id"])
    assert report.ok, report.render()
    assert report.batches == 3 and report.trajectories_batched == 48
    assert report.max_staleness_seen == 0


def test_malformed_input_on_every_topic_is_dead_lettered(bootstrap: str, sync_run: dict[str, Any]) -> None:
    run_id = sync_run["run_id"]
    letters = []
    for m in read_all(bootstrap, topics.in_run(run_id, topics.DLQ)):
        try:
            letters.append(DeadLetter.decode(m.value(), m.headers()))
        except codec.DecodeError:
            continue  # garbage written to dora.dlq itself (test_fuzz_topics shares the broker)
    mine = [d for d in letters if d.run_id == run_id]
    by_topic = {d.source_topic for d in mine}
    assert set(INPUTS) <= by_topic, f"dead letters only for {by_topic}"
    for d in mine:
        assert d.reason and d.error_type in ("decode", "schema")
        assert d.value is not None  # the original bytes are kept
    assert any("declares schema" in d.reason for d in mine if d.source_topic == topics.TRAJECTORIES)


def test_console_consumer_reads_trajectories_and_avsc_decodes_them(bootstrap: str, sync_run: dict[str, Any]) -> None:
    """The broker's own kafka-console-consumer prints the raw Avro bytes; the .avsc alone decodes them."""
    import subprocess

    from dora_rl.infra.broker.dist import TOOL_JVM_OPTS, ensure_kafka_jars, java_command, tools_log4j2_config

    schema = fastavro.parse_schema(json.loads((codec.SCHEMA_DIR / "trajectory.avsc").read_text()))
    run_id = sync_run["run_id"]
    # find one trajectory of this run (partition, offset) without decoding more than needed
    target = None
    for msg in read_all(bootstrap, topics.in_run(run_id, topics.TRAJECTORIES)):
        if run_id.encode() in (msg.value() or b"") and dict(msg.headers() or []).get(codec.HEADER_SCHEMA) == \
                b"dora.v1.Trajectory":
            target = (msg.partition(), msg.offset(), msg.value())
            break
    assert target is not None
    partition, offset, value = target
    cmd = java_command("org.apache.kafka.tools.consumer.ConsoleConsumer",
                       ["--bootstrap-server", bootstrap, "--topic", topics.in_run(run_id, topics.TRAJECTORIES),
                        "--partition", str(partition), "--offset", str(offset), "--max-messages", "1",
                        "--timeout-ms", "30000"],
                       lib=ensure_kafka_jars(), log4j2_config=tools_log4j2_config(), jvm_opts=TOOL_JVM_OPTS)
    proc = subprocess.run(cmd, capture_output=True, timeout=120, stdin=subprocess.DEVNULL, check=False)
    assert proc.returncode == 0, proc.stderr
    printed: bytes = proc.stdout
    assert printed.endswith(b"\n")
    raw = printed[:-1]
    assert raw == value
    datum = fastavro.schemaless_reader(io.BytesIO(raw), schema, None)
    assert datum["run_id"] == run_id
    assert len(np.frombuffer(datum["response_ids"], "<i4")) == len(np.frombuffer(datum["behaviour_logprobs"], "<f4"))


def test_replay_and_monitor_read_the_recorded_run(bootstrap: str, sync_run: dict[str, Any]) -> None:
    from dora_rl.consumers.monitor import monitor
    from dora_rl.consumers.replay import replay

    buf = io.StringIO()
    n = replay(bootstrap, sync_run["run_id"], topics.SCORED, buf)
    rows = [json.loads(line) for line in buf.getvalue().splitlines()]
    good = [r for r in rows if "error" not in r]
    assert n == len(good) == 48  # the injected garbage is shown as an error row, not counted
    assert len(rows) - len(good) == 1
    assert all(r["reward"] is not None for r in good)
    buf2 = io.StringIO()
    assert replay(bootstrap, sync_run["run_id"], topics.SCORED, buf2, version=1) == \
        sum(1 for r in good if r["policy_version"] == 1) == 16
    view = monitor(bootstrap, sync_run["run_id"], follow=False, idle_s=1.0)
    assert sorted(view.steps) == [0, 1, 2]


def test_instances_switch_versions_over_ucx_without_restarting(bootstrap: str, sync_run: dict[str, Any]) -> None:
    """Every new version reached the (single, never restarted) instance through the UCX channel."""
    from dora_rl.infra.kafka.runs import get_run, read_run
    from dora_rl.schemas.records import Metric, PolicyVersion

    info = get_run(bootstrap, sync_run["run_id"])
    anns = []
    for m in (m for topic in (topics.VERSIONS, topics.HOLDERS)  # the trainer's; the instance's as a holder
              for m in read_run(bootstrap, info, topic)):
        try:
            anns.append(PolicyVersion.decode(m.value(), m.headers()))
        except codec.DecodeError:
            continue  # the garbage injected by this module's dead-letter test
    anns = [a for a in anns if a.run_id == sync_run["run_id"]]
    served = sorted(a.version for a in anns if a.announced_by == PolicyVersion.HOLDER)
    anns = [a for a in anns if a.announced_by == PolicyVersion.TRAINER]
    assert [a.version for a in anns] == [0, 1, 2, 3]
    assert served == [0, 1, 2]  # the instance serves every version it loaded (it is a holder too)
    assert {a.transport for a in anns} == {"ucx"} and all(a.buckets and a.tensors for a in anns)
    switches = [Metric.decode(m.value(), m.headers()) for m in read_run(bootstrap, info, topics.METRICS)]
    switched = sorted(int(m.version or 0) for m in switches
                      if m.run_id == sync_run["run_id"] and m.component == "rollout-0" and m.name == "switch_s")
    assert switched == [0, 1, 2]  # versions 0..2 generated the three steps; one process did it all
