"""Kill -9 each role once during a real run (real broker, dora mode): the run finishes and audits clean.

``dora-rl run`` supervises its roles; every role restores from the run's topics (and the trainer
from the checkpoint its last announcement names). The kills hit the orchestrator, trainer, batch
assembler, scorer and a rollout instance, each after the previous one's restart made progress.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import emulated_run, launch_run
from run_helpers import steps_done as _steps_done
from run_helpers import wait_for as _wait

pytestmark = pytest.mark.broker

CONFIG = emulated_run(steps=16, instance_concurrency=32, seed=5)
VICTIMS = ("orchestrator", "trainer", "assembler", "scorer-0", "rollout-1")


def test_every_role_killed_once_and_the_run_completes(bootstrap: str, dora_home: Path, tmp_path: Path) -> None:
    from dora_rl.consumers.audit import audit_run

    out = tmp_path / "summary.json"
    launcher, rdir = launch_run(bootstrap, dora_home, tmp_path, CONFIG, out)
    try:
        run_id = rdir.name
        for i, victim in enumerate(VICTIMS):  # one kill every two steps, each after the previous restart
            _wait(lambda at=1 + 2 * i: _steps_done(bootstrap, run_id) >= at, 180, f"step {1 + 2 * i}")
            pid = json.loads((rdir / "pids.json").read_text())[victim]
            os.kill(pid, signal.SIGKILL)
            _wait(lambda v=victim, p=pid: json.loads((rdir / "pids.json").read_text())[v] != p, 60,
                  f"{victim} to be restarted")
        code = launcher.wait(timeout=600)
        log = launcher.stdout.read().decode() if launcher.stdout else ""
        assert code == 0, log[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
    summary = json.loads(out.read_text())
    assert summary["steps"] == CONFIG["steps"]
    assert set(summary["restarts"]) == set(VICTIMS), summary["restarts"]
    report = audit_run(bootstrap, run_id)
    assert report.ok, report.render()
    assert report.trajectories_batched == CONFIG["steps"] * CONFIG["train_batch_size"]
    assert report.max_staleness_seen <= CONFIG["max_staleness"]


def test_resume_after_the_launcher_itself_is_killed(bootstrap: str, dora_home: Path, tmp_path: Path) -> None:
    from dora_rl.consumers.audit import audit_run

    config = {**CONFIG, "steps": 8, "seed": 6}
    launcher, rdir = launch_run(bootstrap, dora_home, tmp_path, config, output=subprocess.DEVNULL)
    _wait(lambda: _steps_done(bootstrap, rdir.name) >= 2, 180, "two steps")
    launcher.kill()  # SIGKILL: its roles keep running as orphans
    launcher.wait()
    orphans = list(json.loads((rdir / "pids.json").read_text()).values())
    alive = [p for p in orphans if Path(f"/proc/{p}").exists()]
    assert alive, "the launcher's roles should outlive it"
    out = tmp_path / "resumed.json"
    resumed = subprocess.run([sys.executable, "-m", "dora_rl", "resume", rdir.name, "--bootstrap-servers",
                              bootstrap, "--json", str(out), "--quiet"], capture_output=True, text=True,
                             timeout=600, env=dict(os.environ))
    assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    assert "orphan role(s) of the previous launcher" in resumed.stderr, resumed.stderr[-2000:]
    assert not [p for p in alive if Path(f"/proc/{p}").exists() and b"dora_rl" in Path(f"/proc/{p}/cmdline")
                .read_bytes()], "orphans survived the resume"
    assert json.loads(out.read_text())["steps"] == config["steps"]
    report = audit_run(bootstrap, rdir.name)
    assert report.ok, report.render()


def test_resume_after_retention_deleted_what_the_run_needs_fails_with_that_reason(
        bootstrap: str, dora_home: Path) -> None:
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    from dora_rl.config import DoraConfig
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.io import RecordProducer
    from dora_rl.infra.kafka.runs import retention_gaps, start_run

    info = start_run(bootstrap, DoraConfig.from_dict({**CONFIG, "steps": 2}))
    producer = RecordProducer(bootstrap, "retention-test")
    prompts = topics.in_run(info.run_id, topics.PROMPTS)
    for i in range(3):  # records of the run that nothing has consumed yet
        producer.send_raw(prompts, b"prompt bytes", f"v-/{info.run_id}/p{i}".encode(), partition=0)
    producer.flush()
    assert retention_gaps(bootstrap, info) == [], "nothing deleted yet: the check must not fire"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    high = next(o.offset for o in info.start_offsets if (o.topic, o.partition) == (prompts, 0)) + 3
    for fut in admin.delete_records([TopicPartition(prompts, 0, high)]).values():
        fut.result()  # what retention does: the partition now starts after the run's prompts
    res = subprocess.run([sys.executable, "-m", "dora_rl", "resume", info.run_id, "--bootstrap-servers", bootstrap],
                         capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert res.returncode == 3, res.stdout[-1000:] + res.stderr[-2000:]
    assert f"run {info.run_id} cannot be resumed: retention deleted records" in res.stderr
    assert f"{prompts}[0]: the run needs records from offset {high - 3}" in res.stderr
    assert not (dora_home / "runs" / info.run_id / "pids.json").exists(), "nothing may start"



SHORT_RETENTION = {"log.retention.ms": 10_000, "log.segment.ms": 3_000, "log.retention.check.interval.ms": 2_000,
                   "offsets.retention.minutes": 1, "offsets.retention.check.interval.ms": 2_000}
"""A broker whose defaults forget fast: records after 10 s (the run's topics declare their own retention, so
theirs stay), idle groups' committed offsets 1 minute after their last commit."""


