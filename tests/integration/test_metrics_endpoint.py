"""The roles' Prometheus endpoints, scraped during a live run (real broker, dora mode, emulated engine).

The trainer's and a rollout instance's ``/metrics`` are found through the endpoint files the roles
write (``$DORA_HOME/metrics-endpoints/<run>.<name>.json``, Prometheus ``file_sd`` format) and
scraped while the run is going, by this test and by a real Prometheus (Debian's, started on the shipped
``infra/observability/grafana/prometheus.yml`` copied into ``$DORA_HOME``, after ``promtool`` checked it): both report
consumer lag on their own topic-partitions, the instance
its held version and state, and the trainer a staleness histogram whose counts, per bucket, are exactly
what the audit counts over the same batches. The run ends with its plot beside each ``summary.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from run_helpers import emulated_run, wait_for

pytestmark = pytest.mark.broker

CONFIG = emulated_run(steps=10, seed=21, emulated={"base_step_s": 0.04})


def scrape(address: str) -> dict[str, list[Any]]:
    """Family name -> its samples (``prometheus_client``'s parser: the format is Prometheus's own)."""
    from prometheus_client.parser import text_string_to_metric_families

    # 30 s: on 2 saturated CI cores a scrape once waited over 5 s for a trainer mid-step (the HTTP thread
    # shares the role's GIL); Prometheus's own default scrape timeout is 10 s
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def endpoint(run_id: str, name: str) -> str:
    from dora_rl.infra.observability.prom_serve import endpoint_file

    return str(json.loads(endpoint_file(run_id, name).read_text())[0]["targets"][0])


def start_prometheus(dora_home: Path, tmp_path: Path) -> tuple[subprocess.Popen[bytes], str] | None:
    """Debian's Prometheus on the shipped config, copied into ``dora_home`` (its relative paths resolve there),
    after ``promtool`` checked it; None where Prometheus is not installed (a failure under ``CI=true``)."""
    if shutil.which("prometheus") is None or shutil.which("promtool") is None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail("prometheus is required in CI (make setup-prometheus installs Debian's)")
        return None
    grafana = Path(__file__).resolve().parents[2] / "infra" / "observability" / "grafana"
    for name in ("prometheus.yml", "dora-alerts.yml"):
        shutil.copy(grafana / name, dora_home / name)
    check = subprocess.run(["promtool", "check", "config", str(dora_home / "prometheus.yml")], capture_output=True,
                           text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen(["prometheus", f"--config.file={dora_home / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def prometheus_value(url: str, query: str) -> float | None:
    """The first value of instant ``query`` on the Prometheus at ``url`` (None: no result yet)."""
    try:
        with urllib.request.urlopen(f"{url}/api/v1/query?query={urllib.parse.quote(query)}", timeout=10) as r:
            result = json.loads(r.read())["data"]["result"]
    except OSError:
        return None
    return float(result[0]["value"][1]) if result else None


def value(fams: dict[str, list[Any]], family: str, sample: str | None = None, **labels: str) -> float | None:
    for s in fams.get(family, []):
        if (sample is None or s.name == sample) and all(s.labels.get(k) == v for k, v in labels.items()):
            return float(s.value)
    return None


def kafka_tool_lag(bootstrap: str, groups: list[str]) -> dict[tuple[str, str, int], tuple[int, int, int]]:
    """(group, topic, partition) -> (current offset, log end offset, lag), as ``kafka-consumer-groups
    --describe`` prints them (partitions without a committed offset left out)."""
    from dora_rl.infra.broker.dist import run_kafka_tool

    args = ["--bootstrap-server", bootstrap, "--describe"] + [a for g in groups for a in ("--group", g)]
    out = run_kafka_tool("kafka-consumer-groups", args, timeout=120, check=True).stdout
    rows = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 6 and f[0] in groups and f[2].isdigit() and f[3].isdigit():
            rows[(f[0], f[1], int(f[2]))] = (int(f[3]), int(f[4]), int(f[5]))
    return rows


def assert_lag_is_kafka_tools(bootstrap: str, run_id: str) -> None:
    """The run's committed lag (``lag.committed_lag``, what ``monitor`` and the dashboard read) row for row
    equal to Kafka's tool; retried when another test's writes moved a shared partition in between."""
    from dora_rl.infra.kafka.lag import committed_lag

    def ours() -> dict[tuple[str, str, int], tuple[int, int, int]]:
        return {(r.group, r.topic, r.partition): (r.position, r.high, r.lag) for r in committed_lag(bootstrap, run_id)}

    for _ in range(3):
        before = ours()
        theirs = kafka_tool_lag(bootstrap, sorted({g for g, _, _ in before}))
        if before == theirs:
            assert len(before) >= 5, before  # the run's groups on their partitions: a real comparison
            return
        if ours() == before:  # nothing moved meanwhile: a real disagreement
            break
    assert before == theirs, {k: (before.get(k), theirs.get(k)) for k in set(before) | set(theirs)
                              if before.get(k) != theirs.get(k)}


def trails_by_markers_only(bootstrap: str, batches: str, live: tuple[Any, ...], tool: tuple[int, int, int]) -> bool:
    """The trainer's position is at the end and the group's committed offset trails it by offsets that hold
    no committed record: transaction markers, which the trainer's poll steps over after it committed its
    offset inside its transaction (Kafka's tool then counts the marker as lag 1; the live lag is 0)."""
    from confluent_kafka import Consumer, TopicPartition

    from dora_rl.infra.kafka.read import read_range, reader_config

    position, high, committed = live[0], live[1], tool[0]
    if position is None or high is None or not (position == high == tool[1] and committed < position):
        return False
    consumer = Consumer(reader_config(bootstrap, f"markers-{time.time_ns()}"))
    try:
        gap = read_range(consumer, TopicPartition(batches, 0), committed, int(position))
    finally:
        consumer.close()
    return not gap


def live_lag_is_kafka_tools(bootstrap: str, run_id: str, rdir: Path, trainer: str) -> None:
    """Prometheus's live lag and Kafka's tool at one quiet moment: with the assembler (the only writer of
    ``dora.train.batches``) stopped, the trainer reads every batch and commits it; then the position and high
    watermark its endpoint reports on that partition are the tool's CURRENT-OFFSET and LOG-END-OFFSET, and
    both lags are equal. A stop that lands inside the assembler's transaction (its records not yet stable,
    so the two ends differ by design) is let go and taken again."""
    from dora_rl.infra.kafka import topics

    batches = topics.in_run(run_id, topics.BATCHES)
    group, key = f"dora.{run_id}.trainer", {"topic": batches, "partition": "0"}
    assembler = int(json.loads((rdir / "pids.json").read_text())["assembler"])
    seen: list[Any] = []
    for _ in range(3):
        os.kill(assembler, signal.SIGSTOP)
        try:
            for _ in range(8):
                fams = scrape(trainer)
                live = tuple(value(fams, f, group=group, **key) for f in
                             ("dora_consumer_position", "dora_consumer_high_watermark", "dora_consumer_lag_records"))
                tool = kafka_tool_lag(bootstrap, [group]).get((group, batches, 0))
                seen.append((live, tool))
                if tool is not None and live == tuple(float(x) for x in tool):
                    return
                if tool is not None and trails_by_markers_only(bootstrap, batches, live, tool):
                    return
                time.sleep(1.0)
        finally:
            os.kill(assembler, signal.SIGCONT)
        time.sleep(2.0)
    raise AssertionError(f"the trainer's (position, high, lag) never equalled the tool's: {seen[-4:]}")


def test_trainer_and_rollout_endpoints_during_a_run(bootstrap: str, dora_home: Path, tmp_path: Path) -> None:
    from dora_rl.config import DoraConfig
    from dora_rl.consumers.audit import audit_records, audit_run
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.runs import get_run, read_run
    from dora_rl.schemas.records import TrainBatch

    cfg, out = tmp_path / "config.json", tmp_path / "summary.json"
    cfg.write_text(json.dumps(CONFIG))
    runs = dora_home / "runs"
    known = {d.name for d in runs.iterdir()} if runs.exists() else set()
    prometheus = start_prometheus(dora_home, tmp_path)
    env = {k: v for k, v in os.environ.items() if k not in ("DORA_METRICS", "DORA_METRICS_PORT")}
    launcher = subprocess.Popen([sys.executable, "-m", "dora_rl", "run", "--bootstrap-servers", bootstrap,
                                 "--config", str(cfg), "--json", str(out), "--quiet"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env)
    try:
        from dora_rl.infra.observability.prom_serve import endpoint_file

        def new_run() -> str | None:
            fresh = [d.name for d in runs.iterdir() if d.name not in known] if runs.exists() else []
            return next((r for r in fresh if endpoint_file(r, "trainer").exists()), None)
        wait_for(lambda: new_run() is not None, 120, "the trainer's endpoint file")
        run_id = str(new_run())
        rdir = runs / run_id
        wait_for(lambda: endpoint_file(run_id, "rollout-0").exists(), 60, "rollout-0's endpoint")
        trainer, rollout = endpoint(run_id, "trainer"), endpoint(run_id, "rollout-0")

        # the trainer, mid-run: a scrape is one consistent snapshot (steps x TBS == histogram count)
        seen: dict[str, list[Any]] = {}

        def trained_some() -> bool:
            nonlocal seen
            seen = scrape(trainer)
            steps = value(seen, "dora_trainer_steps", "dora_trainer_steps_total") or 0
            return steps >= 2
        wait_for(trained_some, 180, "two trained steps on the trainer's endpoint")
        assert launcher.poll() is None, "the run ended before the scrape: not a live scrape"
        steps_scraped = int(value(seen, "dora_trainer_steps", "dora_trainer_steps_total") or 0)
        assert steps_scraped < CONFIG["steps"]
        count = value(seen, "dora_trainer_staleness", "dora_trainer_staleness_count")
        assert count == steps_scraped * CONFIG["train_batch_size"]
        cumulative = {int(float(s.labels["le"])): s.value for s in seen["dora_trainer_staleness"]
                      if s.name == "dora_trainer_staleness_bucket" and s.labels["le"] != "+Inf"}
        assert sorted(cumulative) == list(range(CONFIG["max_staleness"] + 1))  # buckets 0..S
        lag = value(seen, "dora_consumer_lag_records", group=f"dora.{run_id}.trainer",
                    topic=topics.in_run(run_id, topics.BATCHES), partition="0")
        assert lag is not None and lag >= 0, seen.get("dora_consumer_lag_records")
        assert (value(seen, "dora_consumer_high_watermark", topic=topics.in_run(run_id, topics.BATCHES)) or 0) > 0
        assert value(seen, "dora_trainer_reward_mean") is not None
        assert (value(seen, "dora_trainer_trained_tokens", "dora_trainer_trained_tokens_total") or 0) > 0

        assert launcher.poll() is None, "the run ended before the freeze"
        live_lag_is_kafka_tools(bootstrap, run_id, rdir, trainer)

        # a rollout instance: lag on its request partition, its version, state and work
        inst = scrape(rollout)
        lag = value(inst, "dora_consumer_lag_records", group=f"dora.{run_id}.rollout-0",
                    topic=topics.in_run(run_id, topics.REQUESTS), partition="0")
        assert lag is not None and lag >= 0, inst.get("dora_consumer_lag_records")
        assert (value(inst, "dora_instance_version", instance_id="rollout-0") or -1) >= 0
        states = {s.labels["state"]: s.value for s in inst["dora_instance_state"]}
        assert sum(states.values()) == 1, states
        assert (value(inst, "dora_records_sent", "dora_records_sent_total", topic=topics.TRAJECTORIES) or 0) > 0
        assert value(inst, "dora_role_info", run_id=run_id, role="rollout", name="rollout-0") == 1

        if prometheus is not None:  # the shipped config found both roles through their files and scrapes them
            url = prometheus[1]
            for role in ("trainer", "rollout"):
                wait_for(lambda r=role: prometheus_value(url, f'up{{job="dora",run_id="{run_id}",role="{r}"}}') == 1,
                         60, f"Prometheus scraping the {role}")
            wait_for(lambda: (prometheus_value(url, f'dora_trainer_steps_total{{run_id="{run_id}"}}') or 0) >= 1,
                     60, "the trainer's steps in Prometheus")

        code = launcher.wait(timeout=300)
        log = launcher.stdout.read().decode() if launcher.stdout else ""
        assert code == 0, log[-3000:]
    finally:
        if launcher.poll() is None:  # a failure before the end: stop the run as a user would (no orphan roles)
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.wait(timeout=60)
            except subprocess.TimeoutExpired:
                launcher.kill()
        if prometheus is not None:
            prometheus[0].kill()
            prometheus[0].wait()

    # the histogram agrees with the audit over the same batches (the first `steps_scraped` steps)
    info = get_run(bootstrap, run_id)
    config = DoraConfig.from_json(info.config_json)
    batches: dict[int, TrainBatch] = {}
    for msg in read_run(bootstrap, info, topics.BATCHES):
        b = TrainBatch.decode(msg.value(), msg.headers())
        if b.run_id == run_id:
            batches.setdefault(int(b.train_step), b)
    prefix = [b for k, b in sorted(batches.items()) if k < steps_scraped]
    audited = audit_records(run_id, config, [], [], prefix).staleness_histogram
    per_bucket = {s: cumulative[s] - cumulative.get(s - 1, 0) for s in cumulative}
    assert {s: n for s, n in per_bucket.items() if n} == {s: n for s, n in audited.items() if n}
    full = audit_run(bootstrap, run_id)
    assert full.verdict == "PASS", full.render()
    assert all(full.staleness_histogram.get(s, 0) >= n for s, n in per_bucket.items())

    # one definition of lag: every group of the run, from its committed offsets, is what Kafka's own
    # consumer-group tool reports (the run ended, so nothing moves); the monitor and the dashboard, which
    # read the same feed, show 0 for the finished run
    assert_lag_is_kafka_tools(bootstrap, run_id)
    from dora_rl.consumers.monitor_feed import RunFeed
    from dora_rl.consumers.monitor_view import lag_by_role

    feed = RunFeed(bootstrap, run_id, "monitor", lag_every_s=0)
    try:
        feed.refresh()
        assert feed.view.state == "FINISHED" and feed.view.lag, (feed.view.state, feed.view.lag)
        assert [r.lag for r in lag_by_role(feed.view.lag, run_id)] == [0] * len(lag_by_role(feed.view.lag, run_id))
    finally:
        feed.close()

    # every run ends with its plot, beside both summaries
    assert (rdir / "summary.png").stat().st_size > 10_000
    assert out.with_suffix(".png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not endpoint_file(run_id, "trainer").exists()  # removed when the role exited

