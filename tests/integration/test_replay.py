"""``dora-rl replay`` re-runs a recorded run (docs/decisions/0020), against the real broker.

One small recorded run (torch engine, tiny model, dora mode, 4 steps, a checkpoint every version) is
shared by the tests: re-train is bit-identical and sensitive to a changed reward, re-score reports the
expected diff, re-feed trains a new run (the same one again, checksum for checksum) whose audit reports
the provenance, export filters by key version with the schema docs on the columns, an archive replays
like the topics, and records deleted by retention are refused with that reason.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from dora_rl.config import DoraConfig
from dora_rl.consumers.replay.source import KafkaSource, RetentionDeleted, decoded
from dora_rl.infra.kafka import topics
from dora_rl.schemas.records import PolicyVersion, TrainBatch, Trajectory

pytestmark = pytest.mark.broker

RECORDED = dict(mode="dora", max_staleness=1, steps=4, train_batch_size=16, rollout_batch_size=32, group_size=4,
                num_instances=2, instance_concurrency=16, max_new_tokens=24, sft_steps=10, engine="torch",
                weight_transport="tcp", checkpoint_every=1, seed=0)


@pytest.fixture(scope="module")
def run_id(bootstrap: str, dora_home: Path) -> str:
    from dora_rl.launcher import run

    summary = run(DoraConfig.from_dict(RECORDED), bootstrap, quiet=True)
    assert summary["steps"] == RECORDED["steps"]
    return str(summary["run_id"])


@pytest.fixture(scope="module")
def source(bootstrap: str, run_id: str) -> KafkaSource:
    return KafkaSource(bootstrap, run_id)


def _grpo(rewards: list[float]) -> list[float]:
    """GRPO advantages of one group, written out here independently of the trainer."""
    r = np.asarray(rewards, dtype=np.float64)
    if np.all(r == r[0]):
        return [0.0] * len(r)
    return list((r - r.mean()) / (r.std(ddof=1) + 1e-4))


def _batches(source: KafkaSource) -> dict[int, TrainBatch]:
    return {int(b.train_step): b for _, b in decoded(source, topics.BATCHES, TrainBatch)}


def _checksums(source: KafkaSource) -> dict[int, tuple[str, ...]]:
    return {int(a.version): tuple(b.checksum for b in a.buckets)
            for _, a in decoded(source, topics.VERSIONS, PolicyVersion) if a.announced_by == PolicyVersion.TRAINER}


def _learning_step(batches: dict[int, TrainBatch]) -> int:
    """A step whose batch has non-zero advantages, a stale one (decoupled PPO) when there is one."""
    def live(b: TrainBatch) -> bool:
        by_group: dict[str, list[float]] = {}
        for t in b.trajectories:
            by_group.setdefault(t.group_id, []).append(float(t.reward or 0.0))
        return any(any(a != 0.0 for a in _grpo(r)) for r in by_group.values())

    steps = [k for k, b in sorted(batches.items()) if live(b) and k > 0]
    assert steps, "no batch of the recorded run has a non-zero advantage"
    stale = [k for k in steps if max(batches[k].staleness()) > 0]
    return (stale or steps)[0]


def test_retrain_reproduces_a_step_bit_for_bit(source: KafkaSource) -> None:
    from dora_rl.consumers.replay.retrain import retrain

    step = _learning_step(_batches(source))
    report = retrain(source, step)
    assert report.from_version == step  # a checkpoint of every version: nothing to replay before it
    assert report.start_checksum == report.start_original
    result = report.result
    assert result.match, report.render()
    assert result.checksum == result.original_checksum
    assert result.loss == result.original_loss and result.grad_norm == result.original_grad_norm
    assert result.grad_norm > 0
    for k in sorted(set(_batches(source)) - {step}):  # every other step too, stale or fresh, learning or not
        assert retrain(source, k).result.match, k


def test_retrain_with_one_reward_changed_gives_other_weights(source: KafkaSource) -> None:
    from dora_rl.consumers.replay.retrain import retrain

    batches = _batches(source)
    step = _learning_step(batches)
    t = batches[step].trajectories[0]
    report = retrain(source, step, {t.trajectory_id: 1.0 - float(t.reward or 0.0)})
    assert report.result.edited and report.result.original_checksum is not None
    assert report.result.checksum != report.result.original_checksum
    assert not report.result.match


def test_rescore_with_another_reward_function_reports_the_expected_diff(source: KafkaSource) -> None:
    from replay_rewards import length_reward  # tests/integration is on sys.path

    from dora_rl.consumers.replay.rescore import rescore

    same = rescore(source)  # the run's own reward function gives the recorded rewards back
    assert same.rewards_changed == 0 and same.groups_changed == 0 and not same.errors
    assert same.trajectories >= RECORDED["steps"] * RECORDED["train_batch_size"]

    diff = rescore(source, "replay_rewards:length_reward")
    assert diff.reward_fn == "replay_rewards:length_reward" and diff.recorded_fn == "task" and not diff.errors
    scored = {t.trajectory_id: t for _, t in decoded(source, topics.SCORED, Trajectory)}
    assert diff.trajectories == len(scored)
    for g in diff.groups:
        members = [scored[d.trajectory_id] for d in g.trajectories]
        old = [float(t.reward) for t in members]  # type: ignore[arg-type]
        new = [length_reward(t.task, t.reference, t.response_text) for t in members]
        assert [d.old_reward for d in g.trajectories] == old
        assert [d.new_reward for d in g.trajectories] == new
        np.testing.assert_allclose([d.old_advantage for d in g.trajectories], _grpo(old), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose([d.new_advantage for d in g.trajectories], _grpo(new), rtol=1e-5, atol=1e-5)
    assert diff.rewards_changed > 0


def test_refeed_trains_the_same_run_again_and_the_audit_reports_the_provenance(bootstrap: str, run_id: str,
                                                                               source: KafkaSource) -> None:
    from dora_rl.consumers.audit import audit_run
    from dora_rl.consumers.replay.refeed import refeed

    result = refeed(source, bootstrap)
    assert result.batches == RECORDED["steps"] and result.trained
    report = audit_run(bootstrap, result.run_id)
    assert report.ok, report.render()
    assert report.provenance == {run_id: {"batches": 4, "trajectories": 64}}
    assert f"re-fed from run {run_id}: 4 batches, 64 trajectories" in report.render()
    again = KafkaSource(bootstrap, result.run_id)
    copied = _batches(again)
    for k, b in _batches(source).items():
        assert copied[k].provenance is not None and copied[k].provenance.source_run_id == run_id
        assert [t.encode() for t in copied[k].trajectories] == [t.encode() for t in b.trajectories]
    assert _checksums(again) == _checksums(source)  # same batches, same update: the same versions


def test_refeed_from_scored_trajectories_gives_each_its_provenance(bootstrap: str, run_id: str,
                                                                   source: KafkaSource) -> None:
    from dora_rl.consumers.replay.refeed import refeed

    result = refeed(source, bootstrap, kind="scored", train=False)
    assert result.batches >= 1 and not result.trained
    scored = {(raw.partition, raw.offset): t for raw, t in decoded(source, topics.SCORED, Trajectory)}
    bound = DoraConfig.from_dict(RECORDED).staleness_bound
    for b in _batches(KafkaSource(bootstrap, result.run_id)).values():
        assert len(b.trajectories) == RECORDED["train_batch_size"] and b.provenance is None
        for t in b.trajectories:
            p = t.provenance
            assert p is not None and (p.source_run_id, p.source_topic) == (run_id, topics.SCORED)
            assert scored[(p.source_partition, p.source_offset)].trajectory_id == t.trajectory_id
            assert t.run_id == result.run_id and bound.allows(b.base_version, t.policy_version)


def test_export_filters_by_key_version_with_the_field_docs(source: KafkaSource, tmp_path: Path) -> None:
    from dora_rl.consumers.replay.export import ExportFilter, export

    res = export(source, topics.SCORED, tmp_path / "v1.parquet", ExportFilter(version=1))
    of_v1 = [raw for raw, _ in decoded(source, topics.SCORED, Trajectory) if raw.version == 1]
    assert res.rows == len(of_v1) > 0
    table = pq.read_table(tmp_path / "v1.parquet")
    assert table.num_rows == len(of_v1)
    assert set(table.column("policy_version").to_pylist()) == {1}
    assert sorted(zip(table.column("_partition").to_pylist(), table.column("_offset").to_pylist(), strict=True)) == \
        sorted((r.partition, r.offset) for r in of_v1)
    schema = table.schema
    assert schema.field("trajectory_id").metadata[b"doc"] == b"Stable id; the idempotency key."
    assert b"Set by the reward scorer" in schema.field("reward").metadata[b"doc"]
    assert b"Packed <i4" in schema.field("response_ids").metadata[b"doc"]
    assert schema.metadata[b"dora.record"] == b"dora.v1.Trajectory"

    where = ExportFilter(staleness=(1, 1), reward=(0.0, 0.5))
    stale = export(source, topics.BATCHES, tmp_path / "stale.parquet", where)
    rows = pq.read_table(tmp_path / "stale.parquet").to_pylist()
    assert len(rows) == stale.rows and all(r["staleness"] == 1 and r["reward"] <= 0.5 for r in rows)
    with pytest.raises(ValueError, match="finish_reason"):
        export(source, topics.METRICS, tmp_path / "m.parquet", ExportFilter(finish_reason="STOP"))


def test_archive_then_every_verb_reads_it(source: KafkaSource, run_id: str, tmp_path: Path) -> None:
    from dora_rl.consumers.replay.archive import ArchiveSource, archive
    from dora_rl.consumers.replay.dump import dump
    from dora_rl.consumers.replay.retrain import retrain

    done = archive(source, tmp_path / "arch")
    assert done.run_id == run_id and done.records[topics.BATCHES] == 4 and done.checkpoints == 5
    kept = ArchiveSource(tmp_path / "arch")
    assert kept.run_info().run_id == run_id and kept.run_info().state == "FINISHED"
    for topic in (topics.SCORED, topics.BATCHES, topics.VERSIONS, topics.DLQ):
        live, archived = io.StringIO(), io.StringIO()
        assert dump(source, topic, live) == dump(kept, topic, archived)
        assert sorted(live.getvalue().splitlines()) == sorted(archived.getvalue().splitlines())  # partitions interleave
    with pytest.raises(FileExistsError):
        archive(source, tmp_path / "arch")
    # without version 1's checkpoint, step 1 is replayed forward from version 0: both steps exact
    shutil.rmtree(kept.checkpoints_dir() / "v000001")
    report = retrain(kept, 1)
    assert report.from_version == 0 and [s.step for s in report.steps] == [0, 1]
    assert all(s.match for s in report.steps), report.render()


def test_cli_verbs_run_from_an_archive_without_a_broker(source: KafkaSource, tmp_path: Path) -> None:
    from dora_rl.cli import main
    from dora_rl.consumers.replay.archive import archive

    archive(source, tmp_path / "arch")
    assert main(["replay", "retrain", "--from-archive", str(tmp_path / "arch"), "--step", "2", "--json",
                 str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["match"] == [True]
    assert main(["replay", "export", "--from-archive", str(tmp_path / "arch"), "--out",
                 str(tmp_path / "e.parquet"), "--version", "2"]) == 0
    assert pq.read_table(tmp_path / "e.parquet").num_rows == \
        sum(1 for raw, _ in decoded(source, topics.SCORED, Trajectory) if raw.version == 2)

    # the audit of the archive is the audit of the run on Kafka, count for count (with the run's token too)
    from dora_rl.consumers.audit import audit_run
    from dora_rl.roles import run_token

    token_file = tmp_path / "token"
    token_file.write_text(run_token(source.run_info().run_id))
    assert main(["audit", "--from-archive", str(tmp_path / "arch"), "--token-file", str(token_file), "--json",
                 str(tmp_path / "a.json")]) == 0
    on_kafka = audit_run(source.bootstrap, source.run_info().run_id, run_token(source.run_info().run_id))
    assert json.loads((tmp_path / "a.json").read_text()) == json.loads(json.dumps(on_kafka.to_dict()))
    assert on_kafka.verdict == "PASS"


def test_records_deleted_by_retention_are_refused_with_the_reason(bootstrap: str, source: KafkaSource,
                                                                  tmp_path: Path) -> None:
    """Last in this module: it deletes the run's prompts (as retention would)."""
    from confluent_kafka import TopicPartition
    from confluent_kafka.admin import AdminClient

    from dora_rl.consumers.replay.archive import archive

    end = max(r.offset for r in source.raw(topics.PROMPTS)) + 1
    admin = AdminClient({"bootstrap.servers": bootstrap})
    prompts = topics.in_run(source.run_info().run_id, topics.PROMPTS)
    for fut in admin.delete_records([TopicPartition(prompts, 0, end)]).values():
        fut.result(30)
    with pytest.raises(RetentionDeleted, match=r"dora\.prompts\[0\].*retention deleted"):
        list(source.raw(topics.PROMPTS))
    with pytest.raises(RetentionDeleted, match="--from-archive"):
        archive(source, tmp_path / "late")
    assert not (tmp_path / "late").exists()
    assert len(_batches(source)) == 4  # what retention kept still replays
