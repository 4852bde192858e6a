"""The orchestrator processor crashes at every record boundary and restores to identical output.

A closed-loop world (instances finish requests after a pseudo-random delay, abort what is cancelled,
the trainer consumes planned batches and publishes the next version) records the input the
orchestrator sees; the in-memory driver then replays that input with a crash (and restore from the
last committed snapshot) at each boundary and must commit exactly the uninterrupted run's output.
"""

from __future__ import annotations

import heapq
import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from dora_rl.config import DoraConfig
from dora_rl.infra.kafka import topics
from dora_rl.schemas.records import PolicyVersion, Prompt, TokenChunk
from dora_rl.streams.orchestrator import Orchestrator
from dora_rl.streams.processor import Context, InRecord, MemoryDriver, OutRecord, Ref

RUN = "r1"
POISON = f"{RUN}/p3/1"  # its reward fails: the group is refused and replaced


def _cfg(mode: str, s: int, policy: str = "migrate") -> DoraConfig:
    tbs, g = 8, 4
    return DoraConfig.from_dict({"mode": mode, "max_staleness": s, "steps": 5, "train_batch_size": tbs,
                                 "group_size": g, "rollout_batch_size": tbs * (s + 1), "num_instances": 2,
                                 "instance_concurrency": 6, "engine": "emulated", "repartition_s": 3.0,
                                 "instance_timeout_s": 5.0, "repartition_policy": policy})


ELASTIC = ("dora", "partial", "partial_unbounded")  # instances come and go: instance 1 is lost, instance 2 joins
LOST_AT, JOIN_AT = 6.0, 12.0


def _prompt(i: int) -> Prompt:
    return Prompt(run_id=RUN, prompt_id=f"p{i}", group_id=f"{RUN}/p{i}", task="reverse", prompt_text="ab=",
                  prompt_ids=np.asarray([5, 6, 7], dtype=np.int32), reference="ba")


def _record_world(config: DoraConfig, seed: int, extra_prompts: int = 0) -> tuple[list[InRecord], list[float]]:
    """Run the orchestrator uninterrupted in a closed loop; return the input it saw, with times (``extra_prompts``
    more than the run needs are in the dataset, all written at the start)."""
    rng = random.Random(seed)
    orch = Orchestrator(RUN, config)
    log: list[InRecord] = []
    times: list[float] = []
    offsets: dict[str, int] = {}
    events: list[tuple[float, int, str, Any]] = []
    seq = [0]

    def push(t: float, topic: str, rec: Any) -> None:
        heapq.heappush(events, (t, seq[0], topic, rec))
        seq[0] += 1

    ctx = Context(lambda refs: {}, lambda: now[0], lambda: int(now[0] * 1000))
    now = [0.0]
    n_prompts = (config.steps * config.train_batch_size + config.rollout_batch_size) // config.group_size
    for i in range(n_prompts + extra_prompts):
        push(0.0, topics.PROMPTS, _prompt(i))
    push(0.0, topics.VERSIONS, SimpleNamespace(version=0, holders=("h",), announced_by="TRAINER"))
    elastic = config.mode in ELASTIC
    for i in range(3):
        push(0.0, "beat", i)
    running: dict[str, tuple[float, str]] = {}  # tid -> (finish time, token marker)
    where: dict[str, int] = {}  # tid -> instance it was sent to
    while events:
        t, _, topic, rec = heapq.heappop(events)
        now[0] = t
        if topic == "beat":  # heartbeats every 2 s; instance 1 vanishes at LOST_AT, instance 2 joins at JOIN_AT
            i = rec
            push(t + 2.0, "beat", i)
            if (elastic and ((i == 1 and t >= LOST_AT) or (i == 2 and t < JOIN_AT))) or (not elastic and i == 2):
                continue
            topic, rec = topics.INSTANCES, SimpleNamespace(instance_index=i, state="IDLE")
        elif topic == "finish":  # an instance finished (unless the request was cancelled meanwhile)
            tid, marker = rec
            if running.get(tid, (0, ""))[1] != marker:
                continue
            if elastic and where[tid] == 1 and t >= LOST_AT:
                continue  # its host is gone: this never finishes
            del running[tid]
            topic, rec = topics.TRAJECTORIES, SimpleNamespace(trajectory_id=tid, prompt_ids=[1] * 4,
                                                              response_ids=[1] * (8 + sum(map(ord, tid)) % 9))
            push(t + 0.2, "score", tid)
        elif topic == "score":  # the scorer: a reward, or (the poison trajectory) a refusal of its group
            topic, rec = ((topics.DLQ, SimpleNamespace(group_id=rec.rsplit("/", 1)[0], component="scorer",
                                                       reason="reward function raised"))
                          if rec == POISON else (topics.SCORED, SimpleNamespace(trajectory_id=rec)))
        part = 0
        offsets[topic] = offsets.get(topic, -1) + 1
        inrec = InRecord(topic, part, offsets[topic], None, rec)
        log.append(inrec)
        times.append(t)
        orch.process(inrec, ctx)
        orch.punctuate(t, ctx)
        for o in ctx.take():
            if o.topic == topics.REQUESTS and o.record.action == "GENERATE":
                assert not (elastic and o.partition == 1 and t >= LOST_AT + 5.0), "work sent to a lost instance"
                where[o.record.trajectory_id] = o.partition
                marker = f"{o.record.trajectory_id}@{t}"
                running[o.record.trajectory_id] = (t, marker)
                push(t + rng.choice([0.5, 1.0, 1.5, 6.0]), "finish", (o.record.trajectory_id, marker))
            elif o.topic == topics.REQUESTS and o.record.action == "CANCEL":
                tid = o.record.trajectory_id
                running.pop(tid, None)
                push(t + 0.1, topics.TOKENS, TokenChunk(
                    run_id=RUN, trajectory_id=tid, group_id=o.record.group_id,
                    policy_version=o.record.policy_version, instance_id=o.record.instance_id, start=0,
                    token_ids=np.asarray([9, 9], dtype=np.int32), logprobs=np.asarray([-0.5, -0.5], dtype=np.float32),
                    final=True, aborted=True))
            elif o.topic == topics.SCHEDULE:
                step = o.record.train_step
                batch = SimpleNamespace(train_step=step, trajectories=[
                    SimpleNamespace(trajectory_id=tid, group_id=tid.rsplit("/", 1)[0])
                    for tid in o.record.trajectory_ids])
                push(t + 2.0, topics.BATCHES, batch)
                push(t + 2.5, topics.VERSIONS, SimpleNamespace(version=step + 1, holders=("h",),
                                                               announced_by="TRAINER"))
        if orch.done():
            break
    assert orch.done(), "the recorded world must complete the run"
    assert any(r.topic == topics.DLQ for r in log), "the poison trajectory was never generated"
    if elastic:
        assert any(v == 2 for v in where.values()), "the newcomer got no work"
    return log, times


