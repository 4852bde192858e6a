#!/usr/bin/env python3
"""A live aggregation of a DORA run as a Faust app: the mean reward of each policy version, from the scored
trajectories on ``dora.rollout.scored``, kept in a Faust table (changelogged, so a restarted worker resumes it).

Needs ``faust-streaming``, ``fastavro`` and ``trajectory.avsc`` (``--schemas``); imports nothing of ``dora_rl``::

    python examples/faust_reward_by_version.py --bootstrap-servers HOST:PORT --run-id RUN_ID worker -l info

prints, every ``--every`` seconds, one line per version: ``v<version> n=<trajectories> mean_reward=<r>``.

Invariants: the table is keyed by ``trajectory_id``, so a trajectory scored twice (an instance restarted and
generated it again; Faust's at-least-once redelivery) counts once, with its first reward, as DORA's assembler
keeps the first copy. Records of other runs (none, on the run's own topic) and records that do not decode are passed
by (DORA's own readers dead-letter the latter). The app's consumer group is its own (``--app-id``): it moves
no offset of the run's roles. Plain-text Kafka only (Faust's SASL/SSL settings: ``broker_credentials``).
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import fastavro
import faust

TRAJECTORY = "dora.v1.Trajectory"


def trajectory_schema(schemas: Path) -> Any:
    return fastavro.parse_schema(json.loads((schemas / "trajectory.avsc").read_text()), named_schemas={})


def decode(schema: Any, value: bytes | None, headers: Iterable[tuple[str, bytes]]) -> dict[str, Any] | None:
    """A scored trajectory, or None for a record that is not one (wrong schema header, malformed bytes)."""
    names = {k: v for k, v in headers}
    if not value or names.get("dora.schema", TRAJECTORY.encode()) != TRAJECTORY.encode():
        return None
    buf = io.BytesIO(value)
    try:
        datum = fastavro.schemaless_reader(buf, schema, schema)
    except Exception:
        return None
    return datum if isinstance(datum, dict) and buf.tell() == len(value) else None


def by_version(rewards: Iterable[tuple[int, float]]) -> dict[int, tuple[int, float]]:
    """``(version, reward)`` pairs -> version -> (count, mean reward)."""
    sums: dict[int, tuple[int, float]] = {}
    for version, reward in rewards:
        n, total = sums.get(version, (0, 0.0))
        sums[version] = (n + 1, total + reward)
    return {v: (n, total / n) for v, (n, total) in sorted(sums.items())}


def build_app(bootstrap: str, run_id: str, schemas: Path, partitions: int, app_id: str | None = None,
              every_s: float = 10.0) -> tuple[faust.App, Any]:
    """The Faust app and its table (``trajectory_id`` -> ``[policy_version, reward]``)."""
    app = faust.App(app_id or f"dora-reward-by-version-{run_id}", broker=f"kafka://{bootstrap}", store="memory://",
                    topic_partitions=partitions, web_enabled=False, consumer_auto_offset_reset="earliest")
    schema = trajectory_schema(schemas)
    scored = app.topic(f"dora.{run_id}.rollout.scored",  # the run's own topic
                       key_type=bytes, value_type=bytes, key_serializer="raw", value_serializer="raw")
    table = app.Table("rewards", default=None, partitions=partitions)

    @app.agent(scored)
    async def aggregate(stream: Any) -> None:
        async for event in stream.events():
            t = decode(schema, event.value, event.headers.items() if hasattr(event.headers, "items")
                       else event.headers or [])
            if t is None or t["run_id"] != run_id or t["reward"] is None:
                continue
            if table.get(t["trajectory_id"]) is None:  # the first scored copy wins
                table[t["trajectory_id"]] = [int(t["policy_version"]), float(t["reward"])]

    @app.timer(interval=every_s)
    async def report() -> None:
        for version, (n, mean) in by_version((v, r) for v, r in table.values()).items():
            print(f"v{version} n={n} mean_reward={mean:.4f}", flush=True)

    return app, table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bootstrap-servers", required=True)
    parser.add_argument("--run-id", required=True)
    parser.add_argument("--schemas", type=Path, default=Path(__file__).resolve().parents[1] / "schemas")
    parser.add_argument("--partitions", type=int, default=4, help="partitions of dora.rollout.scored")
    parser.add_argument("--every", type=float, default=10.0)
    args, faust_argv = parser.parse_known_args(argv)
    app, _ = build_app(args.bootstrap_servers, args.run_id, args.schemas, args.partitions, every_s=args.every)
    sys.argv = [sys.argv[0], *faust_argv]
    app.main()


if __name__ == "__main__":
    main()
