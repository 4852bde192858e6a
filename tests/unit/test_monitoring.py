"""Monitoring without a broker: lag, the Prometheus families, the view model, its renderings, the plot.

Records are the real record classes where the code reads them as such; requests, trajectories and
batches are stand-ins with the few fields the view reads. The Prometheus text is parsed back with
``prometheus_client``'s own parser.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dora_rl.consumers.dashboard.page import render_page
from dora_rl.consumers.dashboard.payload import payload
from dora_rl.consumers.monitor_render import frame, render
from dora_rl.consumers.monitor_view import RunView, lag_by_role, tokens_per_wall_s
from dora_rl.consumers.timeline import Timeline
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.lag import LagProbe, PartitionLag, lag_rows, run_groups
from dora_rl.infra.observability import prom, prom_serve
from dora_rl.schemas.records import DeadLetter, InstanceStatus, Metric, PolicyVersion

RUN = "r1"


def hb(iid: str, version: int, state: str, ts: int, tokens: int = 0, in_flight: int = 0) -> InstanceStatus:
    return InstanceStatus(run_id=RUN, instance_id=iid, instance_index=int(iid[-1]), loaded_version=version,
                          state=state, in_flight=in_flight, capacity=8, generated_tokens=tokens, ts_ms=ts)


def metric(name: str, value: float, ts: int, step: int | None = None, version: int | None = None,
           component: str = "trainer", **labels: str) -> Metric:
    return Metric(run_id=RUN, component=component, name=name, value=value, ts_ms=ts, step=step, version=version,
                  labels=labels)


def batch(step: int, staleness: list[int]) -> Any:
    return SimpleNamespace(train_step=step, max_staleness=2, staleness=lambda: list(staleness))


def families(collector: Any) -> dict[str, list[Any]]:
    reg = CollectorRegistry()
    reg.register(collector)
    text = generate_latest(reg).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


# -- lag -------------------------------------------------------------------------------------------


def test_lag_is_high_minus_position_and_unknowns_have_no_row() -> None:
    rows = lag_rows("g", {("t", 1): 5, ("t", 0): 7, ("t", 2): -1001, ("u", 0): 3}, {("t", 0): 10, ("t", 1): 5,
                                                                                   ("t", 2): 9, ("u", 0): -1})
    assert [(r.partition, r.lag) for r in rows] == [(0, 3), (1, 0)]
    assert PartitionLag("g", "t", 0, 12, 10).lag == 0  # never negative
    assert run_groups(["dora.r1.trainer", "dora.r10.trainer", "dora.r1.rollout-0", "x"], "r1") == \
        ["dora.r1.rollout-0", "dora.r1.trainer"]


def test_a_run_that_ended_has_no_lag() -> None:
    """What came after its roles' last commits (heartbeats, announcements, a commit marker) is not theirs to
    read: ``monitor`` and ``dashboard`` show 0 once the run is FINISHED or FAILED, the lag while it runs."""
    from dora_rl.infra.kafka.lag import for_run_state

    rows = [PartitionLag("dora.r1.orchestrator", "dora.instances", 0, 100, 122), PartitionLag("g", "t", 1, 5, 5)]
    assert [r.lag for r in for_run_state(rows, "STARTED")] == [22, 0]
    for state in ("FINISHED", "FAILED"):
        assert [r.lag for r in for_run_state(rows, state)] == [0, 0]


class FakeConsumer:
    """assignment / position / cached watermarks, like confluent_kafka.Consumer's local calls."""

    def __init__(self, positions: dict[int, int], cached: dict[int, int], closed: bool = False) -> None:
        self.positions, self.cached, self.closed = positions, cached, closed

    def assignment(self) -> list[Any]:
        if self.closed:
            raise RuntimeError("Consumer closed")
        return [SimpleNamespace(topic="t", partition=p, offset=-1001) for p in sorted(self.positions)]

    def position(self, tps: list[Any]) -> list[Any]:
        if self.closed:
            raise RuntimeError("Consumer closed")
        return [SimpleNamespace(topic=tp.topic, partition=tp.partition, offset=self.positions[tp.partition])
                for tp in tps]

    def get_watermark_offsets(self, tp: Any, cached: bool = False) -> tuple[int, int]:
        assert cached, "a scrape never asks the broker through the role's consumer"
        return 0, self.cached.get(tp.partition, -1001)


