"""Schemas: files are the source of truth; golden samples; compatibility with every earlier version."""

from __future__ import annotations

import dataclasses
import io
import json
from pathlib import Path
from typing import Any

import fastavro
import numpy as np
import pytest

from dora_rl.schemas import codec
from dora_rl.schemas.records import RECORDS, Record, Trajectory

GOLDEN = codec.SCHEMA_DIR / "golden"


def _load_sample(path: Path) -> dict[str, Any]:
    def conv(v: Any) -> Any:
        if isinstance(v, str) and v.startswith("hex:"):
            return bytes.fromhex(v[4:])
        if isinstance(v, list):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        return v

    return conv(json.loads(path.read_text()))


def _samples(kind: str) -> list[tuple[str, Path]]:
    return [(name.split(".")[-1], p) for name in codec.SCHEMA_FILES
            for p in sorted((GOLDEN / name.split(".")[-1]).glob(f"{kind}_*.json"))]


def test_every_schema_file_parses_and_has_golden_samples() -> None:
    parsed = codec.current_schemas()
    assert set(parsed) == set(codec.SCHEMA_FILES)
    for name in codec.SCHEMA_FILES:
        short = name.split(".")[-1]
        assert list((GOLDEN / short).glob("valid_*.json")), f"no valid golden sample for {name}"
        assert list((GOLDEN / short).glob("invalid_*.json")), f"no invalid golden sample for {name}"


@pytest.mark.parametrize("name", sorted(codec.SCHEMA_FILES))
def test_record_classes_mirror_schema_fields(name: str) -> None:
    raw = json.loads((codec.SCHEMA_DIR / codec.SCHEMA_FILES[name]).read_text())
    schema_fields = {f["name"] for f in raw["fields"]}
    class_fields = {f.name for f in dataclasses.fields(RECORDS[name])}  # type: ignore[arg-type]
    assert schema_fields == class_fields


@pytest.mark.parametrize(("short", "path"), _samples("valid"), ids=lambda x: str(x))
def test_valid_golden_samples_round_trip(short: str, path: Path) -> None:
    name = f"dora.v1.{short}"
    datum = _load_sample(path)
    value, headers = codec.encode(name, datum)
    record = RECORDS[name].decode(value, headers)
    again, _ = record.encode()
    assert again == value  # the typed record loses nothing


@pytest.mark.parametrize(("short", "path"), _samples("invalid"), ids=lambda x: str(x))
def test_invalid_golden_samples_are_refused(short: str, path: Path) -> None:
    name = f"dora.v1.{short}"
    datum = _load_sample(path)
    with pytest.raises((ValueError, codec.DecodeError)):
        value, headers = codec.encode(name, datum)
        RECORDS[name].decode(value, headers)


def _restrict(datum: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """The datum as a writer of ``schema`` would produce it: only its fields, defaults for new ones."""
    out = {}
    for f in schema["fields"]:
        out[f["name"]] = datum[f["name"]] if f["name"] in datum else f.get("default")
    return out


@pytest.mark.parametrize("version", codec.history_versions() or ["none"])
@pytest.mark.parametrize("name", sorted(codec.SCHEMA_FILES))
def test_full_compatibility_with_every_earlier_version(name: str, version: str) -> None:
    """FULL compatibility: old writers are readable by the new schema and new writers by the old one."""
    if version == "none":
        pytest.fail("schemas/history/ must hold at least the first released version")
    old = codec.historical_schemas(version).get(name)
    if old is None:
        return  # the record did not exist in that version
    new = codec.current_schemas()[name]
    old_raw = json.loads((codec.HISTORY_DIR / version / codec.SCHEMA_FILES[name]).read_text())
    new_raw = json.loads((codec.SCHEMA_DIR / codec.SCHEMA_FILES[name]).read_text())
    old_names = {f["name"] for f in old_raw["fields"]}
    for f in new_raw["fields"]:
        if f["name"] not in old_names:
            assert "default" in f, f"{name}.{f['name']} was added after {version} without a default"
    new_names = {f["name"] for f in new_raw["fields"]}
    for f in old_raw["fields"]:
        if f["name"] not in new_names:
            assert "default" in f, f"{name}.{f['name']} was removed after {version} but had no default"
    for _, path in [s for s in _samples("valid") if s[0] == name.split(".")[-1]]:
        datum = _load_sample(path)
        for writer, reader, writer_raw in ((old, new, old_raw), (new, old, new_raw)):
            buf = io.BytesIO()
            fastavro.schemaless_writer(buf, writer, _restrict(datum, writer_raw))
            buf.seek(0)
            fastavro.schemaless_reader(buf, writer, reader)


def test_trajectory_bytes_decode_with_only_the_avsc_and_fastavro() -> None:
    traj = Trajectory(run_id="r", trajectory_id="t", group_id="g", prompt_id="p", sample_index=0, group_size=2,
                      policy_version=5, task="reverse", reference="ab", prompt_ids=np.array([1, 2, 3]),
                      response_ids=np.array([7, 8, 2]), behaviour_logprobs=np.array([-0.5, -0.25, -0.125]))
    value, _ = traj.encode()
    schema = fastavro.parse_schema(json.loads((codec.SCHEMA_DIR / "trajectory.avsc").read_text()))
    datum = fastavro.schemaless_reader(io.BytesIO(value), schema, None)
    assert datum["policy_version"] == 5
    assert np.frombuffer(datum["response_ids"], "<i4").tolist() == [7, 8, 2]
    assert np.frombuffer(datum["behaviour_logprobs"], "<f4").tolist() == [-0.5, -0.25, -0.125]


@pytest.mark.parametrize("garbage", [b"", b"\xff\xff\xff\xff\xff\xff\xff\xff\xff", b"\x02a"])
def test_garbage_is_a_decode_error(garbage: bytes) -> None:
    with pytest.raises(codec.DecodeError):
        Trajectory.decode(garbage)


def test_header_naming_another_record_is_refused() -> None:
    value, headers = RECORDS["dora.v1.Metric"](run_id="r", component="c", name="n", value=1.0,  # type: ignore[call-arg]
                                               ts_ms=0).encode()
    with pytest.raises(codec.DecodeError) as info:
        Trajectory.decode(value, headers)
    assert info.value.error_type == "schema"


@pytest.mark.parametrize("header", [codec.HEADER_SCHEMA, codec.HEADER_FINGERPRINT])
def test_a_header_that_is_not_utf8_is_a_decode_error(header: str) -> None:
    """A reader sees a DecodeError (one dead letter, then the next record), never a UnicodeDecodeError."""
    value, headers = RECORDS["dora.v1.Metric"](run_id="r", component="c", name="n", value=1.0,  # type: ignore[call-arg]
                                               ts_ms=0).encode()
    bad = [(k, b"\xff\xfe" if k == header else v) for k, v in headers]
    with pytest.raises(codec.DecodeError, match="not UTF-8") as info:
        RECORDS["dora.v1.Metric"].decode(value, bad)
    assert info.value.error_type == "schema"


def test_trailing_bytes_are_refused() -> None:
    value, headers = RECORDS["dora.v1.Metric"](run_id="r", component="c", name="n", value=1.0,  # type: ignore[call-arg]
                                               ts_ms=0).encode()
    with pytest.raises(codec.DecodeError):
        RECORDS["dora.v1.Metric"].decode(value + b"\x00", headers)


def test_every_record_class_is_a_record() -> None:
    assert all(issubclass(c, Record) for c in RECORDS.values())
