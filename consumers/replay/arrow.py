"""Arrow (Parquet) columns from the Avro schemas: one column per field, the field's ``doc`` as metadata.

The ``.avsc`` files stay the one source of the fields and their meaning; this module only maps them.
Avro -> Arrow: ``string`` and ``enum`` -> string; ``int`` -> int32; ``long`` -> int64; ``float`` ->
float32; ``double`` -> float64; ``boolean`` -> bool; ``bytes`` -> binary, except the *packed* fields
(:func:`dora_rl.schemas.records.packed`: token ids, log-probs, per-token versions), which become lists
of their element type (int32, float32, int64); ``["null", T]`` -> nullable T; ``array`` -> list;
``map`` -> map<string, T>; ``record`` -> struct (nested fields keep their docs too).

Column metadata: ``doc`` (the field's doc, with a note on packed fields; the record's doc where the
field has none of its own is not invented: the key is then absent) and ``avro_type`` (the field's
Avro type as JSON). Schema metadata: ``dora.record`` (full name) and ``dora.record.doc``.
Rows (:func:`row_of`) hold plain Python values: arrays as lists, nested records as dicts, maps as
key/value pairs, so ``pyarrow.Table.from_pylist(rows, schema)`` builds the table.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from functools import cache
from typing import Any

import numpy as np
import pyarrow as pa

from dora_rl.schemas.codec import SCHEMA_DIR, SCHEMA_FILES
from dora_rl.schemas.records import RECORDS, Record

NAMESPACE = "dora.v1"
PRIMITIVES: dict[str, pa.DataType] = {
    "string": pa.string(), "int": pa.int32(), "long": pa.int64(), "float": pa.float32(),
    "double": pa.float64(), "boolean": pa.bool_(), "bytes": pa.binary(),
}
PACKED: dict[str, pa.DataType] = {"<i4": pa.int32(), "<f4": pa.float32(), "<i8": pa.int64()}


def _full(name: str) -> str:
    return name if "." in name else f"{NAMESPACE}.{name}"


@cache
def named_types() -> dict[str, dict[str, Any]]:
    """Every named Avro type (records and enums, nested ones included) of the current schemas."""
    out: dict[str, dict[str, Any]] = {}

    def walk(t: Any) -> None:
        if isinstance(t, list):
            for x in t:
                walk(x)
        elif isinstance(t, dict):
            if t.get("type") in ("record", "enum") and "name" in t:
                out[_full(t["name"])] = t
            for f in t.get("fields", ()):
                walk(f["type"])
            for k in ("items", "values"):
                if k in t:
                    walk(t[k])

    for filename in SCHEMA_FILES.values():
        walk(json.loads((SCHEMA_DIR / filename).read_text()))
    return out


@cache
def record_classes() -> dict[str, type[Record]]:
    """Record class of every named record type, nested ones included (to find packed fields)."""
    out: dict[str, type[Record]] = {}
    todo = list(RECORDS.values())
    while todo:
        cls = todo.pop()
        out[cls.SCHEMA] = cls
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            for key in ("nested", "nested_one"):
                if key in f.metadata and f.metadata[key].SCHEMA not in out:
                    todo.append(f.metadata[key])
    return out


def _packed_dtypes(record: str) -> dict[str, str]:
    cls = record_classes().get(record)
    if cls is None:
        return {}
    return {f.name: f.metadata["packed"].str for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if "packed" in f.metadata}


def arrow_type(avro: Any, packed: str | None = None) -> tuple[pa.DataType, bool]:
    """``(arrow type, nullable)`` of an Avro type (``packed``: the numpy dtype string of a packed field)."""
    if isinstance(avro, list):
        rest = [t for t in avro if t != "null"]
        if len(rest) != 1:
            raise ValueError(f"union {avro} has no single non-null branch")
        return arrow_type(rest[0], packed)[0], "null" in avro
    if isinstance(avro, str):
        if avro == "bytes" and packed is not None:
            return pa.list_(PACKED[packed]), False
        if avro in PRIMITIVES:
            return PRIMITIVES[avro], False
        return arrow_type(named_types()[_full(avro)])[0], False
    kind = avro["type"]
    if kind == "enum":
        return pa.string(), False
    if kind == "array":
        return pa.list_(arrow_type(avro["items"])[0]), False
    if kind == "map":
        return pa.map_(pa.string(), arrow_type(avro["values"])[0]), False
    if kind == "record":
        return pa.struct(record_fields(_full(avro["name"]))), False
    return arrow_type(kind, packed)


def record_fields(record: str) -> list[pa.Field]:
    """The Arrow fields of Avro record ``record`` (full name), in schema order, docs as metadata."""
    raw = named_types()[record]
    packed = _packed_dtypes(record)
    out = []
    for f in raw["fields"]:
        typ, nullable = arrow_type(f["type"], packed.get(f["name"]))
        meta = {"avro_type": json.dumps(f["type"])}
        doc = f.get("doc", "")
        if f["name"] in packed:
            note = f"Packed {packed[f['name']]} bytes on the wire; a list here."
            doc = f"{doc} {note}".strip()
        if doc:
            meta["doc"] = doc
        out.append(pa.field(f["name"], typ, nullable=nullable, metadata=meta))
    return out


def arrow_schema(record: str, extra: Sequence[pa.Field] = ()) -> pa.Schema:
    """Columns of ``record`` followed by ``extra`` ones; schema metadata names the record and its doc."""
    raw = named_types()[record]
    return pa.schema([*record_fields(record), *extra],
                     metadata={"dora.record": record, "dora.record.doc": raw.get("doc", "")})


def column(name: str, typ: pa.DataType, doc: str, nullable: bool = True) -> pa.Field:
    """A derived column (not a schema field) with its doc."""
    return pa.field(name, typ, nullable=nullable, metadata={"doc": doc})


def plain(value: Any) -> Any:
    """A record's value as Arrow takes it (see the module docstring)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Record):
        return row_of(value)
    if isinstance(value, tuple | list):
        return [plain(v) for v in value]
    if isinstance(value, dict):
        return [(k, plain(v)) for k, v in value.items()]
    return value


def row_of(record: Record) -> dict[str, Any]:
    """One row: every field of ``record`` as a plain value."""
    return {f.name: plain(getattr(record, f.name)) for f in dataclasses.fields(record)}  # type: ignore[arg-type]
