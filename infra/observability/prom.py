"""Prometheus metrics of a role process: the families, the state behind them, and the hooks roles call.

Every family is prefixed ``dora_``; the endpoint that serves them is :mod:`dora_rl.infra.observability.prom_serve`.

Any process that produces or consumes through :mod:`dora_rl.infra.kafka.io` (every role), once its endpoint
serves (:mod:`dora_rl.infra.kafka.events` reports the clients to this module):

- ``dora_consumer_lag_records{group,topic,partition}`` (gauge): ``max(0, high - position)`` of each
  partition a watched consumer holds (:mod:`dora_rl.infra.kafka.lag`), as its owner last recorded it; also
  ``dora_consumer_position`` and ``dora_consumer_high_watermark`` with the same labels.
- ``dora_records_sent_total{topic}`` (counter): records queued for each topic (throughput of outputs).
- ``dora_dead_letters_total{component,error_type}`` (counter): refusals written to ``dora.dlq``.
- ``dora_metric{component,name}`` (gauge): the last value of every ``Metric`` record the process wrote.

Trainer (:func:`trained_batch`, once per trained batch, after its transaction committed):

- ``dora_trainer_steps_total``, ``dora_trainer_trajectories_total`` (counters), ``dora_trainer_version``
  (gauge: the version the last update published, ``train_step + 1``),
  ``dora_trainer_last_step_timestamp_seconds`` (gauge: Unix time of the last trained batch; a stalled
  run is one whose trainer is up and this is old, ``infra/observability/grafana/dora-alerts.yml``);
- ``dora_trainer_staleness`` (histogram, buckets ``le = 0, 1, …, S`` and ``+Inf``): one observation per
  trained trajectory, ``version_of_update - trajectory_version`` with ``version_of_update`` the batch's
  base version (the rule of :mod:`dora_rl.core.staleness`); bucket ``le = s`` counts ``staleness <= s``;
- from the trainer's own step metrics: ``dora_trainer_reward_mean`` (gauge, last step),
  ``dora_trainer_trained_tokens_total`` (counter), ``dora_trainer_tokens_per_second`` (gauge: the last
  step's ``trained_tokens`` over the wall seconds since the step before it was trained).

Rollout instance (from each ``InstanceStatus`` heartbeat it writes), label ``instance_id``:
``dora_instance_version`` (held version, -1 none), ``dora_instance_state{state}`` (1 for the current
state, 0 for the others), ``dora_instance_in_flight``, ``dora_instance_capacity``,
``dora_instance_generated_tokens_total``, ``dora_instance_busy_seconds_total`` and
``dora_instance_tokens_per_second`` (generated tokens between the last two heartbeats at least 1 s apart).

Invariants: one scrape is one consistent snapshot of each family group (the trainer's step count equals
its histogram's count divided by TBS); a hook never raises into the role (a metrics failure is logged
once, never stops training); a scrape never calls a role's consumer (it reads the
:class:`~dora_rl.infra.kafka.lag.LagProbe` the owner records after each poll: a call from the scrape's thread
waits for the owner's ``consume``), and a consumer is unwatched under the scrape lock before it closes
(:func:`release_consumer`).
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import Counter as Tally
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

from prometheus_client import REGISTRY, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.lag import HighWatermarks, LagProbe, PartitionLag
from dora_rl.schemas.records import DeadLetter, InstanceStatus
from dora_rl.schemas.records import Metric as MetricRecord

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])
INSTANCE_STATES = ("STARTING", "IDLE", "BUSY", "LOADING", "STOPPED")

RECORDS_SENT = Counter("dora_records_sent", "Records queued for each topic", ["topic"])
DEAD_LETTERS = Counter("dora_dead_letters", "Refusals written to dora.dlq", ["component", "error_type"])
METRIC = Gauge("dora_metric", "Last value of each Metric record this process wrote", ["component", "name"])
ROLE_INFO = Gauge("dora_role_info", "The role this process runs (always 1)", ["run_id", "role", "name"])


def _never_raises(fn: F) -> F:
    """A hook: any exception is logged (once per hook) and swallowed, so metrics never stop a role."""
    failed: list[bool] = []

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception:
            if not failed:
                failed.append(True)
                log.exception("metrics hook %s failed (further failures are not logged)", fn.__name__)
            return None

    return wrapper  # type: ignore[return-value]


# -- trainer -------------------------------------------------------------------------------------


STEP_GAUGES: dict[str, str] = {
    "logprob_diff_mean": "Last step: mean |trainer - behaviour log-prob| over fresh tokens (train-inference mismatch)",
    "logprob_diff_max": "Last step: max |trainer - behaviour log-prob| over fresh tokens",
    "tis_weight_mean": "Last step: mean truncated importance weight (decoupled PPO)",
    "update_tokens_per_s": "Last step: prompt + response tokens computed per second of the update",
    "mfu": "Last step: model FLOPs utilisation of the update (6 * params * tokens / s / device peak)",
}
"""Trainer step metrics exported as gauges ``dora_trainer_<name>`` (name -> help)."""


@dataclass
class TrainerState:
    """What the trainer's families show; pure (fed by :func:`trained_batch` and its step metrics)."""

    steps: int = 0
    version: int = 0
    max_staleness: int = 0
    staleness: Tally[int] = field(default_factory=Tally)
    reward_mean: float | None = None
    trained_tokens: float = 0.0
    tokens_per_s: float | None = None
    last_step_s: float | None = None
    gauges: dict[str, float] = field(default_factory=dict)
    """The last step's value of each metric of :data:`STEP_GAUGES` seen."""
    _step_tokens: dict[int, float] = field(default_factory=dict)
    _last_batch_s: float | None = None

    def batch(self, train_step: int, max_staleness: int, staleness: Iterable[int], now_s: float) -> None:
        """One trained batch (its metrics already seen): its per-trajectory staleness
        (``base_version - trajectory_version``); ``now_s`` the Unix time it was trained."""
        self.last_step_s = now_s
        self.steps += 1
        self.version = max(self.version, train_step + 1)
        self.max_staleness = max(self.max_staleness, max_staleness)
        self.staleness.update(int(s) for s in staleness)
        tokens = self._step_tokens.pop(train_step, None)
        if tokens is not None and self._last_batch_s is not None and now_s > self._last_batch_s:
            self.tokens_per_s = tokens / (now_s - self._last_batch_s)
        self._last_batch_s = now_s

    def metric(self, name: str, value: float, step: int | None) -> None:
        """One of the trainer's step metrics (``reward_mean``, ``trained_tokens`` are used)."""
        if step is None:
            return
        if name in STEP_GAUGES:
            self.gauges[name] = value
        if name == "reward_mean":
            self.reward_mean = value
        elif name == "trained_tokens" and step not in self._step_tokens:
            self.trained_tokens += value
            self._step_tokens[step] = value

    def buckets(self) -> list[tuple[str, float]]:
        """Cumulative histogram buckets ``le = 0..S`` and ``+Inf``."""
        out, total = [], 0
        for s in range(self.max_staleness + 1):
            total += self.staleness.get(s, 0)
            out.append((floatToGoString(s), float(total)))
        out.append(("+Inf", float(sum(self.staleness.values()))))
        return out

    def families(self) -> list[Metric]:
        if self.steps == 0 and not self.trained_tokens:
            return []
        hist = HistogramMetricFamily("dora_trainer_staleness", "Staleness of each trained trajectory "
                                     "(base version of its update - its version)")
        hist.add_metric([], self.buckets(), sum_value=float(sum(s * n for s, n in self.staleness.items())))
        out: list[Metric] = [
            CounterMetricFamily("dora_trainer_steps", "Train steps done", value=self.steps),
            CounterMetricFamily("dora_trainer_trajectories", "Trajectories trained",
                                value=sum(self.staleness.values())),
            GaugeMetricFamily("dora_trainer_version", "Version published by the last update", value=self.version),
            CounterMetricFamily("dora_trainer_trained_tokens", "Response tokens trained", value=self.trained_tokens),
            hist]
        if self.last_step_s is not None:
            out.append(GaugeMetricFamily("dora_trainer_last_step_timestamp_seconds", "Unix time of the last step",
                                         value=self.last_step_s))
        if self.reward_mean is not None:
            out.append(GaugeMetricFamily("dora_trainer_reward_mean", "Mean reward of the last step's batch",
                                         value=self.reward_mean))
        if self.tokens_per_s is not None:
            out.append(GaugeMetricFamily("dora_trainer_tokens_per_second",
                                         "Last step's trained tokens / wall seconds since the step before",
                                         value=self.tokens_per_s))
        out.extend(GaugeMetricFamily(f"dora_trainer_{name}", STEP_GAUGES[name], value=value)
                   for name, value in sorted(self.gauges.items()))
        return out


