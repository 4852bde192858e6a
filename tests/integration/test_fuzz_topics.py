"""Whatever arrives on a topic, a live run goes on (issue 31): hostile records are written into every topic the
run reads while it trains (real broker, dora mode, emulated engine), and the run reaches its steps, the audit
passes, and every injected record that a live reader consumed has its dead letter naming its position.

Injected, at the head of each topic partition a live role reads: random bytes with no headers, a valid record
cut short, a non-UTF-8 schema header, an unknown schema name, an unknown schema fingerprint, and (on the scored
topic) a 900 KB record of garbage. Records with bad meaning: a scored trajectory of an unknown group with a NaN
reward; scored copies of three real trajectories just generated, with a NaN, an infinite and an out-of-range
reward, signed with the run's scorer key (a hostile external scorer: whichever copy of a real trajectory the
assembler meets first, no batch may hold a bad reward and every announced version must hold finite weights); an
unsigned copy of a real trajectory with reward 1.0 (planted: refused, decision 0059); an announcement with no
holder; a forged announcement of a new version held elsewhere, signed with another key (decision 0054); the run's
own latest announcement sent again, versions out of order (readers keep the newest; the audit reports a replay);
announcements signed with the run's token but of the wrong kind for their topic (a holder's on the trainer's topic, the
trainer's on ``dora.policy.holders``, decision 0057); an unsigned ``done`` of the trainer at the run's last step
(it would end the run early and record it FINISHED; the launcher passes it by, decision 0057); and refusals
naming a queued, an unknown and a dispatched group, unsigned or signed with another key (each withdraws nothing
and the orchestrator dead-letters each, decision 0059); an unsigned plan of the last step naming groups that do
not exist and an unsigned, empty batch of the next step (the assembler, and the trainer and the orchestrator,
refuse them, decision 0060). ``dora.runs`` and
``dora.state`` get garbage too (read at start and by the audit, which must read past it; no role reads them
live, so no letter is owed). Each reader group owes one dead letter per record it read: exactly the live
readers of that topic (and partition) wrote one.

Beside the run, all along, another run stalls: its transactional producer wrote to every one of its topics and
was SIGSTOPped with a 5-minute transaction timeout (``run_helpers.stalled_neighbour``). Each run has topics of its
own (decision 0063), so the fuzzed run must finish in well under that time. Then ``dora-rl runs --delete`` removes
the finished run's topics and refuses the neighbour's (never ended).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import random
import signal
import time
from pathlib import Path

import pytest
from run_helpers import emulated_run, launch_run, stalled_neighbour, steps_done, wait_for

pytestmark = pytest.mark.broker

CONFIG = emulated_run(steps=12, seed=17, max_new_tokens=64, emulated={"base_step_s": 0.06})


NEIGHBOUR_HELD_S = 300
"""The transaction timeout of the stalled run beside the fuzzed one: how long it would hold back a shared topic."""
FORGED_OFFSET = 2**40
"""The source offset the forged refusals name: never a record's, so the letters the test itself writes are not
counted as a reader's letter for an injected record (at offset 0 they were, once partition 0 of dora.rollout.scored
was still empty when the garbage landed: CI, 2026-11-28)."""

LAST_GROUP = CONFIG["steps"] * CONFIG["train_batch_size"] // CONFIG["group_size"] - 1
"""A group still queued when the records arrive (after the first step): a forged refusal of it must not lose it."""


def _live_partitions(topic: str, partitions: int) -> list[int]:
    """The partitions of ``topic`` a live role reads (each rollout instance reads its own request partition)."""
    from dora_rl.infra.kafka import topics

    return list(range(CONFIG["num_instances"])) if topic == topics.REQUESTS else list(range(partitions))


def _garbage(template: tuple[bytes, list[tuple[str, bytes]]], rng: random.Random) -> list[tuple[str, bytes, list]]:
    """(kind, value, headers) of the byte-level injections, from one valid record of the topic."""
    value, headers = template
    name = dict(headers)["dora.schema"]
    return [("random_bytes", rng.randbytes(64), []),
            ("truncated", value[: max(1, len(value) // 2)], headers),
            ("header_not_utf8", value, [("dora.schema", b"\xff\xfe\x80")]),
            ("unknown_schema", value, [("dora.schema", b"dora.NoSuchRecord")]),
            ("unknown_fingerprint", value, [("dora.schema", name), ("dora.schema.fp", b"0123456789abcdef")])]


FUZZED = ("dora.prompts", "dora.rollout.requests", "dora.rollout.tokens", "dora.rollout.trajectories",
          "dora.rollout.scored", "dora.instances", "dora.policy.versions", "dora.policy.holders",
          "dora.train.batches", "dora.dlq",
          "dora.metrics", "dora.schedule", "dora.runs", "dora.state")


def _last_record(bootstrap: str, topic: str) -> tuple[bytes, list[tuple[str, bytes]]]:
    """The value and headers of a recent record of ``topic`` (any run): a valid record of its schema."""
    from confluent_kafka.admin import AdminClient

    from dora_rl.infra.kafka.read import read_backwards

    for p in AdminClient({"bootstrap.servers": bootstrap}).list_topics(topic, timeout=30).topics[topic].partitions:
        for window in read_backwards(bootstrap, topic, p, window=20):
            msgs = [m for m in window if m.value() and m.headers()]
            if msgs:
                return msgs[-1].value(), list(msgs[-1].headers())
            break  # the newest window only
    raise AssertionError(f"no record on {topic} to shape the injections on")


def _trajectory(run_id: str, group: str, reward: float) -> object:
    import numpy as np

    from dora_rl.schemas.records import Trajectory

    return Trajectory(run_id=run_id, trajectory_id=f"{run_id}/{group}/0", group_id=f"{run_id}/{group}",
                      prompt_id=f"{run_id}/{group}", sample_index=0, group_size=CONFIG["group_size"],
                      policy_version=0, task="reverse", reference="abc", prompt_ids=np.asarray([1, 5, 6], np.int32),
                      response_ids=np.asarray([7, 8], np.int32),
                      behaviour_logprobs=np.asarray([-1.0, -1.0], np.float32),
                      response_text="xy", instance_id="rollout-0", instance_version=0, reward=reward)


def test_hostile_records_on_every_topic_do_not_stop_or_corrupt_a_live_run(bootstrap: str, dora_home: Path,
                                                                           tmp_path: Path) -> None:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient

    from dora_rl.consumers.audit import audit_run
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.io import read_all
    from dora_rl.infra.kafka.signing import signed
    from dora_rl.infra.weights.announcements import sign
    from dora_rl.schemas.codec import DecodeError
    from dora_rl.schemas.records import BatchPlan, DeadLetter, Metric, PolicyVersion, TrainBatch

    out = tmp_path / "summary.json"
    neighbourhood = contextlib.ExitStack()  # a run beside this one, stalled in a transaction on all its topics
    neighbour, still_held = neighbourhood.enter_context(stalled_neighbour(bootstrap, NEIGHBOUR_HELD_S))
    t0 = time.monotonic()
    launcher, rdir = launch_run(bootstrap, dora_home, tmp_path, CONFIG, json_out=out)
    run_id = rdir.name
    injected: list[tuple[str, int, int, str]] = []  # topic, partition, offset, kind
    try:
        wait_for(lambda: steps_done(bootstrap, run_id) >= 1, 240, "a first step")
        meta = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=30).topics
        producer = Producer({"bootstrap.servers": bootstrap, "message.max.bytes": 2_000_000})

        def sent(kind: str) -> object:
            def report(err: object, msg: object) -> None:
                assert err is None, err
                injected.append((topics.catalogue_name(run_id, msg.topic()),  # type: ignore[attr-defined]
                                 msg.partition(), msg.offset(), kind))  # type: ignore[attr-defined]
            return report

        # before any garbage lands there
        genuine = PolicyVersion.decode(*_last_record(bootstrap, topics.in_run(run_id, topics.VERSIONS)))
        scorer_key = (rdir / "scorer-key").read_text().strip()  # a hostile scorer of the run holds it
        recent = _recent_trajectories(bootstrap, run_id, 4)
        hostile = [(signed(dataclasses.replace(t, reward=r), scorer_key), topics.SCORED, f"real_{name}_reward")
                   for t, (name, r) in zip(recent[:3], (("nan", math.nan), ("inf", math.inf), ("out_of_range", 7.0)),
                                           strict=True)]
        hostile.append((dataclasses.replace(recent[3], reward=1.0), topics.SCORED, "planted_reward"))
        rng = random.Random(0)
        letter = DeadLetter(component="fuzz", reason="x", error_type="x", source_topic="t", source_partition=0,
                            source_offset=0, ts_ms=0, run_id=run_id)
        for topic in FUZZED:
            template = (letter.encode() if topic == topics.DLQ else genuine.encode() if topic == topics.HOLDERS
                        else _last_record(bootstrap, topics.in_run(run_id, topic)))  # an emulated run: no holder
            for p in _live_partitions(topic, len(meta[topics.in_run(run_id, topic)].partitions)):
                for kind, value, headers in _garbage(template, rng):
                    producer.produce(topics.in_run(run_id, topic), value, b"fuzz", partition=p, headers=headers,
                                     on_delivery=sent(kind))
        producer.produce(topics.in_run(run_id, topics.SCORED), rng.randbytes(900_000), b"fuzz", partition=0,
                         on_delivery=sent("oversize"))
        nan = signed(_trajectory(run_id, "fuzz-nan", math.nan), scorer_key)
        no_holder = PolicyVersion(run_id=run_id, version=0, step=0, created_ms=0, transport="tcp", holders=(),
                                  total_bytes=0, checksum_algo="sha256", tensors=(), buckets=())
        forged = sign(genuine.replace(run_id=run_id, version=genuine.version + 50, holders=("127.0.0.1:1",),
                                      announced_by=PolicyVersion.TRAINER), "not the run's token")
        token = (rdir / "weight-token").read_text().strip()  # valid, signed, but the wrong kind for the topic
        holder_on_versions = sign(genuine.replace(run_id=run_id, announced_by=PolicyVersion.HOLDER, signature=None),
                                  token)
        trainer_on_holders = sign(genuine.replace(run_id=run_id, signature=None), token)
        queued, unknown, in_flight = (
            DeadLetter(component="fuzz", reason="forged", error_type="input", source_topic=topics.SCORED,
                       source_partition=0, source_offset=FORGED_OFFSET, ts_ms=0, run_id=run_id, group_id=g)
            for g in (f"{run_id}/p{LAST_GROUP}", f"{run_id}/no-such-group", recent[0].group_id))
        for rec, topic, kind in (*hostile, (nan, topics.SCORED, "nan_reward"),
                                 (no_holder, topics.VERSIONS, "no_holder"),
                                 (forged, topics.VERSIONS, "forged_announcement"),
                                 (genuine, topics.VERSIONS, "replayed_announcement"),
                                 (holder_on_versions, topics.VERSIONS, "holder_on_versions"),
                                 (trainer_on_holders, topics.HOLDERS, "trainer_on_holders"),
                                 (Metric(run_id=run_id, component="trainer", name="done", value=CONFIG["steps"],
                                         ts_ms=0), topics.METRICS, "forged_done"),
                                 (queued, topics.DLQ, "refusal_of_queued_group"),
                                 (unknown, topics.DLQ, "refusal_of_unknown_group"),
                                 (signed(in_flight, "another run's token"), topics.DLQ, "refusal_of_dispatched_group"),
                                 (BatchPlan(run_id=run_id, train_step=CONFIG["steps"] - 1, ts_ms=0,
                                            trajectory_ids=tuple(f"{run_id}/fuzz/{i}" for i in range(
                                                CONFIG["train_batch_size"]))), topics.SCHEDULE, "forged_plan"),
                                 (TrainBatch(run_id=run_id, batch_id=f"{run_id}/forged", train_step=steps_done(
                                     bootstrap, run_id), base_version=0, max_staleness=CONFIG["max_staleness"],
                                     created_ms=0, trajectories=()), topics.BATCHES, "forged_batch")):
            value, headers = rec.encode()  # type: ignore[attr-defined]
            producer.produce(topics.in_run(run_id, topic), value, b"fuzz", partition=0, headers=headers,
                             on_delivery=sent(kind))
        assert producer.flush(30) == 0
        assert launcher.poll() is None and steps_done(bootstrap, run_id) < CONFIG["steps"] - 2, \
            "the records must arrive while the run trains"
        code = launcher.wait(timeout=420)
        text = launcher.stdout.read().decode() if launcher.stdout else ""
        assert code == 0, text[-4000:]
        took = time.monotonic() - t0
        still_held()  # the neighbour's transaction stayed open for the whole run, which it did not delay:
        assert took < NEIGHBOUR_HELD_S / 2, f"the run took {took:.0f}s beside a stalled run"  # (decision 0063)
    finally:
        if launcher.poll() is None:  # a failure before the end: stop the run as a user would (no orphans)
            launcher.send_signal(signal.SIGTERM)
            launcher.wait(timeout=60)
        neighbourhood.close()
    assert json.loads(out.read_text())["steps"] == CONFIG["steps"]
    report = audit_run(bootstrap, run_id, (rdir / "weight-token").read_text().strip(),
                       (rdir / "scorer-key").read_text().strip())
    assert report.verdict == "PASS" and report.v_replayed >= 1, report.render()

    letters: dict[tuple[str, int, int], set[str]] = {}  # position -> the components that dead-lettered it
    for msg in read_all(bootstrap, topics.in_run(run_id, topics.DLQ), {}):
        try:
            d = DeadLetter.decode(msg.value(), msg.headers())
        except DecodeError:
            continue  # our own garbage on dora.dlq
        if d.run_id == run_id:
            letters.setdefault((d.source_topic, d.source_partition, d.source_offset), set()).add(d.component)
    wrong = [(t, p, o, k, sorted(letters.get((t, p, o), ())), sorted(_readers(t, p, k))) for t, p, o, k in injected
             if letters.get((t, p, o), set()) != _readers(t, p, k)]
    assert not wrong, f"{len(wrong)} of {len(injected)} injected records lack a reader's dead letter: {wrong[:12]}"
    _assert_finite_training(bootstrap, run_id, dora_home)
    _assert_topics_deleted_once_over(bootstrap, run_id, neighbour)


def _assert_topics_deleted_once_over(bootstrap: str, run_id: str, neighbour: str) -> None:
    """``dora-rl runs --delete``: the finished run's topics go (and ``runs`` says so); the neighbour, never ended
    (STARTED), is refused."""
    import subprocess
    import sys

    from dora_rl.infra.kafka.topic_admin import run_topic_names

    runs = [sys.executable, "-m", "dora_rl", "runs", "--bootstrap-servers", bootstrap]
    refused = subprocess.run([*runs, "--delete", neighbour], capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and "is not over" in refused.stderr, refused.stderr[-2000:]
    deleted = subprocess.run([*runs, "--delete", run_id], capture_output=True, text=True, timeout=120)
    assert deleted.returncode == 0, deleted.stderr[-2000:]
    assert f"deleted {len(run_topic_names(run_id))} topics" in deleted.stdout, deleted.stdout
    listed = subprocess.run(runs, capture_output=True, text=True, timeout=120).stdout.splitlines()
    assert next(line for line in listed if line.startswith(run_id)).endswith("topics deleted"), listed
    assert not next(line for line in listed if line.startswith(neighbour)).endswith("topics deleted"), listed


def _recent_trajectories(bootstrap: str, run_id: str, n: int) -> list:  # type: ignore[type-arg]
    """``n`` of the run's newest generated trajectories (of different groups where there are enough)."""
    from confluent_kafka.admin import AdminClient

    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.read import read_backwards
    from dora_rl.schemas.codec import DecodeError
    from dora_rl.schemas.records import Trajectory

    found: dict[str, Trajectory] = {}
    trajectories = topics.in_run(run_id, topics.TRAJECTORIES)
    meta = AdminClient({"bootstrap.servers": bootstrap}).list_topics(trajectories, timeout=30)
    for p in meta.topics[trajectories].partitions:
        for window in read_backwards(bootstrap, trajectories, p, window=50):
            for msg in reversed(window):
                try:
                    t = Trajectory.decode(msg.value(), msg.headers())
                except DecodeError:
                    continue
                if t.run_id == run_id:
                    found.setdefault(t.group_id, t)
            break
    assert len(found) >= 1, "no trajectory generated yet"
    groups = list(found.values())
    return [groups[i % len(groups)] for i in range(n)]


