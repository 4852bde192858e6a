#!/usr/bin/env python3
"""A data-lake sink: a DORA run's scored trajectories as JSON lines, exactly once, standalone.

Needs only ``confluent_kafka``, ``fastavro`` and the ``.avsc`` files (``--schemas``); imports nothing of
``dora_rl``::

    python examples/jsonl_sink.py --bootstrap-servers HOST:PORT --run-id RUN_ID --out lake/

writes ``lake/<run_id>/part-<partition>.jsonl``: one object per committed record of the run on
``dora.rollout.scored`` (``read_committed``: never a record of an aborted scorer transaction), its
fields as in ``trajectory.avsc`` with the packed arrays unpacked (``prompt_ids``/``response_ids``:
int32 lists, ``behaviour_logprobs``: float32 list, ``token_versions``: int64 list or null) and
``_partition``/``_offset``: where it lies in Kafka.

Invariant (exactly once in the files): the files are the sink's only position. On start, a partial last
line (a crash mid-write) is cut off and each partition resumes after the last ``_offset`` written, else
at the run's start offset (``dora.runs``); lines are appended in offset order and flushed. So a killed
and restarted sink neither skips nor repeats a record. It uses no consumer group and commits nothing.

It follows the run until ``dora.runs`` records it FINISHED or FAILED, then drains to the end and exits;
``--no-follow`` drains what is there now. Kafka security: the ``DORA_KAFKA_*`` variables (see
``examples/reward_service.py``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

import fastavro
from confluent_kafka import Consumer, TopicPartition

RUNS = "dora.runs"
def run_topic(run_id: str, name: str) -> str:
    """The topic holding ``dora.<name>`` for run ``run_id``: every run has its own, ``dora.<run_id>.<name>``."""
    return f"dora.{run_id}.{name}"

PACKED = {"prompt_ids": "i", "response_ids": "i", "behaviour_logprobs": "f", "token_versions": "q"}


def security_config(env: Any = os.environ) -> dict[str, Any]:
    """librdkafka settings from ``DORA_KAFKA_SECURITY_PROTOCOL`` (``SASL_SSL``), ``..._SASL_MECHANISM``,
    ``..._SASL_USERNAME``, ``..._SASL_PASSWORD[_FILE]`` and ``..._SSL_CA_FILE``; nothing set: PLAINTEXT."""
    protocol = env.get("DORA_KAFKA_SECURITY_PROTOCOL", "PLAINTEXT").upper()
    if protocol == "PLAINTEXT":
        return {}
    password = env.get("DORA_KAFKA_SASL_PASSWORD") or Path(env["DORA_KAFKA_SASL_PASSWORD_FILE"]).read_text().strip()
    return {"security.protocol": protocol, "sasl.mechanisms": env.get("DORA_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512"),
            "sasl.username": env["DORA_KAFKA_SASL_USERNAME"], "sasl.password": password,
            "ssl.ca.location": env["DORA_KAFKA_SSL_CA_FILE"]}


def load_schema(directory: Path, filename: str) -> Any:
    return fastavro.parse_schema(json.loads((directory / filename).read_text()), named_schemas={})


def decode(schema: Any, value: bytes | None) -> dict[str, Any] | None:
    """Schemaless Avro body -> datum (records here are written with the current ``.avsc``), or None for bytes that
    are not one (anyone may write to a topic: such a record is passed over with a warning)."""
    buf = io.BytesIO(value or b"")
    try:
        datum = fastavro.schemaless_reader(buf, schema, schema)
        if buf.tell() == len(value or b"") and isinstance(datum, dict):
            return datum
    except Exception:  # fastavro raises many types on garbage
        pass
    print(f"passing over {len(value or b'')} bytes that are not a {schema['name']}", file=sys.stderr)
    return None


def run_record(base: dict[str, Any], schema: Any, run_id: str) -> dict[str, Any]:
    """The run's latest record on ``dora.runs`` (compacted, one partition)."""
    consumer = Consumer({**base, "group.id": "dora-reader-jsonl-sink", "enable.auto.commit": False})
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(RUNS, 0), timeout=15)
        consumer.assign([TopicPartition(RUNS, 0, low)])
        found, position, deadline = None, low, time.monotonic() + 30
        while position < high and time.monotonic() < deadline:
            for msg in consumer.consume(500, 0.5):
                if msg.error() is None:
                    position = (msg.offset() or 0) + 1
                    info = decode(schema, msg.value())
                    if info is not None and info["run_id"] == run_id and info["start_offsets"]:
                        found = info
        if found is None:
            raise SystemExit(f"run {run_id} is not recorded on {RUNS}")
        return found
    finally:
        consumer.close()


