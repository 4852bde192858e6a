"""The audit as a pure function of a run's records: it passes clean runs and catches each violation."""

from __future__ import annotations

import numpy as np

from dora_rl.config import DoraConfig
from dora_rl.consumers.audit import audit_records
from dora_rl.schemas.records import BucketEntry, DeadLetter, PolicyVersion, RolloutRequest, TrainBatch, Trajectory

CFG = DoraConfig.from_dict({"mode": "dora", "max_staleness": 1, "train_batch_size": 4, "rollout_batch_size": 4,
                            "group_size": 2, "steps": 2})


def req(tid: str, version: int) -> RolloutRequest:
    gid = tid.rsplit("/", 1)[0]
    z = np.zeros(0)
    return RolloutRequest(run_id="r", trajectory_id=tid, group_id=gid, prompt_id=gid, sample_index=0, group_size=2,
                          policy_version=version, instance_id="rollout-0", action="GENERATE", task="reverse",
                          reference="", prompt_ids=np.array([1]), partial_ids=z, partial_logprobs=z)


def traj(tid: str, version: int, instance_version: int | None = None, token_versions: list[int] | None = None
         ) -> Trajectory:
    gid = tid.rsplit("/", 1)[0]
    return Trajectory(run_id="r", trajectory_id=tid, group_id=gid, prompt_id=gid, sample_index=0, group_size=2,
                      policy_version=version, task="reverse", reference="", prompt_ids=np.array([1]),
                      response_ids=np.array([2, 3]), behaviour_logprobs=np.array([-1.0, -1.0]),
                      instance_version=version if instance_version is None else instance_version,
                      token_versions=None if token_versions is None else np.array(token_versions), reward=0.5)


def batch(step: int, trajs: list[Trajectory]) -> TrainBatch:
    return TrainBatch(run_id="r", batch_id=f"r/step{step}", train_step=step, base_version=step, max_staleness=1,
                      created_ms=0, trajectories=tuple(trajs))


def clean() -> tuple[list[RolloutRequest], list[Trajectory], list[TrainBatch]]:
    t = [traj("a/0", 0), traj("a/1", 0), traj("b/0", 0), traj("b/1", 0), traj("c/0", 1), traj("c/1", 1),
         traj("d/0", 0), traj("d/1", 0)]
    reqs = [req(x.trajectory_id, int(x.policy_version)) for x in t]
    return reqs, t, [batch(0, t[:4]), batch(1, t[4:])]


def test_clean_run_passes() -> None:
    rep = audit_records("r", CFG, *clean())
    assert rep.ok, rep.render()
    assert rep.staleness_histogram == {0: 6, 1: 2} and rep.max_staleness_seen == 1


def test_each_violation_is_caught() -> None:
    reqs, t, b = clean()
    assert audit_records("r", CFG, reqs, t, [batch(0, t[:4]), batch(1, t[4:6] + t[:2])]).c2_duplicated == 2
    assert audit_records("r", CFG, reqs[:-1], t, b).c2_not_dispatched == 1
    assert audit_records("r", CFG, reqs, t, [batch(0, t[:3] + t[6:7]), batch(1, t[3:6] + t[7:])]).c2_split_groups
    late = [batch(0, t[:4]), TrainBatch(**{**batch(1, t[4:]).__dict__, "base_version": 2, "train_step": 2})]
    assert audit_records("r", CFG, reqs, t, late).c3_over_stale == 2  # version 0 at step 2 with S = 1
    assert audit_records("r", CFG, reqs, t, [batch(0, t[:2])]).tbs_wrong_size == 1
    mixed = [traj("a/0", 0, token_versions=[0, 1]), *t[1:]]
    assert audit_records("r", CFG, reqs, mixed, b).c1_mixed_versions == 1
    wrong_instance = [traj("a/0", 0, instance_version=1), *t[1:]]
    assert audit_records("r", CFG, reqs, wrong_instance, b).c1_instance_mismatch == 1
    wrong_request = [req("a/0", 1), *reqs[1:]]
    assert audit_records("r", CFG, wrong_request, t, b).c1_request_mismatch >= 1
    assert not audit_records("r", CFG, reqs, t, []).ok  # a run without batches does not pass


def test_partial_mode_reports_c1_breaks_without_failing() -> None:
    cfg = DoraConfig.from_dict({**CFG.__dict__, "mode": "partial", "emulated": {}})
    reqs, t, b = clean()
    t[0] = traj("a/0", 0, instance_version=1, token_versions=[0, 1])
    b = [batch(0, t[:4]), batch(1, t[4:])]
    rep = audit_records("r", cfg, reqs, t, b)
    assert rep.c1_breaks_expected == 2 and rep.c1_mixed_versions == 0 and rep.ok


def ann(version: int, checksum: str = "aa", by: str = "TRAINER") -> PolicyVersion:
    return PolicyVersion(run_id="r", version=version, step=version, created_ms=0, transport="tcp", holders=("h",),
                         total_bytes=1, checksum_algo="xxh3_64", tensors=(),
                         buckets=(BucketEntry(index=0, nbytes=1, checksum=checksum),), announced_by=by)


def letter(t: Trajectory) -> DeadLetter:
    return DeadLetter(component="scorer", reason="reward timeout", error_type="reward",
                      source_topic="dora.rollout.trajectories", source_partition=0, source_offset=7, ts_ms=0,
                      run_id="r", key=None, value=t.encode()[0])


def test_a_run_short_of_its_steps_is_incomplete_never_pass() -> None:
    reqs, t, b = clean()
    rep = audit_records("r", CFG, reqs, t, b[:1])
    assert rep.verdict == "INCOMPLETE" and not rep.ok and rep.in_flight_at_end == 4, rep.render()
    assert "INCOMPLETE" in rep.render()


def test_missing_has_no_tolerance_and_refusals_are_accounted() -> None:
    reqs, t, b = clean()
    extra = [req("e/0", 1), req("e/1", 1)]  # dispatched, never batched, never refused
    rep = audit_records("r", CFG, [*reqs, *extra], t, b)
    assert rep.c2_missing == 2 and rep.verdict == "FAIL"
    refused = [traj("e/0", 1), traj("e/1", 1)]
    rep = audit_records("r", CFG, [*reqs, *extra], [*t, *refused], b, [letter(x) for x in refused])
    assert rep.c2_missing == 0 and rep.refused == 2 and rep.ok, rep.render()


def test_versions_one_checksum_each_only_going_up_and_every_batch_trained() -> None:
    reqs, t, b = clean()
    good = [ann(0), ann(1), ann(1, by="HOLDER"), ann(2)]
    assert audit_records("r", CFG, reqs, t, b, [], good).ok
    assert audit_records("r", CFG, reqs, t, b, [], [ann(0), ann(1), ann(1, "bb", "HOLDER"), ann(2)]
                         ).v_checksum_conflicts == 1
    assert audit_records("r", CFG, reqs, t, b, [], [ann(0), ann(1), ann(2), ann(1)]).v_not_increasing == 1
    assert audit_records("r", CFG, reqs, t, b, [], [ann(0), ann(1)]).c2_untrained_steps == 1
    assert audit_records("r", CFG, reqs, t, [*b, b[1]], [], good).c2_duplicate_steps == 1
