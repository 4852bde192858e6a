"""Scores are the scorer's and refusals the run's (decision 0059): the assembler trains only scores signed with
the scorer key, the orchestrator withdraws a group only on a refusal signed with the run's token, the roles sign
what they write, and the audit FAILs a run that trained an unsigned score. Plans and batches are the run's
(decision 0060): the assembler follows, and the trainer trains, only those signed with its token. No broker:
processors in memory."""

from __future__ import annotations

import numpy as np
import pytest

from dora_rl.config import DoraConfig
from dora_rl.consumers.audit import audit_records
from dora_rl.core.rewards import RewardError
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.signing import mac, signature_problem, signed
from dora_rl.schemas.records import (
    BatchPlan,
    DeadLetter,
    PolicyVersion,
    Prompt,
    RolloutRequest,
    TokenChunk,
    TrainBatch,
    Trajectory,
)
from dora_rl.streams.assembler import Assembler
from dora_rl.streams.orchestrator import Orchestrator
from dora_rl.streams.processor import Context, InRecord, OutRecord
from dora_rl.streams.reward_scorer import Scorer
from dora_rl.streams.scheduling_events import Aborted

RUN, KEY, TOKEN = "r1", "the scorer's key", "the run's token"
CFG = DoraConfig.from_dict({"mode": "sync", "max_staleness": 0, "steps": 1, "train_batch_size": 4, "group_size": 4,
                            "rollout_batch_size": 4, "engine": "emulated"})


def _traj(i: int, reward: float | None = None, gid: str = f"{RUN}/p0") -> Trajectory:
    return Trajectory(run_id=RUN, trajectory_id=f"{gid}/{i}", group_id=gid, prompt_id=gid, sample_index=i,
                      group_size=4, policy_version=0, task="reverse", reference="ab",
                      prompt_ids=np.asarray([5, 6], dtype=np.int32), response_ids=np.asarray([7, 2], dtype=np.int32),
                      behaviour_logprobs=np.asarray([-0.5, -0.1], dtype=np.float32), reward=reward, instance_version=0)


def _ctx() -> Context:
    return Context(lambda refs: {}, lambda: 0.0, lambda: 0)


@pytest.mark.parametrize("kept_bytes", [False, True])
def test_a_score_written_into_kept_bytes_is_signed_as_a_fresh_encoding_would_be(kept_bytes: bool) -> None:
    traj = _traj(0)
    if kept_bytes:
        traj = Trajectory.decode(*traj.encode(), keep_wire=True)
    out = traj.scored(0.75, 123, KEY)
    back = Trajectory.decode(*out.encode())
    assert (back.reward, back.scored_ms, back.signature) == (0.75, 123, out.signature)
    assert out.signature == mac(out, KEY) and signature_problem(back, KEY, "score") is None
    assert signature_problem(back, "another key", "score") is not None
    assert traj.scored(0.75, 123).signature is None  # no key: unsigned, as before


def test_the_scorer_signs_its_scores_with_its_key_and_its_refusals_with_the_token() -> None:
    def score(batch: object) -> list[float | RewardError]:
        return [0.5, RewardError("raised", "boom", "reverse")]

    scorer = Scorer(RUN, 4, score, max_attempts=1, scorer_key=KEY, token=TOKEN)
    ctx = _ctx()
    for i in range(2):
        scorer.process(InRecord(topics.TRAJECTORIES, 0, i, None, signed(_traj(i), TOKEN)), ctx)
    scorer.punctuate(0.0, ctx)
    out = {o.topic: o.record for o in ctx.take() if o.topic in (topics.SCORED, topics.DLQ)}
    assert signature_problem(out[topics.SCORED], KEY, "score") is None
    assert signature_problem(out[topics.DLQ], TOKEN, "refusal") is None and out[topics.DLQ].group_id


@pytest.mark.parametrize("key", ["", "another run's token"])
def test_the_scorer_does_not_score_a_trajectory_no_instance_of_the_run_signed(key: str) -> None:
    """Decision 0062: injected on dora.rollout.trajectories (another run's rollout principal may write it), a
    copy with other tokens would be scored and signed, then trained: it is refused unscored, naming no group."""
    scorer = Scorer(RUN, 4, lambda batch: [1.0] * len(batch), scorer_key=KEY, token=TOKEN)
    ctx = _ctx()
    scorer.process(InRecord(topics.TRAJECTORIES, 0, 3, None, signed(_traj(0), key)), ctx)
    scorer.punctuate(0.0, ctx)
    out = [o for o in ctx.take() if o.topic in (topics.SCORED, topics.DLQ)]
    assert [(o.topic, o.record.source_offset, o.record.error_type, o.record.group_id) for o in out] == [
        (topics.DLQ, 3, "signature", None)]