def test_the_probe_uses_cached_watermarks_and_asks_the_side_reader_for_the_rest() -> None:
    asked: list[int] = []

    def side(tp: Any) -> int:
        asked.append(tp.partition)
        return 20

    consumer, probe = FakeConsumer({0: 4, 1: 6}, {0: 9}), LagProbe("g")
    probe.record(consumer, consumer.assignment())  # type: ignore[arg-type]
    rows = probe.rows(side)
    assert [(r.partition, r.high, r.lag) for r in rows] == [(0, 9, 5), (1, 20, 14)]
    assert asked == [1]


def test_an_unwatched_consumer_is_no_longer_reported() -> None:
    watch = prom.ConsumerWatch()
    a, b = FakeConsumer({0: 1}, {0: 3}), FakeConsumer({0: 1}, {0: 3})
    for c, group in ((a, "g1"), (b, "g2")):
        probe = LagProbe(group)
        probe.record(c, c.assignment())  # type: ignore[arg-type]
        watch.watch(c, probe, "b")
    watch.unwatch(b)
    assert [r.group for r in watch.rows()] == ["g1"] and len(watch.consumers) == 1


# -- Prometheus families ---------------------------------------------------------------------------


def test_trainer_families_are_one_consistent_snapshot() -> None:
    col = prom.RoleCollector()
    col.trainer.metric("trained_tokens", 100.0, 0)
    col.trainer.metric("reward_mean", 0.25, 0)
    col.trainer.batch(0, 2, [0, 0, 1, 2], now_s=10.0)
    col.trainer.metric("trained_tokens", 50.0, 1)
    col.trainer.metric("trained_tokens", 50.0, 1)  # a repeated report of a step counts once
    col.trainer.batch(1, 2, [1, 1, 0, 0], now_s=12.0)
    fams = families(col)
    assert fams["dora_trainer_steps"][0].value == 2
    assert fams["dora_trainer_version"][0].value == 2
    assert fams["dora_trainer_trained_tokens"][0].value == 150
    assert fams["dora_trainer_tokens_per_second"][0].value == pytest.approx(25.0)
    assert fams["dora_trainer_reward_mean"][0].value == 0.25
    assert "dora_trainer_logprob_diff_mean" not in fams  # no such metric seen yet
    col.trainer.metric("logprob_diff_mean", 0.002, 1)
    col.trainer.metric("mfu", 0.31, 1)
    fams = families(col)
    assert fams["dora_trainer_logprob_diff_mean"][0].value == 0.002
    assert fams["dora_trainer_mfu"][0].value == 0.31
    buckets = {s.labels["le"]: s.value for s in fams["dora_trainer_staleness"] if s.name.endswith("_bucket")}
    assert buckets == {"0.0": 4, "1.0": 7, "2.0": 8, "+Inf": 8}
    count = next(s.value for s in fams["dora_trainer_staleness"] if s.name.endswith("_count"))
    assert count == 2 * 4  # steps x TBS


def test_instance_families_and_token_rate() -> None:
    col = prom.RoleCollector()
    col.instances.status(hb("rollout-0", -1, "STARTING", 1000))
    col.instances.status(hb("rollout-0", 3, "BUSY", 1500, tokens=100, in_flight=2))
    col.instances.status(hb("rollout-0", 3, "BUSY", 3000, tokens=400, in_flight=2))
    fams = families(col)
    assert fams["dora_instance_version"][0].value == 3
    assert {s.labels["state"]: s.value for s in fams["dora_instance_state"]} == \
        {"STARTING": 0, "IDLE": 0, "BUSY": 1, "LOADING": 0, "STOPPED": 0}
    assert fams["dora_instance_in_flight"][0].value == 2
    assert fams["dora_instance_generated_tokens"][0].value == 400
    assert fams["dora_instance_tokens_per_second"][0].value == pytest.approx(200.0)  # 400 tokens in 2 s


