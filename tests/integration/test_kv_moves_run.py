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
# cancel found its requests still queued in about one run in three, at 9d0ddc2 as after it
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

    summary = run(DoraConfig.from_dict(CONFIG), bootstrap, quiet=True, stall_timeout_s=300)
    run_id = summary["run_id"]
    assert summary["steps"] == CONFIG["steps"]
    report = audit_run(bootstrap, run_id)
    assert report.ok, report.render()
    exported = {c.trajectory_id: c.kv for c in _records(bootstrap, run_id, topics.TOKENS, TokenChunk)
                if c.aborted and c.kv is not None}
    named = [r for r in _records(bootstrap, run_id, topics.REQUESTS, RolloutRequest) if r.kv is not None]
    assert exported, "no trajectory moved with its rows: the run did not exercise a KV move"
    assert {r.trajectory_id for r in named} == set(exported)  # every exported reference reached its resume
    assert all(r.kv == exported[r.trajectory_id] and len(r.partial_ids) > 0 for r in named)
    counts: Counter[str] = Counter()
    for m in _metrics(bootstrap, run_id):
        if m.name in ("kv_moves", "kv_fallback"):
            counts[f"{m.name}:{m.labels.get('reason', '')}"] += int(m.value)
    assert counts == Counter({"kv_moves:": len(named)}), counts  # each imported, none prefilled
