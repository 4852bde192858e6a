"""``dora-rl audit``: checks C1–C3 of a run from its topics alone.

Checks (each a count of violations; the run passes when all are zero):

- **C1** ``c1_mixed_versions``: trajectories whose tokens come from more than one version;
  ``c1_instance_mismatch``: trajectories whose producing instance held another version than the
  trajectory's (``instance_version != policy_version``); ``c1_request_mismatch``: trajectories whose
  version differs from the version their request was tagged with.
- **C2** ``c2_duplicated``: trajectory ids in more than one batch (or twice in one);
  ``c2_not_dispatched``: batched trajectories no request asked for; ``c2_split_groups``: groups
  whose trajectories are not all in the same batch; ``c2_missing``: dispatched trajectories in no
  batch, beyond what may legitimately still be in flight when the run stopped (trajectories of
  groups none of whose members were batched, at most ``rollout_batch_size`` of them).
- **C3** ``c3_over_stale``: batched trajectories with ``base_version - version > max_staleness``.
- **TBS** ``tbs_wrong_size``: batches whose size is not exactly ``train_batch_size``.

``partial`` mode breaks C1 by design: its mixed-version trajectories are reported as
``c1_breaks_expected`` and do not fail the audit of a partial run.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from dora_rl.config import DoraConfig
from dora_rl.infra import topics
from dora_rl.infra.kafka_io import read_all
from dora_rl.infra.runs import get_run
from dora_rl.schemas.codec import DecodeError
from dora_rl.schemas.records import DeadLetter, Record, RolloutRequest, TrainBatch, Trajectory


@dataclass
class AuditReport:
    """Counts of every check, figures, and examples of violations."""

    run_id: str
    mode: str
    max_staleness: int
    train_batch_size: int
    batches: int = 0
    trajectories_batched: int = 0
    requests: int = 0
    max_staleness_seen: int = 0
    staleness_histogram: dict[int, int] = field(default_factory=dict)
    versions_seen: list[int] = field(default_factory=list)
    c1_mixed_versions: int = 0
    c1_breaks_expected: int = 0
    c1_instance_mismatch: int = 0
    c1_request_mismatch: int = 0
    c2_duplicated: int = 0
    c2_not_dispatched: int = 0
    c2_split_groups: int = 0
    c2_missing: int = 0
    in_flight_at_end: int = 0
    c3_over_stale: int = 0
    tbs_wrong_size: int = 0
    dead_letters: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    VIOLATIONS = ("c1_mixed_versions", "c1_instance_mismatch", "c1_request_mismatch", "c2_duplicated",
                  "c2_not_dispatched", "c2_split_groups", "c2_missing", "c3_over_stale", "tbs_wrong_size")

    @property
    def ok(self) -> bool:
        """No violation of any check."""
        return all(getattr(self, name) == 0 for name in self.VIOLATIONS) and self.batches > 0

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        return out

    def render(self) -> str:
        lines = [f"audit of run {self.run_id} (mode {self.mode}, S={self.max_staleness}, TBS={self.train_batch_size})",
                 f"  batches {self.batches}, trajectories batched {self.trajectories_batched}, requests "
                 f"{self.requests}, in flight at end {self.in_flight_at_end}",
                 f"  staleness max {self.max_staleness_seen}, "
                 f"histogram {dict(sorted(self.staleness_histogram.items()))}"]
        for name in self.VIOLATIONS:
            value = getattr(self, name)
            lines.append(f"  {'FAIL' if value else 'ok  '} {name} = {value}")
        if self.c1_breaks_expected:
            lines.append(f"  note c1_breaks_expected = {self.c1_breaks_expected} "
                         "(partial mode mixes versions by design)")
        if self.dead_letters:
            lines.append(f"  dead letters: {self.dead_letters}")
        lines.extend(f"  e.g. {e}" for e in self.examples[:10])
        lines.append("PASS" if self.ok else "FAIL")
        return "\n".join(lines)


def audit_records(run_id: str, config: DoraConfig, requests: Iterable[RolloutRequest],
                  trajectories: Iterable[Trajectory], batches: Iterable[TrainBatch],
                  dead_letters: Iterable[DeadLetter] = ()) -> AuditReport:
    """The audit as a pure function of a run's records."""
    rep = AuditReport(run_id, config.mode, config.max_staleness, config.train_batch_size)
    bound = config.staleness_bound
    requested: dict[str, int] = {}
    group_members: dict[str, set[str]] = defaultdict(set)
    for r in requests:
        if r.action == "GENERATE":
            requested.setdefault(r.trajectory_id, int(r.policy_version))
            group_members[r.group_id].add(r.trajectory_id)
    rep.requests = len(requested)

    def check_trajectory(t: Trajectory, where: str) -> None:
        used = t.versions_used()
        if len(used) > 1:
            if config.mode == "partial":
                rep.c1_breaks_expected += 1
            else:
                rep.c1_mixed_versions += 1
                rep.examples.append(f"C1: {t.trajectory_id} ({where}) used versions {sorted(used)}")
        elif int(t.instance_version) != int(t.policy_version) and config.mode != "partial":
            rep.c1_instance_mismatch += 1
            rep.examples.append(f"C1: {t.trajectory_id} version {t.policy_version} made on an instance holding "
                                f"{t.instance_version}")
        want = requested.get(t.trajectory_id)
        if want is not None and want != int(t.policy_version) and config.mode != "partial":
            rep.c1_request_mismatch += 1
            rep.examples.append(f"C1: {t.trajectory_id} requested for v{want} but made by v{t.policy_version}")

    for t in trajectories:
        check_trajectory(t, "trajectories")
    batched: Counter[str] = Counter()
    batch_of_group: dict[str, set[int]] = defaultdict(set)
    stale_hist: Counter[int] = Counter()
    versions: set[int] = set()
    for b in batches:
        rep.batches += 1
        if len(b.trajectories) != config.train_batch_size:
            rep.tbs_wrong_size += 1
            rep.examples.append(f"TBS: batch {b.batch_id} has {len(b.trajectories)} trajectories")
        for t in b.trajectories:
            batched[t.trajectory_id] += 1
            batch_of_group[t.group_id].add(int(b.train_step))
            s = bound.staleness(b.base_version, t.policy_version)
            stale_hist[s] += 1
            versions.add(int(t.policy_version))
            if not bound.allows(b.base_version, t.policy_version):
                rep.c3_over_stale += 1
                rep.examples.append(f"C3: {t.trajectory_id} staleness {s} in step {b.train_step}")
            check_trajectory(t, f"batch {b.train_step}")
            if t.trajectory_id not in requested:
                rep.c2_not_dispatched += 1
    rep.trajectories_batched = sum(batched.values())
    rep.c2_duplicated = sum(n - 1 for n in batched.values() if n > 1)
    for tid, n in batched.items():
        if n > 1:
            rep.examples.append(f"C2: {tid} batched {n} times")
    for gid, steps in batch_of_group.items():
        if len(steps) > 1 or (len(group_members.get(gid, ())) and not group_members[gid] <= set(batched)):
            rep.c2_split_groups += 1
            rep.examples.append(f"C2: group {gid} split over steps {sorted(steps)}")
    unbatched = [tid for tid in requested if tid not in batched]
    rep.in_flight_at_end = len(unbatched)
    if len(unbatched) > config.rollout_batch_size:
        rep.c2_missing = len(unbatched) - config.rollout_batch_size
        rep.examples.append(f"C2: {len(unbatched)} dispatched trajectories never batched (allowed in flight: "
                            f"{config.rollout_batch_size})")
    rep.staleness_histogram = dict(stale_hist)
    rep.max_staleness_seen = max(stale_hist, default=0)
    rep.versions_seen = sorted(versions)
    rep.dead_letters = dict(Counter(f"{d.component}:{d.error_type}" for d in dead_letters))
    return rep


