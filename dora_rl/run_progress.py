"""What ``dora-rl run`` learns of a run while it follows it (:class:`Progress`, fed the records of
``dora.metrics`` and ``dora.instances``), and the evaluations' part of the run's summary (:func:`eval_summary`).

Invariant: only a trainer's ``done`` at or beyond the run's steps, signed with the trainer's key when one is
set, ends the run; anything else on those topics only updates figures.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from dora_rl.core.paired_bootstrap import paired_bootstrap
from dora_rl.infra.kafka.signing import signature_problem
from dora_rl.schemas.records import InstanceStatus, Metric

log = logging.getLogger(__name__)


@dataclass
class Progress:
    """What the run command learns from ``dora.metrics`` and ``dora.instances``."""

    steps: int = 0
    """Steps the run must reach: only a trainer's ``done`` at or beyond it ends the run (a resumed run
    with more steps reads the earlier ``done`` again)."""
    rewards: dict[int, float] = field(default_factory=dict)
    tokens: dict[int, float] = field(default_factory=dict)
    staleness: dict[int, float] = field(default_factory=dict)
    instance_versions: dict[str, int] = field(default_factory=dict)
    max_versions_live: int = 0
    """The most distinct versions the instances held at one time (DORA: more than one)."""
    versions_since_shown: set[int] = field(default_factory=set)
    """Versions the instances held since the progress line last showed them (the line shows, then clears)."""
    version0_ms: int | None = None
    last_step_ms: int | None = None
    warmup_s: float = 0.0
    done: bool = False
    extra: dict[str, list[float]] = field(default_factory=dict)
    token: str = ""
    """The trainer's key (:func:`~dora_rl.launcher.trainer_key_file`): only a ``done`` signed with it ends the
    run (none: not checked). Every role holds the weight token, so a ``done`` signed with that is passed by."""
    evals: dict[int, Metric] = field(default_factory=dict)
    """Version -> its last ``eval_pass_at_1`` (labels hold the per-prompt outcomes)."""
    eval_s: dict[int, float] = field(default_factory=dict)

    def observe(self, record: Any) -> None:
        if isinstance(record, InstanceStatus):
            self.instance_versions[record.instance_id] = int(record.loaded_version)
            live = {v for v in self.instance_versions.values() if v >= 0}
            self.max_versions_live = max(self.max_versions_live, len(live))
            self.versions_since_shown |= live
            return
        m: Metric = record
        if m.component == "trainer":
            if m.name == "reward_mean" and m.step is not None:
                self.rewards[int(m.step)] = m.value
                self.last_step_ms = m.ts_ms
            elif m.name == "trained_tokens" and m.step is not None:
                self.tokens[int(m.step)] = m.value
            elif m.name == "staleness_max" and m.step is not None:
                self.staleness[int(m.step)] = m.value
            elif m.name == "version_published" and m.version == 0:
                self.version0_ms = m.ts_ms
            elif m.name == "eval_pass_at_1" and m.version is not None:
                self.evals[int(m.version)] = m
            elif m.name == "eval_s" and m.version is not None:
                self.eval_s[int(m.version)] = m.value
            elif m.name == "sft_s":
                self.warmup_s = m.value
            elif m.name == "done" and m.value >= self.steps:
                problem = signature_problem(m, self.token, "a trainer's 'done'")
                if problem is None:
                    self.done = True
                else:
                    log.warning("passed by %s (it would end the run)", problem)
        self.extra.setdefault(f"{m.component}/{m.name}", []).append(m.value)


def eval_summary(progress: Progress) -> dict[str, Any]:
    """The held-out evaluations of a run for its summary: each version's pass@1, their total time, and
    the first-to-last difference with its paired 95% bootstrap interval (:mod:`...trainer.evaluate`)."""
    if not progress.evals:
        return {}
    evals = [{"version": v, "pass_at_1": m.value, "n": int(m.labels.get("n", "0")),
              "refused": int(m.labels.get("refused", "0")), "eval_s": round(progress.eval_s.get(v, 0.0), 3)}
             for v, m in sorted(progress.evals.items())]
    out: dict[str, Any] = {"eval": evals, "eval_s_total": round(sum(progress.eval_s.values()), 3)}
    first, last = min(progress.evals), max(progress.evals)
    a, b = progress.evals[first].labels.get("correct", ""), progress.evals[last].labels.get("correct", "")
    if last > first and a and len(a) == len(b):
        diff, lo, hi = paired_bootstrap(a, b)
        out["eval_delta"] = {"from_version": first, "to_version": last, "pass_at_1_diff": diff,
                             "ci95": [lo, hi], "resamples": 10_000}
    return out