def _wire(outs: list[OutRecord]) -> list[tuple[str, str, int | None, bytes]]:
    """Outputs as bytes on the wire; a metric's value is a measured CPU time, so only its name counts."""
    return [(o.topic, o.key, o.partition, b"" if o.topic == topics.METRICS else o.record.encode()[0])
            for o in outs]


@pytest.mark.parametrize(("mode", "s", "seed", "policy"), [("dora", 1, 0, "migrate"), ("dora", 2, 1, "migrate"),
                                                           ("sync", 0, 2, "migrate"),
                                                           ("partial_unbounded", 0, 3, "migrate"),
                                                           ("partial", 1, 3, "migrate"),
                                                           ("dora", 1, 1, "drain"), ("dora", 2, 0, "drain"),
                                                           ("dora", 2, 1, "consolidate")])
def test_crash_at_every_record_boundary_gives_the_uninterrupted_output(mode: str, s: int, seed: int,
                                                                       policy: str) -> None:
    config = _cfg(mode, s, policy)
    inputs, times = _record_world(config, seed)
    factory = lambda: Orchestrator(RUN, config)  # noqa: E731
    clean = MemoryDriver(factory, inputs, times).run()
    assert any(o.topic == topics.SCHEDULE for o in clean)
    if mode in ELASTIC:
        refused = {r.record.group_id for r in inputs if r.topic == topics.DLQ}  # its members are cancelled
        migrations = any(o.topic == topics.REQUESTS and o.record.action == "CANCEL" and o.record.group_id not in refused
                         for o in clean)
        if policy != "consolidate":  # consolidation moves work only when its rules call for it
            assert migrations == (policy == "migrate"), "a drain cancels nothing but a refused group; a migration does"
        assert any(o.topic == topics.METRICS and o.record.name == "redispatched" for o in clean), "no re-dispatch"
    if policy == "drain":  # instances drained: snapshots carried the draining set through every crash
        versions_of = {}
        for o in clean:
            if o.topic == topics.REQUESTS and o.record.action == "GENERATE":
                versions_of.setdefault(o.partition, []).append(o.record.policy_version)
        assert any(len(set(v)) > 1 for v in versions_of.values()), "no instance ever switched version"
    for k in range(1, len(inputs)):
        driver = MemoryDriver(factory, inputs, times, commit_every=3)
        crashed = driver.run(crash_after=[k])
        assert _wire(crashed) == _wire(clean), f"crash after record {k} changed the committed output"
    many = MemoryDriver(factory, inputs, times, commit_every=2)
    assert _wire(many.run(crash_after=range(1, len(inputs), 7))) == _wire(clean)
    assert many.restores > 1