# -- rollout instance ----------------------------------------------------------------------------


@dataclass
class InstanceState:
    """The last heartbeat of each rollout instance of this process, and its token rate; pure."""

    last: dict[str, InstanceStatus] = field(default_factory=dict)
    rate: dict[str, float] = field(default_factory=dict)
    _mark: dict[str, tuple[int, int]] = field(default_factory=dict)  # instance -> (ts_ms, tokens) of the rate

    def status(self, st: InstanceStatus) -> None:
        self.last[st.instance_id] = st
        ts, tokens = self._mark.get(st.instance_id, (st.ts_ms, int(st.generated_tokens)))
        if st.ts_ms - ts >= 1000:
            self.rate[st.instance_id] = (int(st.generated_tokens) - tokens) / ((st.ts_ms - ts) / 1000)
            ts, tokens = st.ts_ms, int(st.generated_tokens)
        self._mark[st.instance_id] = (ts, tokens)

    def families(self) -> list[Metric]:
        if not self.last:
            return []
        lab = ["instance_id"]
        version = GaugeMetricFamily("dora_instance_version", "Version the instance holds (-1: none)", labels=lab)
        state = GaugeMetricFamily("dora_instance_state", "1 for the instance's state", labels=[*lab, "state"])
        in_flight = GaugeMetricFamily("dora_instance_in_flight", "Trajectories being generated", labels=lab)
        capacity = GaugeMetricFamily("dora_instance_capacity", "Trajectories it generates at once", labels=lab)
        tokens = CounterMetricFamily("dora_instance_generated_tokens", "Tokens generated", labels=lab)
        busy = CounterMetricFamily("dora_instance_busy_seconds", "Seconds spent generating", labels=lab)
        rate = GaugeMetricFamily("dora_instance_tokens_per_second", "Generated tokens per second", labels=lab)
        for iid, st in sorted(self.last.items()):
            version.add_metric([iid], int(st.loaded_version))
            for s in INSTANCE_STATES:
                state.add_metric([iid, s], 1.0 if st.state == s else 0.0)
            in_flight.add_metric([iid], int(st.in_flight))
            capacity.add_metric([iid], int(st.capacity))
            tokens.add_metric([iid], int(st.generated_tokens))
            busy.add_metric([iid], float(st.busy_s))
            if iid in self.rate:
                rate.add_metric([iid], self.rate[iid])
        return [version, state, in_flight, capacity, tokens, busy, rate]


