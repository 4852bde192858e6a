"""Kept wire bytes (schemas/records.py): the scorer's spliced output and a batch built from its
trajectories' encodings are byte for byte what the full encoding writes."""

from __future__ import annotations

import io

import fastavro
import numpy as np
import pytest

from dora_rl.schemas import codec
from dora_rl.schemas.records import Provenance, TrainBatch, Trajectory


def _traj(i: int, *, versions: bool = False, provenance: bool = False, reward: float | None = None) -> Trajectory:
    n = 3 + 40 * i
    return Trajectory(run_id="r", trajectory_id=f"r/p{i}/0", group_id=f"r/p{i}", prompt_id=f"r/p{i}", sample_index=0,
                      group_size=1, policy_version=i, task="reverse", reference="ab" * i,
                      prompt_ids=np.arange(5, dtype=np.int32), response_ids=np.arange(n, dtype=np.int32),
                      behaviour_logprobs=np.full(n, -0.25, np.float32), response_text="ba" * i,
                      token_versions=np.full(n, i, np.int64) if versions else None, reward=reward,
                      scored_ms=1 if reward is not None else None,
                      provenance=Provenance("old", "dora.rollout.scored", 1, 7) if provenance else None)


def _full(rec: Trajectory | TrainBatch) -> bytes:
    return codec.encode(rec.SCHEMA, rec.to_avro())[0]


@pytest.mark.parametrize("kind", ["plain", "versions", "provenance", "already_scored"])
@pytest.mark.parametrize("scored_ms", [0, 1, 63, 64, 1_795_475_534_675, -5])
def test_scored_splice_equals_the_full_encoding(kind: str, scored_ms: int) -> None:
    src = _traj(3, versions=kind == "versions", provenance=kind == "provenance",
                reward=0.5 if kind == "already_scored" else None)
    value, headers = src.encode()
    kept = Trajectory.decode(value, headers, keep_wire=True)
    assert kept.encode() == (value, headers)
    for reward in (0.0, 1.0, 0.123456789, 1):
        out = kept.scored(reward, scored_ms)
        assert out.encode()[0] == _full(out)
        assert Trajectory.decode(*out.encode()).reward == reward
    assert kept.replace(reward=0.5).encode()[0] == _full(kept.replace(reward=0.5)), "replace() drops kept bytes"


def test_bytes_of_an_older_writer_schema_are_not_kept() -> None:
    old = codec.historical_schemas("v1")["dora.v1.Trajectory"]  # no provenance: its bytes end in 3 zeros too
    t = _traj(2)
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, old, {k: v for k, v in t.to_avro().items() if k != "provenance"})
    assert buf.getvalue().endswith(b"\0\0\0")
    headers = [(codec.HEADER_SCHEMA, t.SCHEMA.encode()),
               (codec.HEADER_FINGERPRINT, codec.schema_fingerprint(old).encode())]
    rec = Trajectory.decode(buf.getvalue(), headers, keep_wire=True)
    assert rec._wire() is None
    out = rec.scored(0.5, 3)
    assert out.encode()[0] == _full(out)
    assert Trajectory.decode(*t.encode())._wire() is None, "kept only when asked"


@pytest.mark.parametrize("n", [0, 1, 5, 70])
def test_batch_of_kept_and_fresh_trajectories_equals_the_full_encoding(n: int) -> None:
    trajs = []
    for i in range(n):
        t = _traj(i % 7, versions=i % 3 == 0)
        trajs.append(Trajectory.decode(*t.encode(), keep_wire=True).scored(0.25, 10 + i) if i % 2 else t)
    batch = TrainBatch(run_id="r", batch_id="r/step4", train_step=4, base_version=4, max_staleness=1, created_ms=9,
                       trajectories=tuple(trajs))
    assert batch.encode()[0] == _full(batch)
    back = TrainBatch.decode(*batch.encode())
    assert [t.trajectory_id for t in back.trajectories] == [t.trajectory_id for t in trajs]
    with_prov = batch.replace(provenance=Provenance("old", "dora.train.batches", 0, 3))
    assert with_prov.encode()[0] == _full(with_prov)
