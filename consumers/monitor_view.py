"""The view model of ``dora-rl monitor`` and ``dora-rl dashboard``: a run folded from its records (pure).

:class:`RunView` observes decoded records of one run (``dora.metrics``, ``dora.instances``, ``dora.dlq``,
``dora.policy.versions``, ``dora.train.batches``, ``dora.rollout.requests``,
``dora.rollout.trajectories``) in any interleaving across topics, and :meth:`RunView.snapshot` returns
an immutable :class:`RunSnapshot`; rendering is elsewhere (:mod:`.monitor_render`, :mod:`.dashboard`).

Figures (``S`` the run's ``max_staleness``, ``V`` the newest version the trainer announced):

- **versions live**: ``max(0, V - S) .. V`` (C3's window), each with its *pending work* = trajectories
  requested (``GENERATE``) with that version, neither generated yet nor in a refused group (a migrated
  trajectory stays pending under its version; a resumed one in partial mode moves to its new version),
  and the instances holding it with their in-flight trajectories;
- **staleness of recent batches**: trajectories per staleness ``base_version - version`` over the last
  ``recent`` batches; per step, its mean and max;
- **throughput** (trained tokens per wall second, as the run's summary counts it): step ``k``'s
  ``trained_tokens / (t_k - t_{k-1})`` with ``t_k`` the time the trainer reported step ``k`` and
  ``t_{-1}`` the announcement of version 0 (:func:`tokens_per_wall_s`); overall, the last ``recent``
  steps' tokens over the time they took;
- **instance tokens/s**: generated tokens between heartbeats at least 2 s apart;
- **DLQ rate**: dead letters per minute over the minute before ``now_ms``;
- **consumer lag** per role and topic: the partitions' lags (:mod:`dora_rl.infra.kafka.lag`) summed.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.lag import PartitionLag
from dora_rl.schemas.records import PolicyVersion

from .timeline import Timeline

STEP_METRICS = ("reward_mean", "trained_tokens", "staleness_max", "train_s", "wait_s")


def tokens_per_wall_s(tokens: dict[int, float], ts_ms: dict[int, int], start_ms: int | None) -> dict[int, float]:
    """Step -> ``tokens[k] / (ts_ms[k] - ts_ms[k - 1])`` (``ts_ms[-1]`` = ``start_ms``), for the steps whose
    time and previous time are known and apart."""
    times = dict(ts_ms)
    if start_ms is not None:
        times.setdefault(-1, start_ms)
    return {k: tokens[k] * 1000 / (times[k] - times[k - 1]) for k in sorted(tokens)
            if k in times and k - 1 in times and times[k] > times[k - 1]}


@dataclass(frozen=True)
class StepRow:
    """One training step as the trainer reported it (None: not reported yet)."""

    step: int
    reward: float | None
    trained_tokens: float
    train_s: float | None
    wait_s: float | None
    staleness_max: float | None
    staleness_mean: float | None
    ts_ms: int | None
    tokens_per_s: float | None
    """Trained tokens per wall second of this step (module docstring)."""


@dataclass(frozen=True)
class InstanceRow:
    instance_id: str
    version: int
    state: str
    in_flight: int
    capacity: int
    generated_tokens: int
    tokens_per_s: float | None
    idle_fraction: float
    last_ms: int


@dataclass(frozen=True)
class VersionRow:
    version: int
    pending: int
    in_flight: int
    instances: tuple[str, ...]


@dataclass(frozen=True)
class LagRow:
    """The lag of one role (consumer group ``dora.<run>.<role>``) on one topic, summed over partitions."""

    role: str
    topic: str
    partitions: int
    lag: int


def _catalogue_name(run_id: str, topic: str) -> str:
    try:
        return topics.catalogue_name(run_id, topic)
    except ValueError:  # not a topic of this run: shown as it is
        return topic


def lag_by_role(rows: tuple[PartitionLag, ...], run_id: str) -> tuple[LagRow, ...]:
    """``rows`` summed per (role, topic); the role is the group id without its ``dora.<run>.`` prefix, the topic
    its catalogue name (the run's topics are ``dora.<run>.<name>``)."""
    sums: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        role = r.group.removeprefix(f"dora.{run_id}.")
        acc = sums.setdefault((role, _catalogue_name(run_id, r.topic)), [0, 0])
        acc[0] += 1
        acc[1] += r.lag
    return tuple(LagRow(role, topic, n, lag) for (role, topic), (n, lag) in sorted(sums.items()))


@dataclass(frozen=True)
class RunSnapshot:
    """What the monitor and the dashboard show at ``now_ms`` (see the module docstring)."""

    run_id: str
    mode: str
    state: str
    max_staleness: int
    steps_target: int
    now_ms: int
    steps: tuple[StepRow, ...]
    latest_version: int
    versions: tuple[VersionRow, ...]
    instances: tuple[InstanceRow, ...]
    staleness_recent: tuple[tuple[int, int], ...]
    recent_batches: int
    throughput_tokens_per_s: float | None
    reward: float | None
    dlq_total: int
    dlq_per_min: float
    dlq_by_reason: tuple[tuple[str, int], ...]
    lag: tuple[LagRow, ...]
    endpoints: tuple[tuple[str, str], ...]
    done: bool

    @property
    def step_count(self) -> int:
        """Steps whose reward the trainer reported."""
        return sum(1 for s in self.steps if s.reward is not None)


@dataclass
class RunView:
    """Accumulates a run's records (see the module docstring); ``steps`` maps step -> metric -> value."""

    run_id: str = ""
    mode: str = ""
    state: str = ""
    max_staleness: int = 0
    steps_target: int = 0
    recent: int = 5
    steps: dict[int, dict[str, float]] = field(default_factory=dict)
    step_ms: dict[int, int] = field(default_factory=dict)
    instances: dict[str, Any] = field(default_factory=dict)
    timeline: Timeline = field(default_factory=Timeline)
    dead: Counter[str] = field(default_factory=Counter)
    lag: tuple[PartitionLag, ...] = ()
    endpoints: dict[str, str] = field(default_factory=dict)
    latest_version: int = -1
    version0_ms: int | None = None
    done: bool = False
    batch_staleness: dict[int, Counter[int]] = field(default_factory=dict)
    _dead_ms: deque[int] = field(default_factory=lambda: deque(maxlen=10_000))
    _version_of: dict[str, int] = field(default_factory=dict)  # pending trajectory id -> its version
    _generated: set[str] = field(default_factory=set)
    _refused_groups: set[str] = field(default_factory=set)
    _rate_mark: dict[str, tuple[int, int]] = field(default_factory=dict)
    _rate: dict[str, float] = field(default_factory=dict)

    def observe(self, topic: str, record: Any) -> None:
        """Fold one decoded record of ``topic``."""
        if topic == topics.METRICS:
            self._metric(record)
        elif topic == topics.INSTANCES:
            self._heartbeat(record)
        elif topic == topics.DLQ:
            self.dead[f"{record.component}:{record.error_type}"] += 1
            self._dead_ms.append(int(record.ts_ms))
            if record.group_id is not None:
                self._refuse_group(record.group_id)
        elif topic == topics.VERSIONS and record.announced_by == PolicyVersion.TRAINER:
            self.latest_version = max(self.latest_version, int(record.version))
        elif topic == topics.BATCHES:
            self.batch_staleness.setdefault(int(record.train_step), Counter(record.staleness()))
        elif topic == topics.REQUESTS and record.action == "GENERATE":
            tid = record.trajectory_id
            if tid not in self._generated and record.group_id not in self._refused_groups:
                self._version_of[tid] = int(record.policy_version)
        elif topic == topics.TRAJECTORIES:
            self._generated.add(record.trajectory_id)
            self._version_of.pop(record.trajectory_id, None)

    def _metric(self, m: Any) -> None:
        if m.name == "metrics_endpoint" and m.labels:
            self.endpoints[m.component] = m.labels.get("address", "")
        if m.component != "trainer":
            return
        if m.step is not None and m.name in STEP_METRICS:
            self.steps.setdefault(int(m.step), {})[m.name] = m.value
            if m.name == "reward_mean":
                self.step_ms[int(m.step)] = int(m.ts_ms)
        elif m.name == "done" and self.steps_target and m.value >= self.steps_target:
            self.done = True
        elif m.name == "version_published" and m.version == 0:
            self.version0_ms = int(m.ts_ms)
        if m.version is not None:
            self.latest_version = max(self.latest_version, int(m.version))

    def _heartbeat(self, st: Any) -> None:
        self.instances[st.instance_id] = st
        self.timeline.observe(st)
        ts, tokens = self._rate_mark.get(st.instance_id, (int(st.ts_ms), int(st.generated_tokens)))
        if st.ts_ms - ts >= 2000:
            self._rate[st.instance_id] = (int(st.generated_tokens) - tokens) / ((st.ts_ms - ts) / 1000)
            ts, tokens = int(st.ts_ms), int(st.generated_tokens)
        self._rate_mark[st.instance_id] = (ts, tokens)

    def _refuse_group(self, group_id: str) -> None:
        self._refused_groups.add(group_id)
        prefix = group_id + "/"
        for tid in [t for t in self._version_of if t.startswith(prefix)]:
            del self._version_of[tid]

    # -- the snapshot ------------------------------------------------------------------------------

    def step_rows(self) -> tuple[StepRow, ...]:
        rows = []
        rate = tokens_per_wall_s({k: m["trained_tokens"] for k, m in self.steps.items() if "trained_tokens" in m},
                                 self.step_ms, self.version0_ms)
        for k in sorted(self.steps):
            m, hist = self.steps[k], self.batch_staleness.get(k)
            n = sum(hist.values()) if hist else 0
            rows.append(StepRow(k, m.get("reward_mean"), m.get("trained_tokens", 0.0), m.get("train_s"),
                                m.get("wait_s"), m.get("staleness_max", float(max(hist)) if hist else None),
                                sum(s * c for s, c in hist.items()) / n if hist and n else None,
                                self.step_ms.get(k), rate.get(k)))
        return tuple(rows)

    def version_rows(self) -> tuple[VersionRow, ...]:
        pending = Counter(self._version_of.values())
        held: dict[int, list[Any]] = {}
        for st in self.instances.values():
            if st.state != "STOPPED" and st.loaded_version >= 0:
                held.setdefault(int(st.loaded_version), []).append(st)
        newest = max([self.latest_version, *pending, *held], default=-1)
        live = set(range(max(0, newest - self.max_staleness), newest + 1)) if newest >= 0 else set()
        live |= {v for v, n in pending.items() if n} | set(held)
        return tuple(VersionRow(v, pending.get(v, 0), sum(int(s.in_flight) for s in held.get(v, [])),
                                tuple(sorted(s.instance_id for s in held.get(v, []))))
                     for v in sorted(live))

    def instance_rows(self) -> tuple[InstanceRow, ...]:
        return tuple(InstanceRow(st.instance_id, int(st.loaded_version), str(st.state), int(st.in_flight),
                                 int(st.capacity), int(st.generated_tokens), self._rate.get(st.instance_id),
                                 self.timeline.idle_fraction(st.instance_id), int(st.ts_ms))
                     for _, st in sorted(self.instances.items()))

    def snapshot(self, now_ms: int) -> RunSnapshot:
        steps = self.step_rows()
        recent_steps = [s for s in steps if s.tokens_per_s][-self.recent:]
        busy = sum(s.trained_tokens / (s.tokens_per_s or 1.0) for s in recent_steps)  # their wall seconds
        hist: Counter[int] = Counter()
        recent_batches = sorted(self.batch_staleness)[-self.recent:]
        for k in recent_batches:
            hist.update(self.batch_staleness[k])
        rewarded = [s for s in steps if s.reward is not None]
        return RunSnapshot(
            run_id=self.run_id, mode=self.mode, state=self.state, max_staleness=self.max_staleness,
            steps_target=self.steps_target, now_ms=now_ms, steps=steps, latest_version=self.latest_version,
            versions=self.version_rows(), instances=self.instance_rows(),
            staleness_recent=tuple(sorted(hist.items())), recent_batches=len(recent_batches),
            throughput_tokens_per_s=sum(s.trained_tokens for s in recent_steps) / busy if busy > 0 else None,
            reward=rewarded[-1].reward if rewarded else None, dlq_total=sum(self.dead.values()),
            dlq_per_min=float(sum(1 for t in self._dead_ms if now_ms - 60_000 < t <= now_ms)),
            dlq_by_reason=tuple(sorted(self.dead.items())), lag=lag_by_role(self.lag, self.run_id),
            endpoints=tuple(sorted(self.endpoints.items())), done=self.done)


__all__ = ["InstanceRow", "LagRow", "RunSnapshot", "RunView", "StepRow", "VersionRow", "lag_by_role",
           "tokens_per_wall_s"]