# -- consumer lag --------------------------------------------------------------------------------


class ConsumerWatch:
    """The consumers whose lag is reported, each through the :class:`LagProbe` its owner records after each
    poll; a scrape and an unwatch exclude each other (see invariants)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.consumers: dict[int, tuple[LagProbe, str]] = {}  # id(consumer) -> (its probe, bootstrap)
        self._highs: dict[str, HighWatermarks] = {}

    def watch(self, consumer: Any, probe: LagProbe, bootstrap: str) -> None:
        with self.lock:
            self.consumers[id(consumer)] = (probe, bootstrap)

    def unwatch(self, consumer: Any) -> None:
        with self.lock:
            self.consumers.pop(id(consumer), None)

    def rows(self) -> list[PartitionLag]:
        out: list[PartitionLag] = []
        with self.lock:
            for probe, bootstrap in list(self.consumers.values()):
                out.extend(probe.rows(self._high_of(bootstrap)))
        return out

    def _high_of(self, bootstrap: str) -> HighWatermarks:
        if bootstrap not in self._highs:
            self._highs[bootstrap] = HighWatermarks(bootstrap)
        return self._highs[bootstrap]


def lag_families(rows: Iterable[PartitionLag]) -> list[Metric]:
    """The three consumer families of ``rows``."""
    lab = ["group", "topic", "partition"]
    lag = GaugeMetricFamily("dora_consumer_lag_records", "High watermark - position", labels=lab)
    pos = GaugeMetricFamily("dora_consumer_position", "Next offset the consumer reads", labels=lab)
    high = GaugeMetricFamily("dora_consumer_high_watermark", "High watermark (last stable offset)", labels=lab)
    for r in rows:
        labels = [r.group, r.topic, str(r.partition)]
        lag.add_metric(labels, r.lag)
        pos.add_metric(labels, r.position)
        high.add_metric(labels, r.high)
    return [lag, pos, high]


# -- the process's state and its collector -------------------------------------------------------


class RoleCollector:
    """Yields the trainer, instance and lag families from one locked snapshot each."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.trainer = TrainerState()
        self.instances = InstanceState()
        self.consumers = ConsumerWatch()

    def describe(self) -> list[Metric]:
        return []  # families appear with the role's first data; nothing to check at registration

    def collect(self) -> Iterator[Metric]:
        with self.lock:
            families = self.trainer.families() + self.instances.families()
        yield from families
        rows = self.consumers.rows()
        if rows:
            yield from lag_families(rows)


