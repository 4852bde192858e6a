"""The audit's report (:mod:`dora_rl.consumers.audit`): a count per check, the run's figures, and examples.

A run passes when every count in ``AuditReport.VIOLATIONS`` is zero and it reached its requested steps; the
checks themselves, and what each count means, are in the audit module's docstring.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["AuditReport"]


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
    w_not_as_generated: int = 0
    w_unsigned_score: int = 0
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
    v_refused: int = 0
    """Announcements every reader refuses (no holder, a negative version): left out of the version checks."""
    v_replayed: int = 0
    """Trainer announcements repeating an earlier one (same version and checksums) after a newer version: every
    reader keeps the newest, so they are reported, not violations."""
    c3_over_stale: int = 0
    tbs_wrong_size: int = 0
    dead_letters: dict[str, int] = field(default_factory=dict)
    provenance: dict[str, dict[str, int]] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    VIOLATIONS = ("c1_mixed_versions", "c1_instance_mismatch", "c1_request_mismatch", "c1_chunk_mismatch",
                  "c1_heartbeat_mismatch", "c2_duplicated", "c2_not_dispatched", "c2_split_groups", "c2_missing",
                  "c2_duplicate_steps", "c2_untrained_steps", "ids_unbalanced", "v_checksum_conflicts",
                  "v_not_increasing", "w_not_as_generated", "w_unsigned_score", "c3_over_stale", "tbs_wrong_size")

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
        if self.v_refused:
            lines.append(f"  note v_refused = {self.v_refused} (announcements refused on receipt, not checked)")
        if self.v_replayed:
            lines.append(f"  note v_replayed = {self.v_replayed} (earlier announcements repeated: readers keep "
                         "the newest)")
        if self.dead_letters:
            lines.append(f"  dead letters: {self.dead_letters}")
        lines.extend(f"  re-fed from run {src}: {c['batches']} batches, {c['trajectories']} trajectories"
                     for src, c in self.provenance.items())
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
