"""Migrations that carry their KV rows, end to end (decision 0065): a dora run on the torch engine (the tiny
model, two instances, ``migrate``, S = 1 so instances switch versions with work in flight). Every trajectory
an instance exported is named, signed, on its aborted chunk; the orchestrator copies that reference into the
resume; the resuming instance imports the rows over the weight channel instead of prefilling; the audit passes
(C1, nothing lost, nothing twice)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from dora_rl.config import DoraConfig

pytestmark = pytest.mark.broker

# 12 steps: a cancel moves rows only when its request had started; with 6 steps (two rounds of moves) every
# cancel found its requests still queued in about one run in three, at 9d0ddc2 as after it. At 12 steps a run
# moved 3-17 trajectories in 12 of 12 runs on this machine (/tmp probe, alone and two at once), yet the clean-clone
# CI at 33b0bf5 saw a run that moved none: whether a switch finds work running is timing, so a run that moved
# nothing is run once more (another seed) before the test fails; a run that moves and breaks a rule fails at once.
CONFIG = {"mode": "dora", "max_staleness": 1, "repartition_policy": "migrate", "steps": 12, "train_batch_size": 8,
          "group_size": 4, "rollout_batch_size": 16, "num_instances": 2, "instance_concurrency": 16,
          "max_new_tokens": 96, "sft_steps": 0, "weight_transport": "tcp", "seed": 1}


def _records(bootstrap: str, run_id: str, topic: str, cls: type) -> list:  # type: ignore[type-arg]
    from dora_rl.infra.kafka.runs import get_run, read_run

    return [cls.decode(m.value(), m.headers()) for m in read_run(bootstrap, get_run(bootstrap, run_id), topic)]


def test_moved_trajectories_take_their_kv_rows_and_the_audit_passes(bootstrap: str, dora_home: Path) -> None:
    from run_helpers import _metrics

    from dora_rl.consumers.audit import audit_run
    from dora_rl.infra.kafka import topics
    from dora_rl.launcher import run
    from dora_rl.schemas.records import RolloutRequest, TokenChunk

    tried: list[str] = []
    for seed in (CONFIG["seed"], CONFIG["seed"] + 1):
        summary = run(DoraConfig.from_dict({**CONFIG, "seed": seed}), bootstrap, quiet=True, stall_timeout_s=300)
        run_id = summary["run_id"]
        assert summary["steps"] == CONFIG["steps"]
        report = audit_run(bootstrap, run_id)
        assert report.ok, report.render()
        chunks = _records(bootstrap, run_id, topics.TOKENS, TokenChunk)
        requests = _records(bootstrap, run_id, topics.REQUESTS, RolloutRequest)
        exported = {c.trajectory_id: c.kv for c in chunks if c.aborted and c.kv is not None}
        if exported:
            break
        tried.append(f"seed {seed}: {sum(r.action == 'CANCEL' for r in requests)} cancels, "
                     f"{sum(c.aborted for c in chunks)} aborted chunks, none with rows")
    named = [r for r in requests if r.kv is not None]
    assert exported, f"no trajectory moved with its rows in two runs ({'; '.join(tried)})"
    assert {r.trajectory_id for r in named} == set(exported)  # every exported reference reached its resume
    assert all(r.kv == exported[r.trajectory_id] and len(r.partial_ids) > 0 for r in named)
    counts: Counter[str] = Counter()
    for m in _metrics(bootstrap, run_id):
        if m.name in ("kv_moves", "kv_fallback"):
            counts[f"{m.name}:{m.labels.get('reason', '')}"] += int(m.value)
    assert counts == Counter({"kv_moves:": len(named)}), counts  # each imported, none prefilled