STATE = RoleCollector()
REGISTRY.register(STATE)


@_never_raises
def watch_consumer(consumer: Any, probe: LagProbe, bootstrap: str) -> None:
    """Report the lag of ``consumer`` on this process's endpoint, as ``probe`` (recorded by its owner) holds it."""
    STATE.consumers.watch(consumer, probe, bootstrap)


def release_consumer(consumer: Any) -> None:
    """Stop reporting ``consumer`` (waiting for a scrape in progress), then close it."""
    STATE.consumers.unwatch(consumer)
    consumer.close()


@_never_raises
def record_sent(topic: str, record: Any) -> None:
    """A record was queued for ``topic`` (every typed send of :class:`~dora_rl.infra.kafka.io.RecordProducer`),
    counted under its catalogue name (a process serves one run)."""
    try:
        topic = topics.catalogue_name_of(topic)
    except ValueError:
        pass
    RECORDS_SENT.labels(topic).inc()
    if topic == topics.DLQ and isinstance(record, DeadLetter):
        DEAD_LETTERS.labels(record.component, record.error_type).inc()
    elif topic == topics.METRICS and isinstance(record, MetricRecord):
        METRIC.labels(record.component, record.name).set(record.value)
        if record.component == "trainer":
            with STATE.lock:
                STATE.trainer.metric(record.name, record.value, None if record.step is None else int(record.step))
    elif topic == topics.INSTANCES and isinstance(record, InstanceStatus):
        with STATE.lock:
            STATE.instances.status(record)


@_never_raises
def dead_letter(component: str, error_type: str) -> None:
    """A refusal was written to ``dora.dlq`` as raw bytes (:class:`~dora_rl.infra.kafka.io.DeadLetters`)."""
    RECORDS_SENT.labels(topics.DLQ).inc()
    DEAD_LETTERS.labels(component, error_type).inc()


@_never_raises
def trained_batch(batch: Any) -> None:
    """The trainer trained ``batch`` (a ``TrainBatch``) and committed its version."""
    with STATE.lock:
        STATE.trainer.batch(int(batch.train_step), int(batch.max_staleness), batch.staleness(), time.time())


def role_info(run_id: str, role: str, name: str) -> None:
    """Label this process's endpoint with its run and role."""
    ROLE_INFO.labels(run_id, role, name).set(1)


__all__ = ["INSTANCE_STATES", "ConsumerWatch", "InstanceState", "RoleCollector", "TrainerState", "dead_letter",
           "lag_families", "record_sent", "release_consumer", "role_info", "trained_batch", "watch_consumer"]
