"""``dora-rl replay`` (verb ``dump``, the default): a run's records, decoded, as JSON lines, for debugging.

Reads one topic of a run from the run's start offsets to the current end (no consumer group, so it
never disturbs the live run), or from an archive of the run, and writes one JSON object per record:
the record's fields, token ids / log-probs as lists, bytes as hex, plus ``_partition`` and ``_offset``.
Filters: ``version`` (from the key: no value is decoded for other versions) and ``group``. An
undecodable record is written as ``{"offset", "partition", "error"}`` (it is never skipped silently).
"""

from __future__ import annotations

import json
from typing import Any, TextIO

import numpy as np

from dora_rl.infra.kafka import topics
from dora_rl.schemas.codec import DecodeError
from dora_rl.schemas.records import RECORDS

from .source import KafkaSource, RecordSource


def to_jsonable(value: Any) -> Any:
    """Numpy arrays and bytes made JSON-friendly."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, tuple | list):
        return [to_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {k: to_jsonable(v) for k, v in value.items()}
    if hasattr(value, "to_avro"):
        return {k: to_jsonable(getattr(value, k)) for k in value.to_avro()}
    return value


def dump(source: RecordSource, topic: str, out: TextIO, version: int | None = None, group: str | None = None) -> int:
    """Write the run's records of ``topic`` from ``source`` to ``out``; returns how many were written."""
    run_id = source.run_info().run_id
    cls = RECORDS[topics.spec(topic).schema]
    n = 0
    for raw in source.raw(topic, version):
        try:
            record = cls.decode(raw.value, list(raw.headers))
        except DecodeError as exc:
            out.write(json.dumps({"offset": raw.offset, "partition": raw.partition, "error": str(exc)}) + "\n")
            continue
        if getattr(record, "run_id", run_id) != run_id:
            continue
        if group is not None and getattr(record, "group_id", None) != group:
            continue
        row = to_jsonable(record)
        row["_partition"], row["_offset"] = raw.partition, raw.offset
        out.write(json.dumps(row) + "\n")
        n += 1
    return n


def replay(bootstrap: str, run_id: str | None, topic: str, out: TextIO, version: int | None = None,
           group: str | None = None) -> int:
    """:func:`dump` of run ``run_id`` (latest if None) read from the cluster at ``bootstrap``."""
    return dump(KafkaSource(bootstrap, run_id), topic, out, version, group)
