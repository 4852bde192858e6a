"""The assembler processor crashes at every record boundary and restores to identical committed output."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dora_rl.config import DoraConfig
from dora_rl.infra.kafka import topics
from dora_rl.schemas.records import BatchPlan, Trajectory
from dora_rl.streams.assembler import Assembler
from dora_rl.streams.processor import InRecord, MemoryDriver, OutRecord

RUN = "r1"
CFG = DoraConfig.from_dict({"mode": "dora", "max_staleness": 1, "steps": 4, "train_batch_size": 8, "group_size": 4,
                            "rollout_batch_size": 16, "engine": "emulated"})


def _traj(gid: str, i: int, version: int, reward: float | None = 0.5) -> Trajectory:
    return Trajectory(run_id=RUN, trajectory_id=f"{gid}/{i}", group_id=gid, prompt_id=gid, sample_index=i,
                      group_size=4, policy_version=version, task="reverse", reference="ab",
                      prompt_ids=np.asarray([5, 6], dtype=np.int32), response_ids=np.asarray([7, 2], dtype=np.int32),
                      behaviour_logprobs=np.asarray([-0.5, -0.1], dtype=np.float32), reward=reward,
                      instance_version=version)


def _recorded_input(seed: int) -> list[InRecord]:
    """Scored trajectories and plans of 4 steps in a shuffled but causal order, with a redelivered
    trajectory, a record without reward, and a late copy of a group trained already."""
    rng = random.Random(seed)
    groups = {step: [f"{RUN}/p{2 * step}", f"{RUN}/p{2 * step + 1}"] for step in range(4)}
    events: list[tuple[float, str, object]] = []
    for step, gids in groups.items():
        version = max(0, step - 1)
        for gid in gids:
            for i in range(4):
                events.append((step + rng.random(), topics.SCORED, _traj(gid, i, version)))
        ids = tuple(f"{g}/{i}" for g in gids for i in range(4))
        events.append((step + 0.5 + rng.random(), topics.SCHEDULE, BatchPlan(run_id=RUN, train_step=step,
                                                                            trajectory_ids=ids, ts_ms=0)))
    events.append((1.7, topics.SCORED, _traj(f"{RUN}/p1", 2, 0)))  # redelivered
    events.append((2.2, topics.SCORED, _traj(f"{RUN}/p9", 0, 1, reward=None)))  # refused: no reward
    for i in range(4):  # a regenerated copy of group p0 (trained at step 0), arriving after its deadline
        events.append((3.9, topics.SCORED, _traj(f"{RUN}/p0", i, 0)))
    events.sort(key=lambda e: e[0])
    offsets: dict[str, int] = {}
    out = []
    for _, topic, rec in events:
        offsets[topic] = offsets.get(topic, -1) + 1
        out.append(InRecord(topic, 0, offsets[topic], None, rec))
    return out


def _wire(outs: list[OutRecord]) -> list[tuple[str, str, bytes]]:
    return [(o.topic, o.key, o.record.encode()[0]) for o in outs]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_crash_at_every_record_boundary_gives_the_uninterrupted_output(seed: int) -> None:
    inputs = _recorded_input(seed)
    factory = lambda: Assembler(RUN, CFG)  # noqa: E731
    clean = MemoryDriver(factory, inputs).run()
    batches = [o.record for o in clean if o.topic == topics.BATCHES]
    assert [b.train_step for b in batches] == [0, 1, 2, 3]  # exactly one batch per step, in order
    assert all(len(b.trajectories) == CFG.train_batch_size for b in batches)
    assert sum(1 for o in clean if o.topic == topics.DLQ) == 1  # the record without reward
    trained = [t.trajectory_id for b in batches for t in b.trajectories]
    assert len(trained) == len(set(trained)) == 32  # the redelivery and the late copy were not batched
    for k in range(1, len(inputs)):
        crashed = MemoryDriver(factory, inputs, commit_every=2).run(crash_after=[k])
        assert _wire(crashed) == _wire(clean), f"crash after record {k} changed the committed output"
    many = MemoryDriver(factory, inputs, commit_every=3)
    assert _wire(many.run(crash_after=range(1, len(inputs), 4))) == _wire(clean)
    assert many.restores > 1


def test_snapshot_holds_references_not_trajectories() -> None:
    inputs = _recorded_input(0)
    driver = MemoryDriver(lambda: Assembler(RUN, CFG), inputs[:10])
    driver.run()
    snap = driver.committed.snapshot or b""
    assert b"reverse" not in snap and topics.SCORED.encode() in snap


@pytest.mark.parametrize(("reward", "logprobs", "why"), [
    (float("nan"), None, "reward nan"), (float("inf"), None, "reward inf"), (1.5, None, "reward 1.5"),
    (-0.1, None, "reward -0.1"), (0.5, [-0.5, float("nan")], "log-prob"), (0.5, [-0.5, 0.3], "log-prob"),
    (0.5, [-0.5], "1 behaviour log-probs for 2")])
def test_an_untrainable_scored_trajectory_refuses_its_group(reward: float, logprobs: list[float] | None,
                                                            why: str) -> None:
    """What an external scorer writes is checked on receipt: the bad trajectory never reaches a batch, and
    its dead letter names its group (the orchestrator withdraws it and dispatches a replacement)."""
    bad = _traj(f"{RUN}/bad", 0, 0, reward=reward)
    if logprobs is not None:
        bad = bad.replace(behaviour_logprobs=np.asarray(logprobs, dtype=np.float32))
    inputs = [InRecord(topics.SCORED, 0, k, None, r) for k, r in enumerate(
        [bad, *(_traj(g, i, 0) for g in (f"{RUN}/p0", f"{RUN}/p1") for i in range(4))])]
    ids = tuple(f"{RUN}/p{g}/{i}" for g in (0, 1) for i in range(4))
    inputs.append(InRecord(topics.SCHEDULE, 0, 0, None, BatchPlan(run_id=RUN, train_step=0, trajectory_ids=ids,
                                                                  ts_ms=0)))
    out = MemoryDriver(lambda: Assembler(RUN, CFG), inputs).run()
    letters = [o.record for o in out if o.topic == topics.DLQ]
    assert len(letters) == 1 and letters[0].group_id == f"{RUN}/bad" and letters[0].trajectory_id == f"{RUN}/bad/0"
    assert why in letters[0].reason and letters[0].error_type == "input"
    batches = [o.record for o in out if o.topic == topics.BATCHES]
    assert [t.trajectory_id for t in batches[0].trajectories] == list(ids)


def test_a_token_id_outside_the_recorded_vocabulary_is_refused_by_the_assembler_not_the_trainer() -> None:
    """With ``vocab_size`` recorded, a trajectory holding token id 64 of a 58-token vocabulary is dead-lettered
    on receipt (its group is replaced) and never reaches a batch the trainer would refuse whole."""
    import dataclasses

    bad = dataclasses.replace(_traj(f"{RUN}/p0", 3, 0), response_ids=np.asarray([7, 64], dtype=np.int32))
    records = [InRecord(topics.SCORED, 0, i, None, t) for i, t in enumerate(
        [_traj(f"{RUN}/p0", i, 0) for i in range(3)] + [bad])]
    for vocab, refused in ((0, 0), (58, 1)):
        cfg = dataclasses.replace(CFG, vocab_size=vocab)
        out = MemoryDriver(lambda cfg=cfg: Assembler(RUN, cfg), records).run()  # type: ignore[misc]
        letters = [o.record for o in out if o.topic == topics.DLQ]
        assert len(letters) == refused
        assert all("token id is outside [0, 58)" in d.reason and d.group_id == f"{RUN}/p0" for d in letters)


def test_the_launcher_records_the_models_vocabulary_and_the_trainer_checks_it(tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    import dataclasses

    from dora_rl.consumers.trainer.session import start_session
    from dora_rl.launcher import with_vocab_size

    monkeypatch.setenv("DORA_HOME", str(tmp_path))
    cfg = DoraConfig.from_dict({"model": "tiny:1m", "train_batch_size": 4, "group_size": 2,
                                "rollout_batch_size": 4, "weight_transport": "file"})
    recorded = with_vocab_size(cfg)
    assert recorded.vocab_size > 0 and with_vocab_size(dataclasses.replace(cfg, model=str(tmp_path / "no"))) == \
        dataclasses.replace(cfg, model=str(tmp_path / "no"))
    start_session(recorded, RUN, tmp_path / "ok", "t", "i").publisher.close()
    with pytest.raises(ValueError, match="vocab_size"):
        start_session(dataclasses.replace(recorded, vocab_size=recorded.vocab_size + 1), RUN, tmp_path / "x", "t", "i")
