"""``dora-rl audit``: checks C1–C3 of a run from its topics alone.

Reads the run's requests, generated trajectories (``dora.rollout.trajectories``), token chunks
(``dora.rollout.tokens``), instance heartbeats (``dora.instances``), batches, dead letters and version
announcements. The checks are pure functions of those records (:func:`audit_records`, with the
cross-topic ones in :mod:`dora_rl.consumers.audit_checks`); :func:`audit_run` only reads them.

Checks (each a count of violations; the run passes when all are zero):

- **C1** ``c1_mixed_versions``: trajectories whose tokens come from more than one version;
  ``c1_instance_mismatch``: trajectories whose producing instance held another version than the
  trajectory's (``instance_version != policy_version``); ``c1_request_mismatch``: trajectories whose
  version differs from the version their request was tagged with. Cross-checked against what the
  instances said, not only the trajectory's own fields: ``c1_chunk_mismatch``: batched trajectories
  with a (non-aborted) token chunk of another version than theirs; ``c1_heartbeat_mismatch``:
  batched trajectories that a heartbeat of any instance listed in flight while it held another version.
- **C2** ``c2_duplicated``: trajectory ids in more than one batch (or twice in one);
  ``c2_not_dispatched``: batched trajectories no request asked for; ``c2_split_groups``: groups
  whose trajectories are not all in the same batch; ``c2_missing``: in a run that reached its
  requested steps, dispatched trajectories that are neither in a batch nor refused in ``dora.dlq``
  (their group refused, or the trajectory itself by an older letter without ``group_id``; no
  tolerance: every mode dispatches exactly ``steps * TBS`` plus one replacement per refused group);
  ``c2_duplicate_steps``: train steps with more than one committed batch; ``c2_untrained_steps``: in
  a finished run, batches whose step the trainer never announced a version for.
- **Ids** ``ids_unbalanced``: in a finished run, distinct generated trajectory ids neither trained nor
  refused, plus trained ids never generated (generated = trained + refused; ``ids_by_version``
  reports the three counts per version, in any run).
- **Versions** ``v_checksum_conflicts``: a version announced (by the trainer or any holder) with two
  different sets of bucket checksums; ``v_not_increasing``: a trainer announcement whose version is
  not above every earlier one.
- **C3** ``c3_over_stale``: batched trajectories with ``base_version - version > max_staleness``.
- **TBS** ``tbs_wrong_size``: batches whose size is not exactly ``train_batch_size``.

``partial`` mode breaks C1 by design: its mixed-version trajectories (and their chunk and heartbeat
mismatches) are reported as ``c1_breaks_expected`` and do not fail the audit of a partial run.

Reported, never violations: ``refused_groups`` (each refused prompt's group with the first letter's
trajectory, component, error type and attempts, and every reason given), ``refused_but_trained``
(refused groups batched all the same: the refusal concerned a duplicate copy; counted as batched),
``waste_trajectories`` (records on ``dora.rollout.trajectories`` beyond the first per id: regenerated
after a crash) and ``waste_tokens`` (their response tokens plus those of refused, never trained ids).

Verdict: **FAIL** on any violation; else **INCOMPLETE** when fewer batches than the run's requested
steps exist (a run that stopped early is never reported as passing); else **PASS**.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from dora_rl.config import DoraConfig
from dora_rl.consumers.audit_checks import (
    chunk_mismatches,
    first_copies,
    heartbeat_mismatches,
    id_balance,
    refused_groups,
    waste,
)
from dora_rl.infra import topics
from dora_rl.infra.kafka_io import read_all
from dora_rl.infra.runs import get_run
from dora_rl.schemas.codec import DecodeError
from dora_rl.schemas.records import (
    DeadLetter,
    InstanceStatus,
    PolicyVersion,
    Record,
    RolloutRequest,
    TokenChunk,
    TrainBatch,
    Trajectory,
)


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
    c1_chunk_mismatch: int = 0
    c1_heartbeat_mismatch: int = 0
    c2_duplicated: int = 0
    c2_not_dispatched: int = 0
    c2_split_groups: int = 0
    c2_missing: int = 0
    c2_duplicate_steps: int = 0
    c2_untrained_steps: int = 0
    v_checksum_conflicts: int = 0
    v_not_increasing: int = 0
    steps_requested: int = 0
    refused: int = 0
    refused_groups: list[dict[str, Any]] = field(default_factory=list)
    refused_but_trained: int = 0
    in_flight_at_end: int = 0
    chunks_read: int = 0
    heartbeats_read: int = 0
    ids_by_version: dict[int, dict[str, int]] = field(default_factory=dict)
    ids_unbalanced: int = 0
    waste_trajectories: int = 0
    waste_tokens: int = 0
    c3_over_stale: int = 0
    tbs_wrong_size: int = 0
    dead_letters: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    VIOLATIONS = ("c1_mixed_versions", "c1_instance_mismatch", "c1_request_mismatch", "c1_chunk_mismatch",
                  "c1_heartbeat_mismatch", "c2_duplicated", "c2_not_dispatched", "c2_split_groups", "c2_missing",
                  "c2_duplicate_steps", "c2_untrained_steps", "ids_unbalanced", "v_checksum_conflicts",
                  "v_not_increasing", "c3_over_stale", "tbs_wrong_size")

    @property
    def complete(self) -> bool:
        """The run reached its requested steps."""
        return self.batches >= self.steps_requested > 0

    @property
    def verdict(self) -> str:
        """PASS, INCOMPLETE (no violation, but short of the requested steps) or FAIL."""
        if any(getattr(self, name) for name in self.VIOLATIONS):
            return "FAIL"
        return "PASS" if self.complete else "INCOMPLETE"

    @property
    def ok(self) -> bool:
        """The verdict is PASS: no violation, and the run reached its requested steps."""
        return self.verdict == "PASS"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["ok"] = self.ok
        out["verdict"] = self.verdict
        return out

    def render(self) -> str:
        lines = [f"audit of run {self.run_id} (mode {self.mode}, S={self.max_staleness}, TBS={self.train_batch_size})",
                 f"  batches {self.batches}, trajectories batched {self.trajectories_batched}, requests "
                 f"{self.requests}, in flight at end {self.in_flight_at_end}",
                 f"  staleness max {self.max_staleness_seen}, "
                 f"histogram {dict(sorted(self.staleness_histogram.items()))}",
                 f"  cross-checked against {self.chunks_read} token chunks, {self.heartbeats_read} heartbeats",
                 "  ids generated/trained/refused by version: "
                 + (", ".join(f"v{v} {c['generated']}/{c['trained']}/{c['refused']}"
                              for v, c in sorted(self.ids_by_version.items())) or "none"),
                 f"  waste: {self.waste_trajectories} regenerated trajectories, {self.waste_tokens} tokens "
                 "(regenerated or refused)"]
        for name in self.VIOLATIONS:
            value = getattr(self, name)
            lines.append(f"  {'FAIL' if value else 'ok  '} {name} = {value}")
        if self.c1_breaks_expected:
            lines.append(f"  note c1_breaks_expected = {self.c1_breaks_expected} "
                         "(partial mode mixes versions by design)")
        if self.dead_letters:
            lines.append(f"  dead letters: {self.dead_letters}")
        if self.refused_groups:
            lines.append(f"  refused groups {len(self.refused_groups)} (refused but trained all the same "
                         f"{self.refused_but_trained}):")
        lines.extend(f"    refused {g['group_id']} ({g['trajectory_id']}) by {g['component']}:{g['error_type']} "
                     f"after {g['attempts']} attempts: {g['reason']}" for g in self.refused_groups)
        lines.extend(f"  e.g. {e}" for e in self.examples[:10])
        if self.verdict == "INCOMPLETE":
            lines.append(f"  {self.batches} of {self.steps_requested} requested steps have a batch")
        lines.append(self.verdict)
        return "\n".join(lines)


def refused_ids(dead_letters: Iterable[DeadLetter]) -> set[str]:
    """Trajectory ids a role refused (dead letters whose original value is a trajectory)."""
    out: set[str] = set()
    for d in dead_letters:
        if d.source_topic == topics.TRAJECTORIES and d.value:  # the scorer refuses what it cannot score
            try:
                out.add(Trajectory.decode(d.value).trajectory_id)
            except DecodeError:
                continue  # an undecodable record refused as such: no id to account for
    return out


def audit_versions(rep: AuditReport, versions: Iterable[PolicyVersion]) -> set[int]:
    """Version checks; returns the versions the trainer announced."""
    checksums: dict[int, set[tuple[str, ...]]] = defaultdict(set)
    announced: set[int] = set()
    newest = -1
    for ann in versions:
        checksums[int(ann.version)].add(tuple(b.checksum for b in ann.buckets))
        if ann.announced_by == PolicyVersion.TRAINER:
            if int(ann.version) <= newest:
                rep.v_not_increasing += 1
                rep.examples.append(f"versions: the trainer announced {ann.version} after {newest}")
            newest = max(newest, int(ann.version))
            announced.add(int(ann.version))
    for v, sums in sorted(checksums.items()):
        if len(sums) > 1:
            rep.v_checksum_conflicts += 1
            rep.examples.append(f"versions: version {v} announced with {len(sums)} different checksums")
    return announced


def audit_records(run_id: str, config: DoraConfig, requests: Iterable[RolloutRequest],
                  trajectories: Iterable[Trajectory], batches: Iterable[TrainBatch],
                  dead_letters: Iterable[DeadLetter] = (),
                  announcements: Iterable[PolicyVersion] | None = None,
                  chunks: Iterable[TokenChunk] = (), statuses: Iterable[InstanceStatus] = ()) -> AuditReport:
    """The audit as a pure function of a run's records (``announcements`` None: no version checks).

    ``trajectories`` are the generated ones (``dora.rollout.trajectories``, regenerated copies
    included), ``chunks`` the token chunks and ``statuses`` the instance heartbeats.
    """
    rep = AuditReport(run_id, config.mode, config.max_staleness, config.train_batch_size,
                      steps_requested=config.steps)
    dead_letters = list(dead_letters)
    trajectories = list(trajectories)
    groups_refused = refused_groups(run_id, dead_letters)
    rep.refused_groups = list(groups_refused.values())
    bound = config.staleness_bound
    requested: dict[str, int] = {}
    group_of: dict[str, str] = {}
    group_members: dict[str, set[str]] = defaultdict(set)
    for r in requests:
        if r.action == "GENERATE":
            requested.setdefault(r.trajectory_id, int(r.policy_version))
            group_of.setdefault(r.trajectory_id, r.group_id)
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
    trained: dict[str, int] = {}  # batched id -> its version (first batched copy)
    batch_of_group: dict[str, set[int]] = defaultdict(set)
    stale_hist: Counter[int] = Counter()
    versions: set[int] = set()
    steps_seen: Counter[int] = Counter()
    for b in batches:
        rep.batches += 1
        steps_seen[int(b.train_step)] += 1
        if len(b.trajectories) != config.train_batch_size:
            rep.tbs_wrong_size += 1
            rep.examples.append(f"TBS: batch {b.batch_id} has {len(b.trajectories)} trajectories")
        for t in b.trajectories:
            batched[t.trajectory_id] += 1
            trained.setdefault(t.trajectory_id, int(t.policy_version))
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
    rep.batches = len(steps_seen)
    rep.c2_duplicate_steps = sum(n - 1 for n in steps_seen.values() if n > 1)
    ids_refused = refused_ids(dead_letters)
    refused = ids_refused & set(requested)
    rep.refused = len(refused)
    rep.refused_but_trained = len(set(groups_refused) & set(batch_of_group))
    unbatched = [tid for tid in requested
                 if tid not in batched and tid not in refused and group_of[tid] not in groups_refused]
    if rep.complete:
        rep.c2_missing = len(unbatched)
        if unbatched:
            rep.examples.append(f"C2: {len(unbatched)} dispatched trajectories neither batched nor refused, "
                                f"e.g. {unbatched[:3]}")
    else:
        rep.in_flight_at_end = len(unbatched)
    cross_check_c1(rep, trained, list(chunks), list(statuses))
    first, extra = first_copies(trajectories)
    balance = id_balance(first, trained, groups_refused, ids_refused)
    rep.ids_by_version = balance.by_version
    if rep.complete:
        rep.ids_unbalanced = balance.unbalanced
        if balance.unaccounted:
            rep.examples.append(f"ids: {len(balance.unaccounted)} generated trajectories neither trained nor "
                                f"refused, e.g. {balance.unaccounted[:3]}")
        if balance.never_generated:
            rep.examples.append(f"ids: {len(balance.never_generated)} trained trajectories never generated, "
                                f"e.g. {balance.never_generated[:3]}")
    rep.waste_trajectories, rep.waste_tokens = waste(first, extra, balance.refused)
    if announcements is not None:
        announced = audit_versions(rep, announcements)
        if rep.complete:
            untrained = sorted(k for k in steps_seen if k + 1 not in announced)
            rep.c2_untrained_steps = len(untrained)
            if untrained:
                rep.examples.append(f"C2: batches of steps {untrained[:5]} were never trained")
    rep.staleness_histogram = dict(stale_hist)
    rep.max_staleness_seen = max(stale_hist, default=0)
    rep.versions_seen = sorted(versions)
    rep.dead_letters = dict(Counter(f"{d.component}:{d.error_type}" for d in dead_letters))
    return rep


def cross_check_c1(rep: AuditReport, trained: dict[str, int], chunks: list[TokenChunk],
                   statuses: list[InstanceStatus]) -> None:
    """C1 of the batched trajectories (id -> version) against their token chunks and the heartbeats."""
    rep.chunks_read, rep.heartbeats_read = len(chunks), len(statuses)
    by_chunk = chunk_mismatches(trained, chunks)
    by_heartbeat = heartbeat_mismatches(trained, statuses)
    if rep.mode == "partial":  # resumed on a newer version by design
        rep.c1_breaks_expected += len(by_chunk) + len(by_heartbeat)
        return
    rep.c1_chunk_mismatch, rep.c1_heartbeat_mismatch = len(by_chunk), len(by_heartbeat)
    rep.examples.extend(f"C1: {tid} version {trained[tid]} has token chunks of versions {vs}"
                        for tid, vs in list(by_chunk.items())[:5])
    rep.examples.extend(f"C1: {tid} version {trained[tid]} in flight on instances holding another: {pairs[:3]}"
                        for tid, pairs in list(by_heartbeat.items())[:5])


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
    versions = _records(bootstrap, info.run_id, topics.VERSIONS, PolicyVersion, start(topics.VERSIONS))
    chunks = _records(bootstrap, info.run_id, topics.TOKENS, TokenChunk, start(topics.TOKENS))
    statuses = _records(bootstrap, info.run_id, topics.INSTANCES, InstanceStatus, start(topics.INSTANCES))
    return audit_records(info.run_id, config, reqs, trajs, batches, dlq, versions, chunks, statuses)


def report_json(report: AuditReport) -> str:
    """The report as JSON."""
    return json.dumps(report.to_dict(), indent=2)