def test_sent_records_feed_counters_and_the_metric_mirror() -> None:
    def sample(family: str, **labels: str) -> float:
        from prometheus_client import REGISTRY

        return REGISTRY.get_sample_value(family, labels) or 0.0

    before = sample("dora_dead_letters_total", component="scorer", error_type="reward")
    sent = sample("dora_records_sent_total", topic=topics.DLQ)
    prom.record_sent(topics.DLQ, DeadLetter(component="scorer", reason="x", error_type="reward",
                                            source_topic="t", source_partition=0, source_offset=1, ts_ms=1))
    prom.record_sent(topics.METRICS, metric("loss", 0.5, 1, component="test-mirror"))
    prom.record_sent("topic", object())  # anything else is only counted
    assert sample("dora_dead_letters_total", component="scorer", error_type="reward") == before + 1
    assert sample("dora_records_sent_total", topic=topics.DLQ) == sent + 1
    assert sample("dora_metric", component="test-mirror", name="loss") == 0.5


def test_a_failing_hook_never_raises_into_the_role() -> None:
    prom.trained_batch(object())  # no train_step: logged, swallowed


def test_endpoint_configuration(tmp_path: Path) -> None:
    assert not prom_serve.enabled({"DORA_METRICS": "off"}) and prom_serve.enabled({})
    assert prom_serve.requested_port({}) == 0 and prom_serve.requested_port({"DORA_METRICS_PORT": "9100"}) == 9100
    with pytest.raises(ValueError):
        prom_serve.requested_port({"DORA_METRICS_PORT": "70000"})
    ep = prom_serve.MetricsEndpoint("rollout-1", "rollout", RUN, "0.0.0.0", 9100, "10.0.0.5")
    (entry,) = ep.file_sd()
    assert entry["targets"] == ["10.0.0.5:9100"] and ep.url == "http://10.0.0.5:9100/metrics"
    assert entry["labels"]["run_id"] == RUN and entry["labels"]["role"] == "rollout"  # type: ignore[index]


# -- view model, timeline, renderings --------------------------------------------------------------


def test_timeline_merges_heartbeats_and_measures_bubbles() -> None:
    tl = Timeline(gap_ms=5000).observe_all([
        hb("rollout-0", -1, "STARTING", 0), hb("rollout-0", 0, "IDLE", 1000), hb("rollout-0", 0, "BUSY", 2000),
        hb("rollout-0", 0, "BUSY", 3000), hb("rollout-0", 1, "LOADING", 4000), hb("rollout-0", 1, "BUSY", 5000),
        hb("rollout-0", 1, "BUSY", 20000)])  # silent 15 s: a new segment after the gap
    segs = tl.rows()["rollout-0"]
    assert [(s.version, s.state, s.start_ms, s.end_ms) for s in segs] == [
        (-1, "STARTING", 0, 1000), (0, "IDLE", 1000, 2000), (0, "BUSY", 2000, 4000), (1, "LOADING", 4000, 5000),
        (1, "BUSY", 5000, 5000), (1, "BUSY", 20000, 20000)]
    assert tl.idle_fraction("rollout-0") == pytest.approx(2000 / 20000)
    assert tl.span() == (0, 20000)


