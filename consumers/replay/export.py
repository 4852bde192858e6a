"""``dora-rl replay export``: a run's records of one topic to a Parquet file, filtered, docs on the columns.

Rows: one per record, except ``dora.train.batches``, which gives one row per *trajectory* of every
batch (with the batch's ``batch_id``, ``train_step`` and ``base_version``). Columns: the record's Avro
fields (:mod:`.arrow`: the field's doc is the column's ``doc`` metadata), then ``_partition`` and
``_offset`` (where the record lies in the log). Trajectory rows also get ``train_step`` and
``staleness`` (:meth:`StalenessBound.staleness` of the step that trained the trajectory, read from the
run's batches; null for a trajectory no batch holds).

Filters (:class:`ExportFilter`, all optional, combined with *and*): ``version`` — the key's version
(``v<version:010d>/...``: the policy version of a trajectory, the train step of a batch), applied
before any value is decoded; ``group`` (``group_id``), ``finish_reason``, ``staleness`` and
``reward`` ranges (inclusive). A filter on a column the topic's rows lack is an error, never a no-op.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from dora_rl.core.staleness import StalenessBound
from dora_rl.infra.kafka import topics
from dora_rl.schemas.records import RECORDS, TrainBatch, Trajectory

from .arrow import arrow_schema, column, record_fields, row_of
from .source import RecordSource, decoded

TRAJECTORY_TOPICS = (topics.TRAJECTORIES, topics.SCORED)
WHERE = [column("_partition", pa.int32(), "Partition of the record in its topic.", nullable=False),
         column("_offset", pa.int64(), "Offset of the record in its partition.", nullable=False)]
TRAINED = [column("train_step", pa.int64(), "Train step whose batch holds this trajectory (null: none)."),
           column("staleness", pa.int64(), "base_version of that batch minus policy_version (C3; null: "
                                            "never trained).")]


@dataclass(frozen=True)
class ExportFilter:
    """Which rows to keep (see the module docstring); None: no condition."""

    version: int | None = None
    group: str | None = None
    finish_reason: str | None = None
    staleness: tuple[float, float] | None = None
    reward: tuple[float, float] | None = None

    def columns(self) -> list[str]:
        """Row columns the filter reads (the version is read from the key)."""
        wanted = {"group_id": self.group, "finish_reason": self.finish_reason, "staleness": self.staleness,
                  "reward": self.reward}
        return [name for name, cond in wanted.items() if cond is not None]

    def accepts(self, row: dict[str, Any]) -> bool:
        """Whether ``row`` passes every condition (a null value fails a range)."""
        if self.group is not None and row["group_id"] != self.group:
            return False
        if self.finish_reason is not None and row["finish_reason"] != self.finish_reason:
            return False
        for name, bounds in (("staleness", self.staleness), ("reward", self.reward)):
            if bounds is not None and (row[name] is None or not bounds[0] <= row[name] <= bounds[1]):
                return False
        return True


@dataclass(frozen=True)
class ExportResult:
    """What was written."""

    path: Path
    topic: str
    rows: int
    columns: tuple[str, ...]


def export_schema(topic: str) -> pa.Schema:
    """The Parquet schema of ``topic``'s rows."""
    if topic == topics.BATCHES:
        batch = {f.name: f for f in record_fields(TrainBatch.SCHEMA)}
        extra = [batch["batch_id"], batch["train_step"], batch["base_version"], TRAINED[1], *WHERE]
        return arrow_schema(Trajectory.SCHEMA, extra)
    extra = [*TRAINED, *WHERE] if topic in TRAJECTORY_TOPICS else WHERE
    return arrow_schema(topics.spec(topic).schema, extra)


def trained_at(source: RecordSource) -> dict[str, tuple[int, int]]:
    """Trajectory id -> (train step, base version) of the first batch that holds it."""
    out: dict[str, tuple[int, int]] = {}
    for _, batch in decoded(source, topics.BATCHES, TrainBatch):
        for t in batch.trajectories:
            out.setdefault(t.trajectory_id, (int(batch.train_step), int(batch.base_version)))
    return out


def rows(source: RecordSource, topic: str, version: int | None = None) -> Iterator[dict[str, Any]]:
    """Every row of ``topic`` (key version ``version`` only, when given), before the other filters."""
    if topic == topics.BATCHES:
        for raw, batch in decoded(source, topic, TrainBatch, version):
            for t in batch.trajectories:
                yield {**row_of(t), "batch_id": batch.batch_id, "train_step": int(batch.train_step),
                       "base_version": int(batch.base_version),
                       "staleness": StalenessBound.staleness(batch.base_version, t.policy_version),
                       "_partition": raw.partition, "_offset": raw.offset}
        return
    trained = trained_at(source) if topic in TRAJECTORY_TOPICS else {}
    for raw, record in decoded(source, topic, RECORDS[topics.spec(topic).schema], version):
        row = {**row_of(record), "_partition": raw.partition, "_offset": raw.offset}
        if topic in TRAJECTORY_TOPICS:
            step, base = trained.get(row["trajectory_id"], (None, None))
            row["train_step"] = step
            row["staleness"] = None if base is None else StalenessBound.staleness(base, row["policy_version"])
        yield row


def export(source: RecordSource, topic: str, path: Path, where: ExportFilter = ExportFilter()) -> ExportResult:
    """Write the run's rows of ``topic`` that pass ``where`` to the Parquet file ``path``."""
    schema = export_schema(topic)
    missing = [c for c in where.columns() if c not in schema.names]
    if missing:
        raise ValueError(f"cannot filter {topic} by {missing}: its rows have no such column")
    kept = [r for r in rows(source, topic, where.version) if where.accepts(r)]
    meta = {**(schema.metadata or {}), b"dora.run_id": source.run_info().run_id.encode(),
            b"dora.topic": topic.encode(), b"dora.filter": repr(where).encode()}
    table = pa.Table.from_pylist(kept, schema=schema.with_metadata(meta))
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return ExportResult(path, topic, table.num_rows, tuple(schema.names))