def _assert_finite_training(bootstrap: str, run_id: str, dora_home: Path) -> None:
    """No trained batch holds a reward outside [0, 1], and every checkpoint the trainer kept is of finite
    weights (its checksums are what it announced: decision 0053)."""
    from safetensors.torch import load_file

    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.io import read_all
    from dora_rl.schemas.codec import DecodeError
    from dora_rl.schemas.records import TrainBatch

    rewards: list[float | None] = []
    for msg in read_all(bootstrap, topics.in_run(run_id, topics.BATCHES), {}):
        try:
            batch = TrainBatch.decode(msg.value(), msg.headers())
        except DecodeError:
            continue  # the test's own garbage
        rewards += [t.reward for t in batch.trajectories] if batch.run_id == run_id else []
    assert len(rewards) == CONFIG["steps"] * CONFIG["train_batch_size"]
    assert all(r is not None and 0.0 <= r <= 1.0 for r in rewards), "a bad reward reached a batch"
    weights = sorted((dora_home / "runs" / run_id).glob("**/model.safetensors"))
    assert weights, "no checkpoint kept"
    for path in weights:
        assert all(bool(t.isfinite().all()) for t in load_file(str(path)).values()), f"non-finite weights in {path}"


def _readers(topic: str, partition: int, kind: str) -> set[str]:
    """The components that read ``topic`` live in this run, each owing one dead letter per injected record; a
    trajectory with a NaN reward decodes (the orchestrator passes it by) and is refused by the assembler."""
    if kind.endswith("_reward"):
        return {"assembler"}
    if kind.startswith("refusal_of"):  # not signed with the run's token: it withdraws nothing
        return {"orchestrator"}
    if kind in ("forged_done", "replayed_announcement"):  # valid: the launcher passes it by; readers keep the newest
        return set()
    if kind == "forged_plan":  # not signed with the run's token (decision 0060)
        return {"assembler"}
    if kind == "forged_batch":
        return {"orchestrator", "trainer"}
    return {"dora.prompts": {"orchestrator"}, "dora.rollout.requests": {f"rollout-{partition}"},
            "dora.rollout.tokens": {"orchestrator"}, "dora.rollout.trajectories": {"orchestrator", "scorer"},
            "dora.rollout.scored": {"assembler", "orchestrator"}, "dora.instances": {"launcher", "orchestrator"},
            "dora.policy.versions": {"orchestrator", "rollout-0", "rollout-1"},
            "dora.policy.holders": {"rollout-0", "rollout-1"},
            "dora.train.batches": {"orchestrator", "trainer"}, "dora.dlq": {"orchestrator"},
            "dora.metrics": {"launcher"}, "dora.schedule": {"assembler"}}.get(topic, set())