def _records(bootstrap: str, run_id: str, topic: str, cls: type[Record], start: dict[int, int]) -> list[Any]:
    out = []
    for msg in read_all(bootstrap, topic, start):
        try:
            rec = cls.decode(msg.value(), msg.headers())
        except DecodeError:
            continue
        if getattr(rec, "run_id", None) == run_id:
            out.append(rec)
    return out


def audit_run(bootstrap: str, run_id: str | None = None) -> AuditReport:
    """Read the run's topics and audit them."""
    info = get_run(bootstrap, run_id)
    config = DoraConfig.from_json(info.config_json)

    def start(topic: str) -> dict[int, int]:
        return {o.partition: o.offset for o in info.start_offsets if o.topic == topic}

    reqs = _records(bootstrap, info.run_id, topics.REQUESTS, RolloutRequest, start(topics.REQUESTS))
    trajs = _records(bootstrap, info.run_id, topics.TRAJECTORIES, Trajectory, start(topics.TRAJECTORIES))
    batches = _records(bootstrap, info.run_id, topics.BATCHES, TrainBatch, start(topics.BATCHES))
    dlq = _records(bootstrap, info.run_id, topics.DLQ, DeadLetter, start(topics.DLQ))
    return audit_records(info.run_id, config, reqs, trajs, batches, dlq)


def report_json(report: AuditReport) -> str:
    """The report as JSON."""
    return json.dumps(report.to_dict(), indent=2)