def test_restore_fails_loudly_when_a_referenced_record_is_gone() -> None:
    config = _cfg("dora", 1)
    inputs, times = _record_world(config, 0)
    driver = MemoryDriver(lambda: Orchestrator(RUN, config), inputs[:20], times[:20])
    driver.run()
    assert driver.committed.snapshot is not None
    fresh = Orchestrator(RUN, config)
    empty = Context(lambda refs: (_ for _ in ()).throw(LookupError(f"gone: {list(refs)[:1]}")), lambda: 0.0)
    with pytest.raises(LookupError, match="gone"):
        fresh.restore(driver.committed.snapshot, empty)


def test_snapshot_holds_references_not_payloads() -> None:
    config = _cfg("dora", 1)
    inputs, times = _record_world(config, 0)
    driver = MemoryDriver(lambda: Orchestrator(RUN, config), inputs[:40], times[:40])
    driver.run()
    snap = driver.committed.snapshot or b""
    assert b"prompt_text" not in snap and b"ab=" not in snap
    assert Ref(topics.PROMPTS, 0, 0).to_list()[0].encode() in snap


def test_versions_are_records_too() -> None:  # the world above feeds stand-ins; the real record works the same
    orch = Orchestrator(RUN, _cfg("dora", 1))
    ctx = Context(lambda refs: {}, lambda: 0.0, lambda: 0)
    ann = PolicyVersion(run_id=RUN, version=0, step=0, created_ms=0, transport="tcp", holders=("h",),
                        total_bytes=0, checksum_algo="xxh3_64", tensors=(), buckets=())
    orch.process(InRecord(topics.VERSIONS, 0, 0, None, ann), ctx)
    orch.process(InRecord(topics.PROMPTS, 0, 0, None, _prompt(0)), ctx)
    orch.punctuate(0.0, ctx)
    assert [o.record.policy_version for o in ctx.take() if o.topic == topics.REQUESTS] == [0] * 4


@pytest.mark.parametrize(("mode", "s"), [("dora", 1), ("sync", 0)])
def test_a_refused_group_is_withdrawn_and_replaced_so_every_batch_stays_exact(mode: str, s: int) -> None:
    config = _cfg(mode, s)
    inputs, times = _record_world(config, 5)
    out = MemoryDriver(lambda: Orchestrator(RUN, config), inputs, times).run()
    plans = [o.record for o in out if o.topic == topics.SCHEDULE]
    assert [p.train_step for p in plans] == list(range(config.steps))
    refused = POISON.rsplit("/", 1)[0]
    for p in plans:
        assert len(p.trajectory_ids) == config.train_batch_size
        assert not any(t.startswith(refused + "/") for t in p.trajectory_ids)
    groups = {o.record.group_id for o in out if o.topic == topics.REQUESTS and o.record.action == "GENERATE"}
    planned = {t.rsplit("/", 1)[0] for p in plans for t in p.trajectory_ids}
    assert groups == planned | {refused}, "a replacement group must be dispatched, nothing else left out"


@pytest.mark.parametrize("mode", ["sync", "dora"])
def test_a_dead_letter_naming_a_queued_group_changes_nothing(mode: str) -> None:
    """A letter naming a group never dispatched (a forged or stray refusal) withdraws nothing: the group
    stays queued with its prompt, and the snapshot (which references every queued prompt) still works."""
    from dora_rl.schemas.records import DeadLetter

    config = _cfg(mode, 0 if mode == "sync" else 1)
    n = (config.steps * config.train_batch_size + config.rollout_batch_size) // config.group_size
    last = f"{RUN}/p{n - 1}"  # queued behind every other prompt: not dispatched before the letter
    letter = DeadLetter(component="forger", reason="x", error_type="input", source_topic=topics.SCORED,
                        source_partition=0, source_offset=0, ts_ms=0, run_id=RUN, group_id=last)
    inputs = [InRecord(topics.PROMPTS, 0, i, None, _prompt(i)) for i in range(n)]
    inputs.append(InRecord(topics.DLQ, 0, 0, None, letter))
    driver = MemoryDriver(lambda: Orchestrator(RUN, config), inputs, commit_every=1)
    driver.run()  # snapshots after every record: raised KeyError on the letter before
    assert driver.committed.snapshot is not None and last.encode() in driver.committed.snapshot