def test_the_orchestrator_counts_no_completion_from_a_trajectory_no_instance_of_the_run_signed() -> None:
    orch, ctx, gid = _dispatched_orchestrator()
    orch.process(InRecord(topics.TRAJECTORIES, 0, 9, None, _traj(0, gid=gid)), ctx)
    letters = [o.record for o in ctx.take() if o.topic == topics.DLQ]
    assert [(d.source_topic, d.source_offset, d.error_type) for d in letters] == [(topics.TRAJECTORIES, 9, "signature")]
    orch.process(InRecord(topics.TRAJECTORIES, 0, 10, None, signed(_traj(0, gid=gid), TOKEN)), ctx)
    assert not [o for o in ctx.take() if o.topic == topics.DLQ]


@pytest.mark.parametrize("key", ["", "another run's token"])
def test_the_orchestrator_resumes_no_partial_the_run_did_not_sign(key: str) -> None:
    """An aborted chunk (a migrating trajectory's partial response, decision 0065) is resumed only when an
    instance of the run signed it: a forged one would plant tokens of its writer's choice into a trajectory."""
    orch, ctx, gid = _dispatched_orchestrator()
    seen: list[str] = []
    handle = orch.rules.handle
    orch.rules.handle = lambda e: seen.append(e.trajectory_id) if isinstance(e, Aborted) else handle(e)  # type: ignore[method-assign]
    chunk = TokenChunk(run_id=RUN, trajectory_id=f"{gid}/0", group_id=gid, policy_version=0, instance_id="rollout-0",
                       start=0, token_ids=np.asarray([9, 9], dtype=np.int32),
                       logprobs=np.asarray([-0.1, -0.1], dtype=np.float32), final=True, aborted=True)
    orch.process(InRecord(topics.TOKENS, 1, 4, None, signed(chunk, key) if key else chunk), ctx)
    letters = [o.record for o in ctx.take() if o.topic == topics.DLQ]
    assert not seen and [(d.source_topic, d.source_offset, d.error_type) for d in letters] == [
        (topics.TOKENS, 4, "signature")]
    orch.process(InRecord(topics.TOKENS, 1, 5, None, signed(chunk, TOKEN)), ctx)
    assert seen == [f"{gid}/0"] and not [o for o in ctx.take() if o.topic == topics.DLQ]


def _assemble(records: list[InRecord]) -> list[OutRecord]:
    asm, ctx = Assembler(RUN, CFG, scorer_key=KEY, token=TOKEN), _ctx()
    for rec in records:
        asm.process(rec, ctx)
    asm.punctuate(0.0, ctx)
    return ctx.take()


def test_the_assembler_trains_the_scorers_copy_not_a_reward_planted_before_it() -> None:
    """A copy of a real id with reward 1.0 arrives first, unsigned (or signed with another key): refused with a
    letter that names no group (the planter cannot withdraw it), and the scorer's copy is trained."""
    planted = [InRecord(topics.SCORED, 0, 0, None, _traj(0, 1.0)),
               InRecord(topics.SCORED, 0, 1, None, signed(_traj(1, 1.0), "not the scorer's key"))]
    real = [InRecord(topics.SCORED, 0, 2 + i, None, _traj(i).scored(0.25, 1, KEY)) for i in range(4)]
    out = _assemble([*planted, *real, _plan(0, TOKEN)])
    letters = [o.record for o in out if o.topic == topics.DLQ]
    assert [(d.source_offset, d.error_type, d.group_id) for d in letters] == [(0, "signature", None),
                                                                            (1, "signature", None)]
    batch = next(o.record for o in out if o.topic == topics.BATCHES)
    assert [t.reward for t in batch.trajectories] == [0.25] * 4


def _plan(offset: int, key: str, group: str = "p0") -> InRecord:
    plan = BatchPlan(run_id=RUN, train_step=0, ts_ms=0, trajectory_ids=tuple(f"{RUN}/{group}/{i}" for i in range(4)))
    return InRecord(topics.SCHEDULE, 0, offset, None, signed(plan, key))