def view_of_a_run() -> RunView:
    v = RunView(run_id=RUN, mode="dora", state="STARTED", max_staleness=1, steps_target=4)
    rec: list[tuple[str, Any]] = [
        (topics.METRICS, metric("version_published", 0, 1000, version=0)),
        (topics.METRICS, metric("metrics_endpoint", 9100, 900, component="trainer", address="h:9100")),
        (topics.REQUESTS, SimpleNamespace(action="GENERATE", trajectory_id="g1/0", group_id="g1", policy_version=0)),
        (topics.REQUESTS, SimpleNamespace(action="GENERATE", trajectory_id="g1/1", group_id="g1", policy_version=0)),
        (topics.TRAJECTORIES, SimpleNamespace(trajectory_id="g2/0")),  # completion read before its request
        (topics.REQUESTS, SimpleNamespace(action="GENERATE", trajectory_id="g2/0", group_id="g2", policy_version=1)),
        (topics.REQUESTS, SimpleNamespace(action="GENERATE", trajectory_id="g3/0", group_id="g3", policy_version=1)),
        (topics.REQUESTS, SimpleNamespace(action="GENERATE", trajectory_id="g4/0", group_id="g4", policy_version=1)),
        (topics.TRAJECTORIES, SimpleNamespace(trajectory_id="g1/0")),
        (topics.DLQ, DeadLetter(component="scorer", reason="bad", error_type="reward", source_topic="t",
                                source_partition=0, source_offset=0, ts_ms=50_000, run_id=RUN, group_id="g4")),
        (topics.VERSIONS, PolicyVersion(run_id=RUN, version=1, step=1, created_ms=0, transport="tcp", holders=("h",),
                                        total_bytes=0, checksum_algo="x", tensors=(), buckets=(),
                                        announced_by="TRAINER")),
        (topics.INSTANCES, hb("rollout-0", 0, "BUSY", 1000, tokens=0, in_flight=1)),
        (topics.INSTANCES, hb("rollout-0", 0, "BUSY", 4000, tokens=300, in_flight=1)),
        (topics.INSTANCES, hb("rollout-1", 1, "IDLE", 4000)),
        (topics.BATCHES, batch(0, [0, 0, 0, 1])),
        (topics.METRICS, metric("reward_mean", 0.5, 3000, step=0, version=1)),
        (topics.METRICS, metric("trained_tokens", 400, 3000, step=0, version=1)),
        (topics.METRICS, metric("train_s", 0.5, 3000, step=0)),
        (topics.METRICS, metric("staleness_max", 1, 3000, step=0, version=1)),
    ]
    for topic, r in rec:
        v.observe(topic, r)
    v.lag = (PartitionLag(f"dora.{RUN}.trainer", topics.BATCHES, 0, 3, 5),
             PartitionLag(f"dora.{RUN}.scorer", topics.TRAJECTORIES, 0, 1, 1),
             PartitionLag(f"dora.{RUN}.scorer", topics.TRAJECTORIES, 1, 1, 4))
    return v


def test_the_view_model_of_a_run() -> None:
    s = view_of_a_run().snapshot(now_ms=60_000)
    assert s.step_count == 1 and s.reward == 0.5 and s.latest_version == 1
    (row,) = s.steps
    assert row.tokens_per_s == pytest.approx(200.0)  # 400 tokens in the 2 s since version 0
    assert row.staleness_mean == pytest.approx(0.25) and row.staleness_max == 1
    assert s.throughput_tokens_per_s == pytest.approx(200.0)
    by_version = {r.version: r for r in s.versions}
    assert sorted(by_version) == [0, 1]
    assert by_version[0].pending == 1 and by_version[0].instances == ("rollout-0",) and by_version[0].in_flight == 1
    assert by_version[1].pending == 1  # g2/0 done before its request was read, g4 refused
    assert s.staleness_recent == ((0, 3), (1, 1)) and s.recent_batches == 1
    assert s.dlq_total == 1 and s.dlq_per_min == 1.0 and s.dlq_by_reason == (("scorer:reward", 1),)
    assert [(r.role, r.partitions, r.lag) for r in s.lag] == [("scorer", 2, 3), ("trainer", 1, 2)]
    assert dict(s.endpoints) == {"trainer": "h:9100"}
    inst = {i.instance_id: i for i in s.instances}
    assert inst["rollout-0"].tokens_per_s == pytest.approx(100.0) and inst["rollout-1"].state == "IDLE"


def test_lag_by_role_and_wall_throughput_helpers() -> None:
    rows = (PartitionLag("dora.r1.rollout-0", "t", 0, 1, 2),)
    assert lag_by_role(rows, "r1")[0].role == "rollout-0"
    assert tokens_per_wall_s({0: 10.0, 1: 10.0, 2: 10.0}, {0: 2000, 1: 2000, 2: 4000}, 1000) == {0: 10.0, 2: 5.0}


def test_renderings_show_every_section() -> None:
    view = view_of_a_run()
    s = view.snapshot(60_000)
    text = "\n".join(render(s, width=120))
    for needle in ("versions live", "rollout-0", "staleness of the last 1 batches", "scorer", "1/min",
                   "metrics endpoints: trainer=h:9100"):
        assert needle in text, needle
    assert frame(["a"]).startswith("\x1b[H") and frame(["a"]).endswith("\x1b[J")
    doc = payload(s, view.timeline)
    json.dumps(doc)  # plain data
    assert doc["step_count"] == 1 and [r["instance"] for r in doc["timeline"]["rows"]] == ["rollout-0", "rollout-1"]
    assert doc["timeline"]["rows"][0]["segments"] == [[1000, 4000, 0, "BUSY"]]
    page = render_page("dora-rl r1")
    assert 'id="step-count"' in page and "api/run" in page and "timeline-row" in page
    assert "http://" not in page.replace('"http://www.w3.org/2000/svg"', "")  # nothing fetched from elsewhere