def test_an_announcement_no_instance_can_load_is_refused_not_scheduled_for() -> None:
    """A forged announcement of a future version with no holder: dead-lettered with its position, and new work
    keeps the version every instance can load (it moved the orchestrator to a version nobody could serve)."""
    from dora_rl.schemas.records import DeadLetter

    orch = Orchestrator(RUN, _cfg("dora", 1))
    ctx = Context(lambda refs: {}, lambda: 0.0, lambda: 0)
    ann = PolicyVersion(run_id=RUN, version=0, step=0, created_ms=0, transport="tcp", holders=("h",),
                        total_bytes=0, checksum_algo="xxh3_64", tensors=(), buckets=())
    orch.process(InRecord(topics.VERSIONS, 0, 0, None, ann), ctx)
    orch.process(InRecord(topics.VERSIONS, 1, 7, None, ann.replace(version=99, holders=())), ctx)
    orch.process(InRecord(topics.PROMPTS, 0, 0, None, _prompt(0)), ctx)
    orch.punctuate(0.0, ctx)
    out = ctx.take()
    assert [o.record.policy_version for o in out if o.topic == topics.REQUESTS] == [0] * 4
    letters = [o.record for o in out if o.topic == topics.DLQ]
    assert len(letters) == 1 and isinstance(letters[0], DeadLetter)
    assert (letters[0].source_topic, letters[0].source_partition, letters[0].source_offset) == (topics.VERSIONS, 1, 7)
    assert "no holder" in letters[0].reason


def test_the_dataset_waits_in_the_log_so_snapshots_do_not_grow_with_it() -> None:
    """The orchestrator holds ``dora.prompts`` back once ``prompt_lookahead`` prompts are queued: with 20x more
    prompts in the dataset its snapshots are no larger (a reference per queued prompt), and crashes anywhere
    still give the uninterrupted output."""
    from dora_rl.streams.orchestrator import prompt_lookahead

    config = _cfg("dora", 1)
    sizes: dict[int, list[int]] = {}
    for extra in (20, 400):
        inputs, times = _record_world(config, 3, extra_prompts=extra)
        seen: list[int] = []

        class Measured(Orchestrator):
            def snapshot(self, seen: list[int] = seen) -> bytes:
                snap = super().snapshot()
                seen.append(snap.count(b'"dora.prompts"'))  # its references into the prompts topic
                return snap

        clean = MemoryDriver(lambda: Measured(RUN, config), inputs, times).run()
        sizes[extra] = seen
        assert [p.train_step for p in (o.record for o in clean if o.topic == topics.SCHEDULE)] == list(range(5))
        for k in (len(inputs) // 5, len(inputs) // 2):
            crashed = MemoryDriver(lambda: Orchestrator(RUN, config), inputs, times, commit_every=3)
            assert _wire(crashed.run(crash_after=[k])) == _wire(clean), f"crash after {k} changed the output"
    limit = 2 * (prompt_lookahead(config) + config.rollout_batch_size // config.group_size)  # 2 refs a prompt
    assert max(sizes[400]) <= limit and max(sizes[400]) == max(sizes[20]), (max(sizes[20]), max(sizes[400]))


def test_a_decided_request_or_plan_makes_the_commit_urgent_and_a_metric_does_not() -> None:
    """``decisions_waiting``: a request (GENERATE, CANCEL or a resume) or a batch plan is committed at once, since an
    instance slot, a migrating trajectory or the trainer waits for it; metrics wait for the commit interval."""
    from dora_rl.streams.orchestrator import decisions_waiting

    def out(topic: str, action: str = "GENERATE") -> OutRecord:
        return OutRecord(topic, "k", SimpleNamespace(action=action))

    assert not decisions_waiting([])
    assert not decisions_waiting([out(topics.METRICS), out(topics.METRICS)])
    assert decisions_waiting([out(topics.METRICS), out(topics.SCHEDULE)])
    for action in ("GENERATE", "CANCEL"):
        assert decisions_waiting([out(topics.METRICS), out(topics.REQUESTS, action)])
