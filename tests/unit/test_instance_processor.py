"""The rollout instance on the processor shape (producers/rollout/instance_processor.py): crashed at every record
boundary by the in-memory driver, it commits exactly what an uninterrupted run commits, and C1 holds."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from dora_rl.config import DoraConfig
from dora_rl.core.emulation import EmulatedParams
from dora_rl.infra.kafka import topics
from dora_rl.infra.weights.announcements import sign
from dora_rl.producers.rollout.emulated import EmulatedEngine
from dora_rl.producers.rollout.instance_processor import InstanceProcessor
from dora_rl.schemas.records import DeadLetter, PolicyVersion, RolloutRequest, TokenChunk, Trajectory
from dora_rl.streams.processor import InRecord, MemoryDriver, OutRecord

RUN, TOKEN = "r", "run-token"
CFG = DoraConfig.from_dict({"mode": "dora", "max_staleness": 2, "steps": 4, "train_batch_size": 4, "group_size": 2,
                            "rollout_batch_size": 8, "num_instances": 1, "instance_concurrency": 3,
                            "engine": "emulated", "max_new_tokens": 40})


def _version(v: int, kind: str = PolicyVersion.TRAINER) -> PolicyVersion:
    return sign(PolicyVersion(run_id=RUN, version=v, step=v, created_ms=0, transport="tcp", holders=("h",),
                              total_bytes=0, checksum_algo="xxh3_64", tensors=(), buckets=(), announced_by=kind), TOKEN)


def _request(g: int, version: int, action: str = "GENERATE", partial: int = 0) -> RolloutRequest:
    return RolloutRequest(run_id=RUN, trajectory_id=f"{RUN}/p{g}/0", group_id=f"{RUN}/p{g}", prompt_id=f"p{g}",
                          sample_index=0, group_size=1, policy_version=version, instance_id="rollout-0", action=action,
                          task="t", reference="", prompt_ids=np.array([1, 2, 3]),
                          partial_ids=np.arange(partial, dtype=np.int32) + 5,
                          partial_logprobs=np.full(partial, -0.5, dtype=np.float32), max_new_tokens=40)


def _inputs() -> list[InRecord]:
    """Log order: requests of versions 0-2 (version 2 announced late), a copy of a queued one, a resume with a
    partial, a cancel of a queued request, and a forged announcement (a holder's, on the trainer's topic)."""
    v, q = [], []
    recs: list[tuple[str, Any]] = [
        (topics.REQUESTS, _request(0, 0)), (topics.VERSIONS, _version(0)), (topics.REQUESTS, _request(1, 0)),
        (topics.REQUESTS, _request(2, 1)), (topics.REQUESTS, _request(3, 2)), (topics.REQUESTS, _request(3, 2)),
        (topics.VERSIONS, _version(1, PolicyVersion.HOLDER)), (topics.REQUESTS, _request(4, 2)),
        (topics.VERSIONS, _version(1)), (topics.REQUESTS, _request(5, 1, partial=6)),
        (topics.REQUESTS, _request(4, 2, action="CANCEL")), (topics.REQUESTS, _request(6, 0)),
        (topics.VERSIONS, _version(2)), (topics.REQUESTS, _request(7, 2)),
    ]
    out = []
    for topic, rec in recs:
        offsets = v if topic == topics.VERSIONS else q
        out.append(InRecord(topic, 0, len(offsets), None, rec))
        offsets.append(rec)
    return out


def _factory() -> InstanceProcessor:
    engine = EmulatedEngine(EmulatedParams(time_scale=0.0, capacity=3), capacity=3)
    return InstanceProcessor(RUN, 0, CFG, engine, TOKEN)


def _comparable(o: OutRecord) -> tuple[Any, ...]:
    """The record as committed, but for the engine's wall-clock stamps (and the signature over them)."""
    rec = o.record
    if isinstance(rec, Trajectory):
        rec = rec.replace(first_token_ms=0, finished_ms=0, signature=None)
    return o.topic, o.key, o.partition, rec.encode()[0]


def test_uninterrupted_run_generates_every_request_once_under_its_version_and_refuses_the_forgery() -> None:
    out = MemoryDriver(_factory, _inputs()).run()
    trajs = [o.record for o in out if isinstance(o.record, Trajectory)]
    assert sorted(t.trajectory_id for t in trajs) == [f"{RUN}/p{g}/0" for g in (0, 1, 2, 3, 5, 6, 7)]
    assert all(t.instance_version == t.policy_version for t in trajs), "C1: generated under its own version"
    resumed = next(t for t in trajs if t.trajectory_id == f"{RUN}/p5/0")
    assert list(resumed.response_ids[:6]) == list(range(5, 11)), "a resume continues from its partial"
    chunks = [o.record for o in out if isinstance(o.record, TokenChunk)]
    assert all(c.policy_version == next(t.policy_version for t in trajs if t.trajectory_id == c.trajectory_id)
               for c in chunks if not c.aborted)
    assert [(c.trajectory_id, c.aborted) for c in chunks if c.aborted] == [(f"{RUN}/p4/0", True)]
    letters = [o.record for o in out if isinstance(o.record, DeadLetter)]
    assert [(d.source_topic, d.source_offset, d.error_type) for d in letters] == [(topics.VERSIONS, 1, "announcement")]


@pytest.mark.parametrize("commit_every", [1, 3])
def test_a_crash_at_every_record_boundary_commits_what_the_uninterrupted_run_commits(commit_every: int) -> None:
    inputs = _inputs()
    expected = [_comparable(o) for o in MemoryDriver(_factory, inputs, commit_every=commit_every).run()]
    for k in range(1, len(inputs) + 1):
        driver = MemoryDriver(_factory, inputs, commit_every=commit_every)
        got = [_comparable(o) for o in driver.run(crash_after=[k])]
        assert got == expected, f"a crash after record {k} changed the committed output"
    driver = MemoryDriver(_factory, inputs, commit_every=commit_every)
    assert [_comparable(o) for o in driver.run(crash_after=range(1, len(inputs)))] == expected
    assert driver.restores > 0