def test_the_assembler_follows_the_orchestrators_plan_and_signs_the_batch_for_the_trainer() -> None:
    """A plan of step 0 naming group p1, not signed with the run's token, arrives first: refused (a letter naming
    no group); the genuine plan (group p0) is followed, and the batch is signed with the token."""
    scored = [InRecord(topics.SCORED, 0, i + 4 * (g == "p1"), None, _traj(i, gid=f"{RUN}/{g}").scored(0.25, 1, KEY))
              for g in ("p0", "p1") for i in range(4)]
    out = _assemble([*scored, _plan(0, "another run's token", "p1"), _plan(1, TOKEN)])
    assert [(o.record.source_topic, o.record.error_type, o.record.group_id) for o in out if o.topic == topics.DLQ] == [
        (topics.SCHEDULE, "signature", None)]
    batch = next(o.record for o in out if o.topic == topics.BATCHES)
    assert {t.group_id for t in batch.trajectories} == {f"{RUN}/p0"}
    decoded = TrainBatch.decode(*batch.encode())
    assert signature_problem(decoded, TOKEN, "batch") is None and signature_problem(decoded, KEY, "batch")


def test_the_trainer_refuses_a_batch_not_signed_with_the_token_and_trains_the_genuine_one() -> None:
    from types import SimpleNamespace

    from dora_rl.consumers.trainer.session import Refuse, TrainerSession

    session = TrainerSession(CFG, SimpleNamespace(), SimpleNamespace(), None, "i", token=TOKEN)  # type: ignore[arg-type]
    _, _, (batch,) = _one_step(KEY)
    for forged in (batch.replace(signature=None), signed(batch.replace(signature=None), "another run's token")):
        verdict = session.check(TrainBatch.decode(*forged.encode()))
        assert isinstance(verdict, Refuse) and verdict.kind == "signature", verdict
    assert session.check(TrainBatch.decode(*batch.encode())) is None


def test_the_assembler_without_a_key_checks_nothing() -> None:
    asm, ctx = Assembler(RUN, CFG), _ctx()
    asm.process(InRecord(topics.SCORED, 0, 0, None, _traj(0, 1.0)), ctx)
    assert asm.refs and not ctx.take()


def _dispatched_orchestrator() -> tuple[Orchestrator, Context, str]:
    orch, ctx = Orchestrator(RUN, CFG, TOKEN), _ctx()
    prompt = Prompt(run_id=RUN, group_id=f"{RUN}/p0", prompt_id=f"{RUN}/p0", task="reverse", prompt_text="ab",
                    reference="ba", prompt_ids=np.asarray([5, 6], dtype=np.int32))
    v0 = PolicyVersion(run_id=RUN, version=0, step=0, created_ms=0, transport="tcp", holders=("h",), total_bytes=0,
                       checksum_algo="xxh3_64", tensors=(), buckets=())
    orch.process(InRecord(topics.VERSIONS, 0, 0, None, signed(v0, TOKEN)), ctx)
    orch.process(InRecord(topics.PROMPTS, 0, 0, None, prompt), ctx)
    orch.punctuate(0.0, ctx)
    assert any(isinstance(o.record, RolloutRequest) for o in ctx.take()), "the group must be dispatched"
    return orch, ctx, prompt.group_id


def _refusal(group_id: str) -> DeadLetter:
    return DeadLetter(component="rollout-0", reason="x", error_type="engine", source_topic=topics.REQUESTS,
                      source_partition=0, source_offset=0, ts_ms=0, run_id=RUN, group_id=group_id,
                      trajectory_id=f"{group_id}/0")


@pytest.mark.parametrize("key", ["", "another run's token"])
def test_a_refusal_not_signed_with_the_token_withdraws_nothing_and_is_dead_lettered(key: str) -> None:
    orch, ctx, gid = _dispatched_orchestrator()
    orch.process(InRecord(topics.DLQ, 0, 5, None, signed(_refusal(gid), key)), ctx)
    orch.punctuate(1.0, ctx)
    out = ctx.take()
    assert orch.rules.refused_groups == 0 and gid in orch.prompts  # type: ignore[attr-defined]
    assert not any(o.topic == topics.REQUESTS for o in out), "no replacement may be dispatched"
    letters = [o.record for o in out if o.topic == topics.DLQ]
    assert [(d.source_topic, d.source_offset, d.error_type, d.group_id) for d in letters] == [
        (topics.DLQ, 5, "signature", None)]


