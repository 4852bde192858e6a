"""The PolicyVersion announcement: the manifest travels in it as is; ``announced_by`` evolves the schema."""

from __future__ import annotations

import io
import json

import fastavro
import pytest
import torch

from dora_rl.infra.weights import manifest as manifest_module
from dora_rl.infra.weights import pack_state_dict
from dora_rl.infra.weights.manifest import WeightManifest
from dora_rl.schemas import codec, records
from dora_rl.schemas.records import PolicyVersion


def _manifest(version: int = 5) -> WeightManifest:
    g = torch.Generator().manual_seed(0)
    sd = {"a": torch.randn(64, 64, generator=g), "b": torch.randn(3, generator=g).to(torch.bfloat16),
          "c": torch.arange(10)}
    sd["tied"] = sd["a"]
    m, _ = pack_state_dict(sd, bucket_bytes=8 << 10, version=version)
    return m


def test_manifest_entries_are_the_announcement_records() -> None:
    assert manifest_module.TensorEntry is records.TensorEntry  # no second definition in infra
    assert manifest_module.BucketEntry is records.BucketEntry
    m = _manifest()
    assert all(type(t) is records.TensorEntry for t in m.tensors)
    assert all(type(b) is records.BucketEntry for b in m.buckets)


def test_manifest_round_trips_through_the_announcement_and_the_wire() -> None:
    m = _manifest()
    ann = m.announce("run-1", 9, "tcp", ["127.0.0.1:1"], metrics={"loss": 0.25}, created_ms=123)
    assert (ann.version, ann.step, ann.created_ms, ann.holders, ann.train_metrics) == (
        5, 9, 123, ("127.0.0.1:1",), {"loss": 0.25})
    assert ann.tensors is m.tensors and ann.buckets is m.buckets  # no mapping in between
    assert WeightManifest.from_announcement(ann) == m
    wire = PolicyVersion.decode(*ann.encode())
    assert wire == ann and WeightManifest.from_announcement(wire) == m
    assert WeightManifest.from_dict(json.loads(json.dumps(m.to_dict()))) == m


def test_from_announcement_validates_the_manifest() -> None:
    ann = _manifest().announce("run-1", 1, "tcp", ["h:1"])
    with pytest.raises(ValueError, match="total_bytes"):
        WeightManifest.from_announcement(ann.replace(total_bytes=ann.total_bytes + 1))
    shifted = ann.tensors[0].replace(offset=3)
    with pytest.raises(ValueError, match="unaligned"):
        WeightManifest.from_announcement(ann.replace(tensors=(shifted, *ann.tensors[1:])))
    with pytest.raises(ValueError, match="not a weight manifest"):
        WeightManifest.from_dict({"version": 1})


@pytest.mark.parametrize("who", [PolicyVersion.TRAINER, PolicyVersion.HOLDER])
def test_announced_by_round_trips(who: str) -> None:
    ann = _manifest().announce("run-1", 1, "ucx", ["h:1"], announced_by=who)
    assert PolicyVersion.decode(*ann.encode()).announced_by == who
    assert _manifest().announce("run-1", 1, "ucx", ["h:1"]).announced_by == PolicyVersion.TRAINER  # default


def test_unknown_announcer_is_refused() -> None:
    ann = _manifest().announce("run-1", 1, "ucx", ["h:1"], announced_by="ROUTER")
    with pytest.raises(ValueError, match="PolicyVersion"):
        ann.encode()


def _v1_schema() -> dict[str, object]:
    return json.loads((codec.HISTORY_DIR / "v1" / codec.SCHEMA_FILES["dora.v1.PolicyVersion"]).read_text())


def test_record_of_a_v1_writer_decodes_with_the_default() -> None:
    """An announcement written before the field existed (v1 schema, v1 fingerprint) reads as TRAINER."""
    old = codec.historical_schemas("v1")["dora.v1.PolicyVersion"]
    datum = _manifest().announce("run-1", 2, "tcp", ["h:1"]).to_avro()
    del datum["announced_by"]
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, old, datum)
    headers = [(codec.HEADER_SCHEMA, b"dora.v1.PolicyVersion"),
               (codec.HEADER_FINGERPRINT, codec.schema_fingerprint(old).encode())]
    assert codec.schema_fingerprint(old) != codec.current_fingerprint("dora.v1.PolicyVersion")
    ann = PolicyVersion.decode(buf.getvalue(), headers)
    assert ann.announced_by == PolicyVersion.TRAINER and ann.version == 5


def test_v1_reader_reads_a_holder_announcement() -> None:
    """FULL compatibility the other way: a v1 reader skips the new field."""
    value, _ = _manifest().announce("run-1", 2, "tcp", ["h:1"], announced_by=PolicyVersion.HOLDER).encode()
    old = fastavro.parse_schema(_v1_schema())
    datum = fastavro.schemaless_reader(io.BytesIO(value), codec.schema_for("dora.v1.PolicyVersion"), old)
    assert isinstance(datum, dict) and "announced_by" not in datum and datum["version"] == 5


def test_unknown_future_announcer_reads_as_the_enum_default() -> None:
    raw = json.loads((codec.SCHEMA_DIR / codec.SCHEMA_FILES["dora.v1.PolicyVersion"]).read_text())
    field = next(f for f in raw["fields"] if f["name"] == "announced_by")
    field["type"] = {**field["type"], "symbols": [*field["type"]["symbols"], "CHECKPOINT"]}
    future = fastavro.parse_schema(raw)
    datum = {**_manifest().announce("run-1", 2, "tcp", ["h:1"]).to_avro(), "announced_by": "CHECKPOINT"}
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, future, datum)
    buf.seek(0)
    now = fastavro.schemaless_reader(buf, future, codec.schema_for("dora.v1.PolicyVersion"))
    assert isinstance(now, dict) and now["announced_by"] == PolicyVersion.TRAINER
