"""Replay of recorded rollouts for debugging: a run's records, decoded, as JSON lines.

Reads one topic of a run from the run's start offsets to the current end (no consumer group, so
it never disturbs the live run) and writes one JSON object per record: the record's fields, with
token ids / log-probs as lists and, for trajectories, the staleness-relevant ``policy_version``.
Filters: ``version`` (from the key: no value is decoded for other versions) and ``group``.
"""

from __future__ import annotations

import json
from typing import Any, TextIO

import numpy as np

from dora_rl.infra import topics
from dora_rl.infra.kafka_io import read_all
from dora_rl.infra.keys import parse_key
from dora_rl.infra.runs import get_run
from dora_rl.schemas.codec import DecodeError
from dora_rl.schemas.records import RECORDS


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


def replay(bootstrap: str, run_id: str | None, topic: str, out: TextIO, version: int | None = None,
           group: str | None = None) -> int:
    """Write the run's records of ``topic`` to ``out``; returns how many were written."""
    info = get_run(bootstrap, run_id)
    cls = RECORDS[topics.spec(topic).schema]
    start = {o.partition: o.offset for o in info.start_offsets if o.topic == topic}
    n = 0
    for msg in read_all(bootstrap, topic, start):
        key = msg.key()
        if version is not None and key:
            try:
                key_version, _ = parse_key(key)
            except ValueError:
                key_version = None
            if key_version != version:
                continue
        try:
            record = cls.decode(msg.value(), msg.headers())
        except DecodeError as exc:
            out.write(json.dumps({"offset": msg.offset(), "partition": msg.partition(), "error": str(exc)}) + "\n")
            continue
        if getattr(record, "run_id", info.run_id) != info.run_id:
            continue
        if group is not None and getattr(record, "group_id", None) != group:
            continue
        row = to_jsonable(record)
        row["_partition"], row["_offset"] = msg.partition(), msg.offset()
        out.write(json.dumps(row) + "\n")
        n += 1
    return n