def test_a_refusal_signed_with_the_token_withdraws_the_group() -> None:
    orch, ctx, gid = _dispatched_orchestrator()
    orch.process(InRecord(topics.DLQ, 0, 5, None, signed(_refusal(gid), TOKEN)), ctx)
    orch.punctuate(1.0, ctx)
    assert gid not in orch.prompts, "the refused group must be withdrawn"


def _one_step(reward_key: str, refused_group: bool = False) -> tuple[list[RolloutRequest], list[Trajectory],
                                                                     list[TrainBatch]]:
    """One step's records: group p0 trained (scores signed with ``reward_key``); with ``refused_group``, group p9
    dispatched as well and generated, never trained."""
    generated = [signed(t, TOKEN) for t in [_traj(i) for i in range(4)]
                 + [_traj(i, gid=f"{RUN}/p9") for i in range(4 if refused_group else 0)]]
    requests = [RolloutRequest(run_id=RUN, trajectory_id=t.trajectory_id, group_id=t.group_id, prompt_id=t.prompt_id,
                               sample_index=t.sample_index, group_size=4, policy_version=0, instance_id="rollout-0",
                               action="GENERATE", task="reverse", reference="ab", prompt_ids=t.prompt_ids,
                               partial_ids=t.prompt_ids[:0], partial_logprobs=t.behaviour_logprobs[:0])
                for t in generated]
    scored = tuple(t.scored(0.5, 1, reward_key) for t in generated[:4])
    batch = signed(TrainBatch(run_id=RUN, batch_id=f"{RUN}/step0", train_step=0, base_version=0, max_staleness=0,
                              created_ms=0, trajectories=scored), TOKEN)
    return requests, generated, [batch]


def test_the_audit_fails_a_run_that_trained_a_score_the_scorer_did_not_sign() -> None:
    genuine = audit_records(RUN, CFG, *_one_step(KEY), scorer_key=KEY)
    assert genuine.verdict == "PASS" and genuine.w_unsigned_score == 0, genuine.render()
    planted = audit_records(RUN, CFG, *_one_step("not the scorer's key"), scorer_key=KEY)
    assert planted.verdict == "FAIL" and planted.w_unsigned_score == 4, planted.render()
    assert audit_records(RUN, CFG, *_one_step(""), scorer_key="").verdict == "PASS"  # no key: not checked


def test_the_audit_counts_only_signed_refusals_given_the_token() -> None:
    """A forged refusal of a group that was lost would hide the loss: with the token it is not a refusal, so the
    untrained group is C2 missing."""
    records = _one_step(KEY, refused_group=True)
    for letter, verdict in ((signed(_refusal(f"{RUN}/p9"), TOKEN), "PASS"), (_refusal(f"{RUN}/p9"), "FAIL")):
        rep = audit_records(RUN, CFG, *records, [letter], token=TOKEN)
        assert rep.verdict == verdict, rep.render()


def test_the_audit_counts_only_batches_signed_with_the_token_given_it() -> None:
    """An unsigned, empty batch of the run's step is not trained by the trainer: the audit, given the token, does
    not count it either (else it would read as a second, wrong-sized batch of that step)."""
    requests, generated, (batch,) = _one_step(KEY)
    forged = batch.replace(trajectories=(), batch_id=f"{RUN}/forged", signature=None)
    rep = audit_records(RUN, CFG, requests, generated, [batch, forged], token=TOKEN)
    assert rep.verdict == "PASS", rep.render()
    assert audit_records(RUN, CFG, requests, generated, [batch, forged]).verdict == "FAIL"


@pytest.mark.parametrize("signature_key", ["", "k"])
def test_what_a_signature_covers_is_the_same_from_kept_bytes_as_from_a_fresh_encoding(signature_key: str) -> None:
    """``Record.unsigned_encoding`` cuts the signature off kept bytes instead of encoding again: the same bytes,
    for every signed record kind, decoded with and without its bytes kept."""
    records = [_traj(0), BatchPlan(run_id=RUN, train_step=1, trajectory_ids=("a", "b"), ts_ms=3), _refusal("g"),
               _one_step(KEY)[2][0].replace(signature=None)]
    for rec in records:
        value, headers = signed(rec, signature_key).encode()
        for decoded in (type(rec).decode(value, headers, keep_wire=True), type(rec).decode(value, headers)):
            assert decoded.unsigned_encoding() == rec.replace(signature=None).encode()[0], type(rec).__name__
