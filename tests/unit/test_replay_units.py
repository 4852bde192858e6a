"""The pure parts of ``dora-rl replay`` (no broker): retention check, checkpoint choice, what-if edits,
re-assembly and copies for re-feed, the re-score diff, export filters and columns, the archive round
trip, the audit's provenance report, the command line, and the exactness of re-training from a checkpoint."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from dora_rl.config import DoraConfig
from dora_rl.consumers.replay.source import RawRecord, by_version, retention_losses
from dora_rl.core.staleness import StalenessBound
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.keys import make_key
from dora_rl.schemas.records import Provenance, RunInfo, TopicOffset, TrainBatch, Trajectory


def _traj(tid: str, group: str, version: int = 0, reward: float | None = 0.5, response: int = 3,
          prompt: tuple[int, ...] = (5, 6, 7)) -> Trajectory:
    return Trajectory(run_id="src", trajectory_id=tid, group_id=group, prompt_id=group, sample_index=0, group_size=2,
                      policy_version=version, task="reverse", reference="ab", prompt_ids=np.array(prompt),
                      response_ids=np.arange(8, 8 + response), behaviour_logprobs=np.full(response, -1.0),
                      response_text="ba", instance_version=version, reward=reward)


def _raw(topic: str, partition: int, offset: int, record: TrainBatch | Trajectory | RunInfo, key: str) -> RawRecord:
    value, headers = record.encode()
    return RawRecord(topic, partition, offset, key.encode(), value, tuple(headers), 1000 + offset)


class FakeSource:
    """An in-memory run: the records of each topic, as a source yields them."""

    def __init__(self, records: dict[str, list[RawRecord]], state: str = "FINISHED",
                 home: Path = Path("/none")) -> None:
        self.records = records
        self.info = RunInfo(run_id="src", state=state, mode="dora", config_json=DoraConfig(mode="dora").to_json(),
                            created_ms=0, start_offsets=(TopicOffset(topic=topics.BATCHES, partition=0, offset=0),))
        self.records.setdefault(topics.RUNS, [_raw(topics.RUNS, 0, 0, self.info, "run/src")])
        self.home = home

    @property
    def where(self) -> str:
        return "memory"

    def run_info(self) -> RunInfo:
        return self.info

    def raw(self, topic: str, version: int | None = None) -> Iterator[RawRecord]:
        return by_version(iter(self.records.get(topic, [])), version)

    def checkpoints_dir(self) -> Path:
        return self.home


def test_retention_losses_name_each_partition_whose_start_was_deleted() -> None:
    assert retention_losses("t", {0: 5, 1: 10}, {0: 5, 1: 3}) == []
    lost = retention_losses("t", {0: 5, 1: 10, 2: 0}, {0: 6, 1: 3, 2: 0})
    assert lost == ["t[0]: the run's records start at offset 5, but retention deleted everything below 6"]


def test_the_key_version_filters_without_decoding() -> None:
    garbage = RawRecord("t", 0, 0, make_key(3, "g").encode(), b"\xff not avro", (), 0)
    other = RawRecord("t", 0, 1, make_key(4, "g").encode(), b"\xff", (), 0)
    keyless = RawRecord("t", 0, 2, None, b"\xff", (), 0)
    assert list(by_version(iter([garbage, other, keyless]), 3)) == [garbage]
    assert [r.version for r in (garbage, other, keyless)] == [3, 4, None]


def test_nearest_checkpoint_is_the_newest_at_or_below_the_step() -> None:
    from dora_rl.consumers.replay.retrain import nearest_checkpoint

    have = {0: Path("a"), 2: Path("b"), 5: Path("c")}
    assert nearest_checkpoint(have, 4) == (2, Path("b"))
    assert nearest_checkpoint(have, 2) == (2, Path("b"))
    with pytest.raises(LookupError, match="no checkpoint"):
        nearest_checkpoint({3: Path("x")}, 2)


def test_edit_rewards_replaces_only_the_named_trajectories() -> None:
    from dora_rl.consumers.replay.retrain import edit_rewards

    b = TrainBatch(run_id="r", batch_id="r/step0", train_step=0, base_version=0, max_staleness=0, created_ms=0,
                   trajectories=(_traj("a", "g"), _traj("b", "g")))
    edited = edit_rewards(b, {"b": 1.0})
    assert [t.reward for t in edited.trajectories] == [0.5, 1.0]
    with pytest.raises(KeyError, match="zz"):
        edit_rewards(b, {"zz": 1.0})


def test_reassembly_takes_whole_groups_allowed_by_c3_earliest_deadline_first() -> None:
    from dora_rl.consumers.replay.refeed import reassemble

    located = []
    for i, (group, version) in enumerate([("g0", 0), ("g1", 1), ("g2", 0), ("g3", 0), ("g4", 1), ("g5", 2)]):
        for k in range(2):
            t = _traj(f"{group}/{k}", group, version)
            located.append((RawRecord(topics.SCORED, 0, 2 * i + k, None, None, (), 0), t))
    located.append(located[0])  # a duplicate copy is ignored
    located.append((RawRecord(topics.SCORED, 0, 99, None, None, (), 0), _traj("g6/0", "g6", 0)))  # incomplete
    bound = StalenessBound(1)
    batches, left = reassemble(located, train_batch_size=4, group_size=2, bound=bound)
    groups = [[t.group_id for _, t in b[::2]] for b in batches]
    assert groups == [["g0", "g2"], ["g3", "g1"], ["g4", "g5"]]  # g3 (deadline 1) before g1 (deadline 2)
    assert left == 0
    for k, b in enumerate(batches):
        assert all(bound.allows(k, t.policy_version) for _, t in b)
    batches, left = reassemble(located, train_batch_size=4, group_size=2, bound=StalenessBound(0))
    assert [[t.group_id for _, t in b[::2]] for b in batches] == [["g0", "g2"], ["g1", "g4"]]
    assert left == 2  # g3 missed its deadline (step 0), g5 never had a partner group at step 2


def test_copied_batches_keep_their_trajectories_and_name_their_origin() -> None:
    from dora_rl.consumers.replay.refeed import copy_batches

    def batch(step: int) -> TrainBatch:
        return TrainBatch(run_id="src", batch_id=f"src/step{step}", train_step=step, base_version=step, max_staleness=1,
                          created_ms=0, trajectories=(_traj(f"t{step}", "g", step),))

    located = [(RawRecord(topics.BATCHES, 0, o, None, None, (), 0), b)
               for o, b in enumerate([batch(0), batch(1), batch(1), batch(3)])]
    out = copy_batches(located, "src", "new", 7)
    assert [b.train_step for b in out] == [0, 1]  # stops at the first missing step (2)
    assert out[1].provenance == Provenance("src", topics.BATCHES, 0, 1)  # the first batch of step 1
    assert (out[1].run_id, out[1].batch_id, out[1].created_ms) == ("new", "new/step1", 7)
    assert [t.encode() for t in out[1].trajectories] == [t.encode() for t in batch(1).trajectories]
    again = TrainBatch.decode(*out[1].encode())
    assert again.provenance == out[1].provenance


def test_rescore_diff_uses_the_trainers_advantages() -> None:
    from dora_rl.consumers.replay.rescore import advantages, group_diff
    from dora_rl.consumers.trainer.update import Sample, compute_advantages

    members = [_traj("a", "g", reward=0.0), _traj("b", "g", reward=1.0), _traj("c", "g", reward=1.0)]
    diff = group_diff(members, [0.5, 0.5, 0.5], [None] * 3, "grpo")
    want = compute_advantages([Sample([1], [2], [0.0], r, "g") for r in (0.0, 1.0, 1.0)]).tolist()
    assert [d.old_advantage for d in diff.trajectories] == want
    assert [d.new_advantage for d in diff.trajectories] == [0.0, 0.0, 0.0]
    assert diff.max_reward_change == 0.5 and diff.max_advantage_change == pytest.approx(max(abs(a) for a in want))
    empty = [_traj("a", "g", reward=0.0), _traj("b", "g", reward=1.0, response=0), _traj("c", "g", reward=1.0)]
    adv = advantages(empty, [0.0, 1.0, 1.0], "grpo")
    assert adv[1] is None and adv[0] is not None and adv[0] < 0  # an empty response is not trained
    assert advantages(members, [0.0, None, 1.0], "grpo") == [None, None, None]


def test_export_filters_and_columns(tmp_path: Path) -> None:
    from dora_rl.consumers.replay.export import ExportFilter, export, export_schema

    row = {"group_id": "g", "finish_reason": "STOP", "staleness": 1, "reward": 0.25}
    assert ExportFilter(group="g", staleness=(1, 1), reward=(0.0, 0.5)).accepts(row)
    assert not ExportFilter(finish_reason="LENGTH").accepts(row)
    assert not ExportFilter(reward=(0.3, 1.0)).accepts(row)
    assert not ExportFilter(staleness=(0, 0)).accepts({**row, "staleness": None})
    schema = export_schema(topics.BATCHES)
    assert schema.field("train_step").metadata[b"doc"] == b"0-based index of the update this batch feeds."
    assert "staleness" in schema.names and b"doc" in schema.field("staleness").metadata

    b0 = TrainBatch(run_id="src", batch_id="src/step0", train_step=0, base_version=0, max_staleness=1, created_ms=0,
                    trajectories=(_traj("a", "g", 0, 0.2), _traj("b", "g", 0, 0.9)))
    b1 = TrainBatch(run_id="src", batch_id="src/step1", train_step=1, base_version=1, max_staleness=1, created_ms=0,
                    trajectories=(_traj("c", "h", 0, 0.4), _traj("d", "h", 0, 0.1)))
    source = FakeSource({topics.BATCHES: [_raw(topics.BATCHES, 0, i, b, make_key(i, f"step{i}"))
                                          for i, b in enumerate((b0, b1))]})
    res = export(source, topics.BATCHES, tmp_path / "x.parquet", ExportFilter(version=1, reward=(0.0, 0.3)))
    rows = pq.read_table(tmp_path / "x.parquet").to_pylist()
    assert res.rows == 1 and rows[0]["trajectory_id"] == "d" and rows[0]["staleness"] == 1
    assert rows[0]["response_ids"] == [8, 9, 10] and rows[0]["_offset"] == 1
    with pytest.raises(ValueError, match="finish_reason"):
        export(source, topics.METRICS, tmp_path / "m.parquet", ExportFilter(finish_reason="STOP"))


def test_archive_round_trip_and_refusals(tmp_path: Path) -> None:
    from dora_rl.consumers.replay.archive import ArchiveSource, archive

    ckpts = tmp_path / "ckpts"
    (ckpts / "v000000").mkdir(parents=True)
    (ckpts / "v000000" / "COMPLETE").write_text("0")
    mine = _raw(topics.SCORED, 1, 4, _traj("a", "g"), make_key(0, "g"))
    other = _raw(topics.SCORED, 1, 5, _traj("x", "g").replace(run_id="another"), make_key(0, "g"))
    garbage = RawRecord(topics.SCORED, 2, 0, make_key(2, "g").encode(), b"\x07", (), 9)
    source = FakeSource({topics.SCORED: [mine, other, garbage]}, home=ckpts)
    done = archive(source, tmp_path / "a", names=(topics.SCORED, topics.RUNS))
    assert done.records == {topics.SCORED: 2, topics.RUNS: 1} and done.checkpoints == 1
    kept = ArchiveSource(tmp_path / "a")
    assert list(kept.raw(topics.SCORED)) == [mine, garbage]  # another run's record is left out
    assert list(kept.raw(topics.SCORED, version=2)) == [garbage]
    assert kept.run_info().run_id == "src" and (kept.checkpoints_dir() / "v000000" / "COMPLETE").exists()
    meta = pq.read_schema(tmp_path / "a" / "records" / f"{topics.SCORED}.parquet").metadata
    assert b'"name": "Trajectory"' in meta[b"dora.avsc"]
    with pytest.raises(FileNotFoundError, match=topics.BATCHES):
        list(kept.raw(topics.BATCHES))
    with pytest.raises(FileExistsError):
        archive(source, tmp_path / "a")
    with pytest.raises(RuntimeError, match="STARTED"):
        archive(FakeSource({}, state="STARTED"), tmp_path / "b")
    assert not (tmp_path / "b").exists()


def test_audit_reports_the_provenance_of_a_refed_run() -> None:
    from dora_rl.consumers.audit import audit_records

    config = DoraConfig.from_dict({"mode": "dora", "max_staleness": 1, "steps": 2, "train_batch_size": 2,
                                   "rollout_batch_size": 2, "group_size": 2})
    copied = TrainBatch(run_id="new", batch_id="new/step0", train_step=0, base_version=0, max_staleness=1,
                        created_ms=0, trajectories=(_traj("a", "g", 0), _traj("b", "g", 0)),
                        provenance=Provenance("src", topics.BATCHES, 0, 3))
    refed = [_traj(f"{i}", "h", 1).replace(run_id="new", provenance=Provenance("src2", topics.SCORED, 1, i))
             for i in range(2)]
    assembled = TrainBatch(run_id="new", batch_id="new/step1", train_step=1, base_version=1, max_staleness=1,
                           created_ms=0, trajectories=tuple(refed))
    rep = audit_records("new", config, [], [], [copied, assembled])
    assert rep.provenance == {"src": {"batches": 1, "trajectories": 2}, "src2": {"batches": 0, "trajectories": 2}}
    assert rep.c2_not_dispatched == 0 and rep.ids_unbalanced == 0 and rep.verdict == "PASS", rep.render()
    assert "re-fed from run src: 1 batches, 2 trajectories" in rep.render()
    fresh = audit_records("new", config, [], [], [copied.replace(provenance=None), assembled])
    assert fresh.c2_not_dispatched == 2 and fresh.ids_unbalanced == 2  # without provenance: never dispatched


def test_replay_command_line_keeps_dump_as_the_default_verb() -> None:
    from dora_rl.consumers.replay.command import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    dump = p.parse_args(["--run", "r1", "--topic", topics.BATCHES, "--version", "2"])
    assert (dump.verb, dump.run, dump.topic, dump.version) == (None, "r1", topics.BATCHES, 2)
    before = p.parse_args(["--run", "r1", "retrain", "--step", "3"])
    assert (before.verb, before.run, before.step, before.set_reward) == ("retrain", "r1", 3, [])
    after = p.parse_args(["retrain", "--run", "r2", "--step", "1", "--set-reward", "r/p0/1=0.5"])
    assert (after.run, after.set_reward) == ("r2", [("r/p0/1", 0.5)])
    e = p.parse_args(["export", "--out", "x.parquet", "--staleness", "1:", "--reward", ":0.5"])
    assert e.staleness == (1.0, float("inf")) and e.reward == (float("-inf"), 0.5)


def test_a_step_retrained_from_a_checkpoint_is_bit_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's state after step k, saved and restored, reproduces step k+1 exactly (also from
    an earlier checkpoint replayed forward); a changed reward does not."""
    from dora_rl.consumers.replay.retrain import weights_checksum
    from dora_rl.consumers.trainer import checkpoint
    from dora_rl.consumers.trainer.step import build_state, single_thread, train_step
    from dora_rl.modeling import state_dict_for_transfer

    monkeypatch.setenv("DORA_HOME", str(tmp_path / "home"))
    config = DoraConfig.from_dict({"mode": "dora", "max_staleness": 1, "train_batch_size": 8, "rollout_batch_size": 8,
                                   "group_size": 4, "minibatches": 2, "lr": 1e-3, "lr_warmup_steps": 2,
                                   "sft_steps": 0})
    rng = np.random.default_rng(0)

    def batch(step: int) -> TrainBatch:
        trajs = tuple(_traj(f"s{step}/{i}", f"s{step}g{i // 4}", max(0, step - i % 2), float(rng.random()),
                            response=int(rng.integers(2, 6)), prompt=tuple(int(x) for x in rng.integers(4, 30, 5)))
                      for i in range(8))
        return TrainBatch(run_id="r", batch_id=f"r/step{step}", train_step=step, base_version=step, max_staleness=1,
                          created_ms=0, trajectories=trajs)

    b0, b1 = batch(0), batch(1)

    def checksum(state: object) -> str:
        return weights_checksum(state_dict_for_transfer(state.model))  # type: ignore[attr-defined]

    root = tmp_path / "ckpt"
    with single_thread():
        a = build_state(config)
        checkpoint.save_replayable(root, 0, a.model, a.tokenizer, a.optimizer, a.lr_schedule, 0)
        train_step(a, b0, config)
        checkpoint.save_replayable(root, 1, a.model, a.tokenizer, a.optimizer, a.lr_schedule, 1)
        stats = train_step(a, b1, config)
        original = checksum(a)
        assert stats["staleness_max"] == 1 and stats["grad_norm"] > 0
        assert sorted(checkpoint.complete_versions(root)) == [0, 1]
        b = build_state(config)
        assert checkpoint.load(root / "v000001", b.model, b.optimizer, b.lr_schedule) == 1
        again = train_step(b, b1, config)
        assert checksum(b) == original and again["loss"] == stats["loss"]
        c = build_state(config)
        checkpoint.load(root / "v000000", c.model, c.optimizer, c.lr_schedule)
        train_step(c, b0, config)
        train_step(c, b1, config)
        assert checksum(c) == original
        d = build_state(config)
        checkpoint.load(root / "v000001", d.model, d.optimizer, d.lr_schedule)
        first = b1.trajectories[0]
        train_step(d, b1.replace(trajectories=(first.replace(reward=1.0 - float(first.reward or 0)),
                                               *b1.trajectories[1:])), config)
        assert checksum(d) != original
    assert torch.get_num_threads() >= 1


def test_every_record_type_exports_to_arrow_with_its_schema() -> None:
    import json

    import pyarrow as pa

    from dora_rl.consumers.replay.arrow import arrow_schema, row_of
    from dora_rl.schemas import codec
    from dora_rl.schemas.records import RECORDS

    def conv(v: object) -> object:
        if isinstance(v, str) and v.startswith("hex:"):
            return bytes.fromhex(v[4:])
        if isinstance(v, list):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    for name, cls in RECORDS.items():
        samples = sorted((codec.SCHEMA_DIR / "golden" / name.split(".")[-1]).glob("valid_*.json"))
        assert samples
        for path in samples:
            record = cls.decode(*codec.encode(name, conv(json.loads(path.read_text()))))  # type: ignore[arg-type]
            table = pa.Table.from_pylist([row_of(record)], schema=arrow_schema(name))
            fields = json.loads((codec.SCHEMA_DIR / codec.SCHEMA_FILES[name]).read_text())["fields"]
            assert table.num_rows == 1 and table.schema.names == [f["name"] for f in fields]
            for f in fields:
                if f.get("doc"):
                    assert f["doc"].encode() in table.schema.field(f["name"]).metadata[b"doc"]
