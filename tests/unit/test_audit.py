"""The audit as a pure function of a run's records: it passes clean runs and catches each violation."""

from __future__ import annotations

import numpy as np

from dora_rl.config import DoraConfig
from dora_rl.consumers.audit import audit_records
from dora_rl.schemas.records import (
    BucketEntry,
    DeadLetter,
    InstanceStatus,
    PolicyVersion,
    RolloutRequest,
    TokenChunk,
    TrainBatch,
    Trajectory,
)

CFG = DoraConfig.from_dict({"mode": "dora", "max_staleness": 1, "train_batch_size": 4, "rollout_batch_size": 4,
                            "group_size": 2, "steps": 2})


def req(tid: str, version: int) -> RolloutRequest:
    gid = tid.rsplit("/", 1)[0]
    z = np.zeros(0)
    return RolloutRequest(run_id="r", trajectory_id=tid, group_id=gid, prompt_id=gid, sample_index=0, group_size=2,
                          policy_version=version, instance_id="rollout-0", action="GENERATE", task="reverse",
                          reference="", prompt_ids=np.array([1]), partial_ids=z, partial_logprobs=z)


def traj(tid: str, version: int, instance_version: int | None = None, token_versions: list[int] | None = None,
         tokens: int = 2) -> Trajectory:
    gid = tid.rsplit("/", 1)[0]
    return Trajectory(run_id="r", trajectory_id=tid, group_id=gid, prompt_id=gid, sample_index=0, group_size=2,
                      policy_version=version, task="reverse", reference="", prompt_ids=np.array([1]),
                      response_ids=np.arange(tokens), behaviour_logprobs=np.full(tokens, -1.0),
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
    good = [ann(0), ann(1), ann(2)]
    assert audit_records("r", CFG, reqs, t, b, [], good, holders=[ann(1, by="HOLDER")]).ok
    assert audit_records("r", CFG, reqs, t, b, [], good, holders=[ann(1, "bb", "HOLDER")]).v_checksum_conflicts == 1
    # each topic carries one kind: a holder on the trainer's topic, or the reverse, is refused as every reader does
    wrong = audit_records("r", CFG, reqs, t, b, [], [*good, ann(1, "bb", "HOLDER")], holders=[ann(1, "cc")])
    assert wrong.ok and wrong.v_refused == 2 and wrong.v_checksum_conflicts == 0
    replay = audit_records("r", CFG, reqs, t, b, [], [ann(0), ann(1), ann(2), ann(1)])  # an earlier one again
    assert replay.ok and (replay.v_not_increasing, replay.v_replayed) == (0, 1), replay.render()
    assert audit_records("r", CFG, reqs, t, b, [], [ann(0), ann(2), ann(1)]).v_not_increasing == 1
    assert audit_records("r", CFG, reqs, t, b, [], [ann(0), ann(1)]).c2_untrained_steps == 1
    assert audit_records("r", CFG, reqs, t, [*b, b[1]], [], good).c2_duplicate_steps == 1


def chunk(tid: str, version: int, aborted: bool = False) -> TokenChunk:
    return TokenChunk(run_id="r", trajectory_id=tid, group_id=tid.rsplit("/", 1)[0], policy_version=version,
                      instance_id="rollout-0", start=0, token_ids=np.array([2]), logprobs=np.array([-1.0]),
                      aborted=aborted)


def heartbeat(held: int, in_flight: tuple[str, ...], instance: str = "rollout-1") -> InstanceStatus:
    return InstanceStatus(run_id="r", instance_id=instance, instance_index=int(instance[-1]), loaded_version=held,
                          state="BUSY", in_flight=len(in_flight), capacity=8, in_flight_ids=in_flight)


def group_letter(gid: str, reason: str = "engine failed", attempts: int = 3, run_id: str = "r",
                 component: str = "rollout-0") -> DeadLetter:
    return DeadLetter(component=component, reason=reason, error_type="engine",
                      source_topic="dora.rollout.requests", source_partition=0, source_offset=3, ts_ms=0,
                      run_id=run_id, group_id=gid, trajectory_id=f"{gid}/0", attempts=attempts)


def test_c1_is_checked_against_the_token_chunks() -> None:
    reqs, t, b = clean()
    same = [chunk(x.trajectory_id, int(x.policy_version)) for x in t]
    aborted = chunk("a/0", 1, aborted=True)  # a migration hand-off carries the request's version: not a break
    rep = audit_records("r", CFG, reqs, t, b, [], None, [*same, aborted])
    assert rep.ok and rep.c1_chunk_mismatch == 0 and rep.chunks_read == 9, rep.render()
    rep = audit_records("r", CFG, reqs, t, b, [], None, [*same, chunk("a/0", 1), chunk("a/0", 2)])
    assert rep.c1_chunk_mismatch == 1 and rep.verdict == "FAIL"  # counted per trajectory
    assert any("a/0" in e and "token chunks" in e for e in rep.examples)
    rep = audit_records("r", CFG, reqs, t, b, [], None, [chunk("zz/0", 5)])  # not a batched trajectory
    assert rep.c1_chunk_mismatch == 0


def test_c1_is_checked_against_the_heartbeats() -> None:
    reqs, t, b = clean()
    good = [heartbeat(0, ("a/0", "a/1")), heartbeat(1, ("c/0",), "rollout-0"), heartbeat(-1, ())]
    rep = audit_records("r", CFG, reqs, t, b, [], None, (), good)
    assert rep.ok and rep.c1_heartbeat_mismatch == 0 and rep.heartbeats_read == 3, rep.render()
    bad = [*good, heartbeat(1, ("a/0", "b/1"), "rollout-0"), heartbeat(2, ("a/0",))]  # a/0 and b/1 are v0
    rep = audit_records("r", CFG, reqs, t, b, [], None, (), bad)
    assert rep.c1_heartbeat_mismatch == 2 and rep.verdict == "FAIL"
    assert "c1_heartbeat_mismatch = 2" in rep.render()


def test_partial_mode_counts_chunk_and_heartbeat_breaks_as_expected() -> None:
    cfg = DoraConfig.from_dict({**CFG.__dict__, "mode": "partial", "emulated": {}})
    reqs, t, b = clean()
    rep = audit_records("r", cfg, reqs, t, b, [], None, [chunk("a/0", 1)], [heartbeat(1, ("b/0",))])
    assert rep.c1_breaks_expected == 2 and rep.c1_chunk_mismatch == rep.c1_heartbeat_mismatch == 0 and rep.ok


def test_refused_groups_are_accounted_and_listed_with_their_reason() -> None:
    reqs, t, b = clean()
    extra = [req("e/0", 1), req("e/1", 1)]  # a group the engine failed on: withdrawn, never batched
    generated = [*t, traj("e/1", 1, tokens=5)]  # one sibling was generated before the group was withdrawn
    letters = [group_letter("e"), group_letter("e", "engine failed"), group_letter("e", "out of memory"),
               group_letter("f", run_id="other")]  # another run's letter is not this run's refusal
    rep = audit_records("r", CFG, [*reqs, *extra], generated, b, letters)
    assert rep.c2_missing == 0 and rep.ids_unbalanced == 0 and rep.ok, rep.render()
    assert rep.refused_groups == [{"group_id": "e", "trajectory_id": "e/0", "component": "rollout-0",
                                   "error_type": "engine", "reason": "engine failed; out of memory",
                                   "attempts": 3}]
    assert rep.ids_by_version[1] == {"generated": 3, "trained": 2, "refused": 1}
    assert rep.waste_tokens == 5 and rep.waste_trajectories == 0
    assert "refused e (e/0) by rollout-0:engine after 3 attempts: engine failed; out of memory" in rep.render()
    assert rep.to_dict()["refused_groups"][0]["reason"] == "engine failed; out of memory"
    rep = audit_records("r", CFG, [*reqs, *extra], generated, b, letters[3:])  # not refused in this run
    assert rep.c2_missing == 2 and rep.ids_unbalanced == 1 and rep.refused_groups == [] and not rep.ok


def test_a_refused_group_that_was_trained_counts_as_batched() -> None:
    reqs, t, b = clean()
    rep = audit_records("r", CFG, reqs, t, b, [group_letter("a", "reward timeout")])  # a duplicate copy's refusal
    assert rep.refused_but_trained == 1 and rep.ok and rep.waste_tokens == 0, rep.render()
    assert rep.ids_by_version[0] == {"generated": 6, "trained": 6, "refused": 0}


def test_ids_balance_generated_trained_refused() -> None:
    reqs, t, b = clean()
    stray = traj("e/0", 1)  # generated (never requested here), neither trained nor refused
    rep = audit_records("r", CFG, reqs, [*t, stray], b)
    assert rep.ids_unbalanced == 1 and rep.verdict == "FAIL"
    assert rep.ids_by_version[1] == {"generated": 3, "trained": 2, "refused": 0}
    rep = audit_records("r", CFG, reqs, t[1:], b)  # a/0 trained but never generated
    assert rep.ids_unbalanced == 1 and rep.verdict == "FAIL"
    assert rep.ids_by_version[0] == {"generated": 5, "trained": 6, "refused": 0}
    rep = audit_records("r", CFG, reqs, [*t, stray], b[:1])  # a run that did not finish: reported only
    assert rep.ids_unbalanced == 0 and rep.verdict == "INCOMPLETE"
    assert rep.ids_by_version == {0: {"generated": 6, "trained": 4, "refused": 0},
                                  1: {"generated": 3, "trained": 0, "refused": 0}}


def test_regenerated_trajectories_are_counted_apart_as_waste() -> None:
    reqs, t, b = clean()
    again = [traj("a/0", 0, tokens=7), traj("a/0", 0, tokens=3), traj("c/1", 1, tokens=4)]  # after crashes
    rep = audit_records("r", CFG, reqs, [*t, *again], b)
    assert rep.waste_trajectories == 3 and rep.waste_tokens == 14 and rep.ok, rep.render()
    assert rep.ids_by_version[0]["generated"] == 6  # distinct ids
    assert "waste: 3 regenerated trajectories, 14 tokens" in rep.render()


def test_a_trained_trajectory_no_instance_generated_fails_the_audit() -> None:
    """A scored copy planted by another writer (same id, other tokens) and trained: FAIL (issue 32)."""
    reqs, t, b = clean()
    planted = t[0].replace(response_ids=np.array([7, 7, 7], dtype=np.int32))
    rep = audit_records("r", CFG, reqs, t, [batch(0, [planted, *t[1:4]]), b[1]])
    assert rep.w_not_as_generated == 1 and rep.verdict == "FAIL"
    assert any("a/0" in e and "no instance generated" in e for e in rep.examples)
    regenerated = t[0].replace(response_ids=np.array([7, 7, 7], dtype=np.int32))  # a second generated copy
    assert audit_records("r", CFG, reqs, [*t, regenerated], [batch(0, [planted, *t[1:4]]), b[1]]).ok


def test_a_repeated_announcement_is_a_replay_and_a_new_lower_version_a_violation() -> None:
    """Issue 31: an earlier announcement sent again (a replay: same version and checksums) after a newer one is
    reported, since every reader keeps the newest; a version never announced before, below the newest, fails."""
    from dora_rl.consumers.audit import AuditReport, audit_versions
    from dora_rl.schemas.records import PolicyVersion

    def ann(v: int) -> PolicyVersion:
        return PolicyVersion(run_id="r", version=v, step=v, created_ms=0, transport="tcp", holders=("h:1",),
                             total_bytes=0, checksum_algo="xxh3_64", tensors=(), buckets=())

    replayed = AuditReport("r", "dora", 1, 4)
    assert audit_versions(replayed, [ann(0), ann(1), ann(2), ann(0)]) == {0, 1, 2}
    assert (replayed.v_replayed, replayed.v_not_increasing) == (1, 0)
    regressed = AuditReport("r", "dora", 1, 4)
    audit_versions(regressed, [ann(0), ann(2), ann(1)])
    assert (regressed.v_replayed, regressed.v_not_increasing) == (0, 1)