def row(datum: dict[str, Any], partition: int, offset: int) -> dict[str, Any]:
    """A trajectory as a JSON-able object (packed little-endian arrays unpacked)."""
    out = dict(datum)
    for name, code in PACKED.items():
        raw = out.get(name)
        if raw is not None:
            out[name] = list(struct.unpack(f"<{len(raw) // struct.calcsize(code)}{code}", raw))
    return {**out, "_partition": partition, "_offset": offset}


def resume_offset(path: Path) -> int | None:
    """Offset after the last complete line of ``path`` (a partial last line is cut off), or None."""
    if not path.exists():
        return None
    data = path.read_bytes()
    complete = data[:data.rfind(b"\n") + 1]
    if len(complete) != len(data):
        with path.open("r+b") as fh:
            fh.truncate(len(complete))
    lines = complete.splitlines()
    return json.loads(lines[-1])["_offset"] + 1 if lines else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bootstrap-servers", default=os.environ.get("DORA_BOOTSTRAP_SERVERS", "localhost:9092"))
    p.add_argument("--run-id", required=True)
    p.add_argument("--out", required=True, help="directory; files go to <out>/<run_id>/part-<p>.jsonl")
    p.add_argument("--schemas", default="dora_rl/schemas", help="directory of the .avsc files")
    p.add_argument("--no-follow", action="store_true", help="drain what is committed now, then exit")
    args = p.parse_args(argv)
    base = {"bootstrap.servers": args.bootstrap_servers, **security_config()}
    schemas = Path(args.schemas)
    trajectory, run_info = load_schema(schemas, "trajectory.avsc"), load_schema(schemas, "run_info.avsc")
    info = run_record(base, run_info, args.run_id)
    scored = run_topic(args.run_id, "rollout.scored")
    start = {o["partition"]: o["offset"] for o in info["start_offsets"] if o["topic"] == scored}
    out_dir = Path(args.out) / args.run_id
    out_dir.mkdir(parents=True, exist_ok=True)
    consumer = Consumer({**base, "group.id": "dora-reader-jsonl-sink", "enable.auto.commit": False,
                         "isolation.level": "read_committed", "enable.partition.eof": True})
    runs = Consumer({**base, "group.id": "dora-reader-jsonl-sink", "enable.auto.commit": False})
    parts = sorted(consumer.list_topics(scored, timeout=15).topics[scored].partitions)
    files, assignment = {}, []
    for part in parts:
        path = out_dir / f"part-{part}.jsonl"
        offset = resume_offset(path)
        assignment.append(TopicPartition(scored, part, start.get(part, 0) if offset is None else offset))
        files[part] = path.open("a")
    consumer.assign(assignment)
    runs.assign([TopicPartition(RUNS, 0, runs.get_watermark_offsets(TopicPartition(RUNS, 0), timeout=15)[1])])
    over = args.no_follow or info["state"] != "STARTED"
    at_end: set[int] = set()
    written = 0
    try:
        while not (over and at_end >= set(parts)):
            for msg in consumer.consume(500, 0.5):
                if msg.error() is not None:  # partition EOF: that partition is drained for now
                    at_end.add(msg.partition())
                    continue
                at_end.discard(msg.partition())
                datum = decode(trajectory, msg.value())
                if datum is not None and datum["run_id"] == args.run_id:
                    files[msg.partition()].write(json.dumps(row(datum, msg.partition(), msg.offset())) + "\n")
                    written += 1
            for fh in files.values():
                fh.flush()
            for msg in runs.consume(100, 0):
                if msg.error() is None:
                    rec = decode(run_info, msg.value())
                    over = over or (rec is not None and rec["run_id"] == args.run_id
                                    and rec["state"] in ("FINISHED", "FAILED"))
    finally:
        for fh in files.values():
            fh.close()
        consumer.close()
        runs.close()
    print(f"wrote {written} scored trajectories of run {args.run_id} to {out_dir}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
