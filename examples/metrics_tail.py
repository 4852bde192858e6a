#!/usr/bin/env python3
"""A dashboard feed: a DORA run's ``dora.metrics`` as lines (or JSON lines), live, standalone.

Needs only ``confluent_kafka``, ``fastavro`` and ``metric.avsc`` / ``run_info.avsc`` (``--schemas``);
imports nothing of ``dora_rl``::

    python examples/metrics_tail.py --bootstrap-servers HOST:PORT --run-id RUN_ID [--name reward_mean] [--json]

prints one line per metric of the run, in log order: ``<ts> <component>/<name> step=<s> version=<v> <value>``
(``--json``: the ``Metric`` record as a JSON object, one per line, for a dashboard to ingest). Reads from
the run's start offset (``dora.runs``) unless ``--from-end``; follows until ``dora.runs`` records the
run FINISHED or FAILED, then drains and exits (``--no-follow``: print what is there and exit).
Invariant: read-only and group-less (``assign``, no commits): a tail never moves any offset of the run's
roles, and as many tails as wanted may run. Kafka security: the ``DORA_KAFKA_*`` variables (see
``examples/reward_service.py``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
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


def decode(schema: Any, value: bytes | None) -> dict[str, Any] | None:
    """The datum, or None for bytes that are not one (passed over with a warning: anyone may write to a topic)."""
    buf = io.BytesIO(value or b"")
    try:
        datum = fastavro.schemaless_reader(buf, schema, schema)
        if buf.tell() == len(value or b"") and isinstance(datum, dict):
            return datum
    except Exception:  # fastavro raises many types on garbage
        pass
    print(f"passing over {len(value or b'')} bytes that are not a {schema['name']}", file=sys.stderr)
    return None


def run_record(consumer: Consumer, schema: Any, run_id: str) -> dict[str, Any]:
    """The run's latest record on ``dora.runs`` (compacted, one partition)."""
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


def render(m: dict[str, Any], as_json: bool) -> str:
    if as_json:
        return json.dumps(m, sort_keys=True)
    when = time.strftime("%H:%M:%S", time.localtime(m["ts_ms"] / 1000))
    extra = "".join(f" {k}={m[k]}" for k in ("step", "version") if m[k] is not None)
    return f"{when} {m['component']}/{m['name']}{extra} {m['value']:.6g}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--bootstrap-servers", default=os.environ.get("DORA_BOOTSTRAP_SERVERS", "localhost:9092"))
    p.add_argument("--run-id", required=True)
    p.add_argument("--schemas", default="dora_rl/schemas", help="directory of the .avsc files")
    p.add_argument("--component", default=None, help="only this component (trainer, orchestrator, ...)")
    p.add_argument("--name", default=None, help="only metrics of this name (reward_mean, ...)")
    p.add_argument("--json", action="store_true", help="JSON lines")
    p.add_argument("--from-end", action="store_true", help="only metrics written from now on")
    p.add_argument("--no-follow", action="store_true", help="print what is there, then exit")
    args = p.parse_args(argv)
    base = {"bootstrap.servers": args.bootstrap_servers, "group.id": "dora-reader-metrics-tail",
            "enable.auto.commit": False, **security_config()}
    schemas = Path(args.schemas)
    metric, run_info = (fastavro.parse_schema(json.loads((schemas / f).read_text()), named_schemas={})
                        for f in ("metric.avsc", "run_info.avsc"))
    runs = Consumer(base)
    info = run_record(runs, run_info, args.run_id)
    metrics = run_topic(args.run_id, "metrics")
    runs.assign([TopicPartition(RUNS, 0, runs.get_watermark_offsets(TopicPartition(RUNS, 0), timeout=15)[1])])
    consumer = Consumer({**base, "isolation.level": "read_committed", "enable.partition.eof": True})
    start = {o["partition"]: o["offset"] for o in info["start_offsets"] if o["topic"] == metrics}
    parts = sorted(consumer.list_topics(metrics, timeout=15).topics[metrics].partitions)
    consumer.assign([TopicPartition(metrics, q, consumer.get_watermark_offsets(TopicPartition(metrics, q))[1]
                                    if args.from_end else start.get(q, 0)) for q in parts])
    over = args.no_follow or info["state"] != "STARTED"
    at_end: set[int] = set()
    try:
        while not (over and at_end >= set(parts)):
            for msg in consumer.consume(500, 0.5):
                if msg.error() is not None:  # partition EOF
                    at_end.add(msg.partition())
                    continue
                at_end.discard(msg.partition())
                m = decode(metric, msg.value())
                if m is not None and m["run_id"] == args.run_id and args.component in (None, m["component"]) \
                        and args.name in (None, m["name"]):
                    print(render(m, args.json), flush=True)
            for msg in runs.consume(100, 0):
                if msg.error() is None:
                    rec = decode(run_info, msg.value())
                    over = over or (rec is not None and rec["run_id"] == args.run_id
                                    and rec["state"] in ("FINISHED", "FAILED"))
    except (KeyboardInterrupt, BrokenPipeError):
        pass
    finally:
        consumer.close()
        runs.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
