"""Avro encoding of every record on the wire, from the ``.avsc`` files beside this module.

The ``.avsc`` files are the single source of truth. On the wire a value is the *schemaless* Avro
binary body of one record (no container header, no registry id), so any tool holding the
``.avsc`` file and fastavro can decode it. Two headers travel with each record:

- ``dora.schema``: the full record name, e.g. ``dora.v1.Trajectory``;
- ``dora.schema.fp``: the hex Rabin (CRC-64-AVRO) fingerprint of the writer's canonical schema.

A consumer decodes with its own reader schema. When the fingerprint differs from its own (a
producer with an older or newer compatible schema), the writer schema is looked up among the
historical versions under ``history/`` and resolved into the reader schema by Avro's rules.
Any failure raises :class:`DecodeError` with the reason, so the caller can dead-letter the record.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from functools import cache
from pathlib import Path
from typing import Any

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

SCHEMA_DIR = Path(__file__).parent
HISTORY_DIR = SCHEMA_DIR / "history"
HEADER_SCHEMA = "dora.schema"
HEADER_FINGERPRINT = "dora.schema.fp"

#: Schema file per record name. Order matters: a schema may only reference names defined earlier.
SCHEMA_FILES: dict[str, str] = {
    "dora.v1.Prompt": "prompt.avsc",
    "dora.v1.PolicyVersion": "policy_version.avsc",
    "dora.v1.TokenChunk": "token_chunk.avsc",
    "dora.v1.RolloutRequest": "rollout_request.avsc",
    "dora.v1.Trajectory": "trajectory.avsc",
    "dora.v1.InstanceStatus": "instance_status.avsc",
    "dora.v1.TrainBatch": "train_batch.avsc",
    "dora.v1.DeadLetter": "dead_letter.avsc",
    "dora.v1.Metric": "metric.avsc",
    "dora.v1.RunInfo": "run_info.avsc",
    "dora.v1.BatchPlan": "batch_plan.avsc",
    "dora.v1.ProcessorSnapshot": "processor_snapshot.avsc",
}


class DecodeError(ValueError):
    """A record could not be decoded; ``error_type`` says why ('decode' or 'schema')."""

    def __init__(self, message: str, error_type: str = "decode") -> None:
        super().__init__(message)
        self.error_type = error_type


def _load_dir(directory: Path) -> dict[str, Any]:
    """Parse every known schema file in ``directory`` (in dependency order)."""
    named: dict[str, Any] = {}
    parsed: dict[str, Any] = {}
    for name, filename in SCHEMA_FILES.items():
        path = directory / filename
        if not path.exists():
            continue
        with path.open() as fh:
            raw = json.load(fh)
        parsed[name] = fastavro.parse_schema(raw, named_schemas=named)
    return parsed


@cache
def current_schemas() -> dict[str, Any]:
    """Parsed current schemas by full record name."""
    return _load_dir(SCHEMA_DIR)


@cache
def history_versions() -> tuple[str, ...]:
    """Names of the historical schema sets under ``history/`` (e.g. ``v1``), oldest first."""
    if not HISTORY_DIR.exists():
        return ()
    return tuple(sorted(p.name for p in HISTORY_DIR.iterdir() if p.is_dir()))


@cache
def historical_schemas(version: str) -> dict[str, Any]:
    """Parsed schemas of one historical set."""
    return _load_dir(HISTORY_DIR / version)


def schema_fingerprint(parsed: Any) -> str:
    """Hex CRC-64-AVRO fingerprint of a parsed schema's canonical form."""
    return str(fingerprint(to_parsing_canonical_form(parsed), "CRC-64-AVRO"))


@cache
def _writer_by_fingerprint() -> dict[str, Any]:
    table: dict[str, Any] = {}
    for version in history_versions():
        for parsed in historical_schemas(version).values():
            table[schema_fingerprint(parsed)] = parsed
    for parsed in current_schemas().values():
        table[schema_fingerprint(parsed)] = parsed
    return table


@cache
def current_fingerprint(name: str) -> str:
    """Fingerprint of the current schema of record ``name`` (cached)."""
    return schema_fingerprint(schema_for(name))


def schema_for(name: str) -> Any:
    """The current parsed schema of record ``name``; KeyError with the known names otherwise."""
    try:
        return current_schemas()[name]
    except KeyError:
        raise KeyError(f"unknown record {name!r}; known: {sorted(current_schemas())}") from None


def encode(name: str, record: Mapping[str, Any]) -> tuple[bytes, list[tuple[str, bytes]]]:
    """Encode ``record`` with the current schema of ``name``; returns (value bytes, headers).

    Raises ValueError (with the schema name) when the record does not match the schema.
    """
    parsed = schema_for(name)
    buf = io.BytesIO()
    try:
        fastavro.schemaless_writer(buf, parsed, dict(record), strict_allow_default=True)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ValueError(f"record does not match {name}: {exc}") from exc
    headers = [(HEADER_SCHEMA, name.encode()), (HEADER_FINGERPRINT, current_fingerprint(name).encode())]
    return buf.getvalue(), headers


#: Kafka headers as clients hand them over: a list of (key, value) pairs or a mapping.
Headers = list[tuple[str, Any]] | dict[str, Any] | None


def _header(headers: Headers, key: str) -> str | None:
    """The value of header ``key`` as text; a value that is not UTF-8 is a :class:`DecodeError` (like any
    other malformed input: one dead letter, never a crash of the reader)."""
    items = headers.items() if isinstance(headers, dict) else (headers or ())
    for k, v in items:
        if k == key:
            if not isinstance(v, bytes | bytearray):
                return str(v)
            try:
                return bytes(v).decode()
            except UnicodeDecodeError as exc:
                raise DecodeError(f"header {key!r} is not UTF-8: {bytes(v)[:40]!r}", "schema") from exc
    return None


def decode(name: str, value: bytes | None, headers: Headers = None) -> dict[str, Any]:
    """Decode one value as record ``name``.

    The writer schema is the one named by the fingerprint header when present (resolved into the
    current reader schema), else the current schema. Raises :class:`DecodeError` on an empty value,
    a header naming another record, an unknown fingerprint, trailing bytes or malformed Avro.
    """
    if value is None or len(value) == 0:
        raise DecodeError(f"empty value where a {name} was expected")
    reader = schema_for(name)
    declared = _header(headers, HEADER_SCHEMA)
    if declared is not None and declared != name:
        raise DecodeError(f"record declares schema {declared!r}, expected {name!r}", "schema")
    writer = reader
    fp = _header(headers, HEADER_FINGERPRINT)
    if fp is not None and fp != current_fingerprint(name):
        writer = _writer_by_fingerprint().get(fp)
        if writer is None:
            raise DecodeError(f"unknown writer schema fingerprint {fp} for {name}", "schema")
    buf = io.BytesIO(value)
    try:
        out = fastavro.schemaless_reader(buf, writer, reader)
    except Exception as exc:  # fastavro raises many types on garbage input
        raise DecodeError(f"malformed {name}: {type(exc).__name__}: {exc}") from exc
    if buf.tell() != len(value):
        raise DecodeError(f"malformed {name}: {len(value) - buf.tell()} trailing bytes")
    if not isinstance(out, dict):
        raise DecodeError(f"malformed {name}: decoded to {type(out).__name__}")
    return out