def test_a_run_outlives_short_retention_and_resumes_after_its_offsets_expired(dora_home: Path, tmp_path: Path) -> None:
    """On a broker with short retention and offset expiry: a run lasts longer than both, is killed whole (roles
    and launcher), sits until its groups' offsets have expired, and is resumed. The processors restart from the
    positions their snapshots committed (decision 0055), not the run's start; the run finishes and the audit
    (with the run's token) passes with exactly steps x TBS trajectories batched, none twice."""
    import time

    from confluent_kafka import ConsumerGroupTopicPartitions
    from confluent_kafka.admin import AdminClient

    from dora_rl.consumers.audit import audit_run
    from dora_rl.infra.broker.server import LocalBroker
    from dora_rl.infra.kafka.topic_admin import ensure_topics

    broker = LocalBroker(tmp_path / "broker", port=0, config=SHORT_RETENTION).start()
    try:
        bootstrap = broker.bootstrap_servers
        admin = AdminClient({"bootstrap.servers": bootstrap})
        ensure_topics(admin, 4)
        config = {**CONFIG, "steps": 8, "seed": 7, "emulated": {**CONFIG["emulated"], "base_step_s": 0.08}}
        t0 = time.monotonic()
        launcher, rdir = launch_run(bootstrap, dora_home, tmp_path, config, output=subprocess.DEVNULL)
        run_id = rdir.name
        try:
            _wait(lambda: time.monotonic() - t0 > 14 and _steps_done(bootstrap, run_id) >= 2, 240,
                  "a run older than the broker's record retention")
            done = _steps_done(bootstrap, run_id)
            print(f"killed at step {done} of {config['steps']}, {time.monotonic() - t0:.0f} s in", flush=True)
            assert done < config["steps"], "the run ended before it could be killed"
        finally:
            launcher.kill()
            launcher.wait()
            for pid in json.loads((rdir / "pids.json").read_text()).values():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        processors = [f"dora.{run_id}.{name}" for name in ("orchestrator", "assembler")]

        def expired() -> bool:
            for g in processors:  # one group per request (the client's limit)
                res = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(g)])
                if any(tp.offset >= 0 for f in res.values() for tp in f.result().topic_partitions or []):
                    return False
            return True

        _wait(expired, 150, "the processors' committed offsets to expire")
        out = tmp_path / "resumed.json"
        resumed = subprocess.run([sys.executable, "-m", "dora_rl", "resume", run_id, "--bootstrap-servers", bootstrap,
                                  "--json", str(out), "--quiet"], capture_output=True, text=True, timeout=600,
                                 env=dict(os.environ))
        assert resumed.returncode == 0, resumed.stdout[-2000:] + resumed.stderr[-2000:]
        assert json.loads(out.read_text())["steps"] == config["steps"]
        logs = "".join(p.read_text(errors="replace") for p in (rdir / "logs").glob("*.log"))
        assert "resuming them from snapshot" in logs, "no processor resumed from its snapshot's positions"
        report = audit_run(bootstrap, run_id, (rdir / "weight-token").read_text().strip())
        assert report.ok, report.render()
        assert report.trajectories_batched == config["steps"] * config["train_batch_size"]
    finally:
        broker.stop()