def test_the_summary_plot(tmp_path: Path) -> None:
    from dora_rl.consumers.dashboard.plot import draw, step_series

    records = [metric("version_published", 0, 1000, version=0)] + [
        metric(name, val, 1000 + 1000 * (k + 1), step=k) for k in range(3)
        for name, val in (("reward_mean", 0.1 * k), ("trained_tokens", 100), ("staleness_max", k % 2))]
    series = step_series(records, RUN)
    assert series[0]["tokens_per_s"] == pytest.approx(100.0)
    out = tmp_path / "summary.png"
    draw(series, {"run_id": RUN, "mode": "dora", "throughput_tokens_per_s": 100.0,
                  "config": {"max_staleness": 1}}, [out])
    assert out.read_bytes()[:4] == b"\x89PNG"
    draw({}, {"run_id": RUN, "failed": "boom"}, [tmp_path / "empty.png"])  # a run with no step gets a figure too
    assert (tmp_path / "empty.png").exists()


def test_grafana_dashboard_and_alert_rules_name_only_exported_families() -> None:
    import re

    import yaml
    from prometheus_client import REGISTRY

    root = Path(__file__).resolve().parents[2] / "infra" / "observability" / "grafana"
    dashboard = json.loads((root / "dora-dashboard.json").read_text())
    rules = yaml.safe_load((root / "dora-alerts.yml").read_text())
    assert yaml.safe_load((root / "prometheus.yml").read_text())["rule_files"] == ["dora-alerts.yml"]
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [r["expr"] for g in rules["groups"] for r in g["rules"]]
    col = prom.RoleCollector()
    col.trainer.metric("trained_tokens", 1.0, 0)
    col.trainer.metric("reward_mean", 1.0, 0)
    col.trainer.batch(0, 1, [0], 1.0)
    col.trainer.batch(1, 1, [1], 2.0)
    col.instances.status(hb("rollout-0", 0, "BUSY", 0))
    col.instances.status(hb("rollout-0", 0, "BUSY", 2000))
    exported = {s.name for fam in families(col).values() for s in fam}
    exported |= {s.name for fam in prom.lag_families([PartitionLag("g", "t", 0, 0, 1)]) for s in fam.samples}
    exported |= {s.name for fam in REGISTRY.collect() for s in fam.samples}  # process_start_time_seconds, ...
    for metric_object in (prom.RECORDS_SENT, prom.DEAD_LETTERS, prom.METRIC, prom.ROLE_INFO):
        for fam in metric_object.describe():
            exported |= {fam.name + "_total"} if fam.type == "counter" else {fam.name}
    named = {n for e in exprs for n in re.findall(r"\bdora_[a-z_]+", e)}
    assert named and named <= exported, sorted(named - exported)
    assert {r["alert"] for g in rules["groups"] for r in g["rules"]} >= {"DoraRunStalled", "DoraDeadLetterRate",
                                                                           "DoraConsumerLag"}


def test_a_scrape_never_calls_the_consumer() -> None:
    """From a scrape's thread a call on the role's consumer waits for the owner's ``consume`` (confluent-kafka
    serialises them): every scrape of a trainer waiting for batches hung (measured with the assembler stopped).
    The scrape reads what the owner recorded after its last poll instead."""
    class Busy(FakeConsumer):
        calls = 0

        def position(self, tps: list[Any]) -> list[Any]:
            Busy.calls += 1
            return super().position(tps)

    watch, consumer, probe = prom.ConsumerWatch(), Busy({0: 2, 1: 5}, {0: 4, 1: 5}), LagProbe("g")
    watch.watch(consumer, probe, "b")
    assert watch.rows() == []  # nothing recorded yet
    probe.record(consumer, consumer.assignment())  # type: ignore[arg-type]  # the owner, after a poll
    calls = Busy.calls
    assert [(r.partition, r.lag) for r in watch.rows()] == [(0, 2), (1, 0)]
    assert Busy.calls == calls  # the scrape itself called nothing on the consumer
