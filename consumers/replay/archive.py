"""``dora-rl replay archive``: a finished run kept past retention, as Parquet files under a directory.

Layout of ``DIR``:

- ``records/<topic>.parquet``: the run's records of each topic *as the log holds them* — columns
  ``partition``, ``offset``, ``timestamp_ms``, ``key``, ``value`` (the Avro bytes the role wrote),
  ``headers`` (schema name and fingerprint) and ``version`` (from the key) — in log order, with the
  record's current ``.avsc`` in the file metadata (``dora.avsc``), so the values decode with fastavro
  alone; ``dora.runs`` holds the run's own records;
- ``checkpoints/``: a copy of the trainer's replay checkpoints of the run (``retrain`` needs them);
- ``manifest.json``: run id, when, and per topic the record count.

Invariants: the archive holds exactly the records a :class:`~.source.KafkaSource` of the run yields
(raw bytes: a verb reading the archive decodes what it would have decoded from the topics, so its
result is the same, exactness of ``retrain`` included), and only the run's (records of other runs
sharing the topics are left out). It is written into a temporary directory renamed into place: an
archive exists whole or not at all. Archiving reads every topic through the source, so a run whose
records retention already deleted is refused with that reason (:class:`~.source.RetentionDeleted`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from dora_rl.infra.kafka import topics
from dora_rl.schemas.codec import SCHEMA_DIR, SCHEMA_FILES, DecodeError
from dora_rl.schemas.records import RECORDS, RunInfo

from .source import RawRecord, RecordSource, by_version

FORMAT = 1
RAW = pa.schema([
    pa.field("partition", pa.int32(), nullable=False, metadata={"doc": "Partition of the record."}),
    pa.field("offset", pa.int64(), nullable=False, metadata={"doc": "Offset of the record in its partition."}),
    pa.field("timestamp_ms", pa.int64(), nullable=False, metadata={"doc": "The record's Kafka timestamp."}),
    pa.field("key", pa.binary(), metadata={"doc": "Record key bytes (infra/kafka/keys.py)."}),
    pa.field("value", pa.binary(), metadata={"doc": "Schemaless Avro body of the record, as written."}),
    pa.field("headers", pa.list_(pa.struct([("key", pa.string()), ("value", pa.binary())])),
             metadata={"doc": "Kafka headers: dora.schema and dora.schema.fp (docs/decisions/0003)."}),
    pa.field("version", pa.int64(), metadata={"doc": "Version in the key (null: none)."}),
])
#: Topics archived by default: every topic of facts (``delete`` cleanup) and the run's record; the other
#: compacted topic holds the roles' restart snapshots, which no replay needs.
DEFAULT_TOPICS = (*(s.name for s in topics.catalogue() if s.cleanup == "delete"), topics.RUNS)


@dataclass(frozen=True)
class ArchiveResult:
    """What an archive holds."""

    path: Path
    run_id: str
    records: dict[str, int]
    checkpoints: int


def _belongs(raw: RawRecord, run_id: str) -> bool:
    """Whether ``raw`` is a record of ``run_id``. An undecodable one is kept when it lies in the run's range of its
    topic (it is part of what the run read), but not on ``dora.runs``, which is read whole: there it is no run's."""
    cls = RECORDS[topics.spec(raw.topic).schema]
    try:
        record = cls.decode(raw.value, list(raw.headers))
    except DecodeError:
        return raw.topic != topics.RUNS
    return getattr(record, "run_id", run_id) == run_id


def write_table(path: Path, topic: str, records: Sequence[RawRecord]) -> None:
    """One topic's raw records to ``path`` (see the module docstring)."""
    schema_name = topics.spec(topic).schema
    avsc = (SCHEMA_DIR / SCHEMA_FILES[schema_name]).read_text()
    table = pa.Table.from_pylist([
        {"partition": r.partition, "offset": r.offset, "timestamp_ms": r.timestamp_ms, "key": r.key,
         "value": r.value, "headers": [{"key": k, "value": v} for k, v in r.headers], "version": r.version}
        for r in records], schema=RAW.with_metadata({"dora.topic": topic, "dora.schema": schema_name,
                                                     "dora.avsc": avsc}))
    pq.write_table(table, path)


def archive(source: RecordSource, out: Path, names: Sequence[str] = DEFAULT_TOPICS,
            allow_running: bool = False) -> ArchiveResult:
    """Write the archive of the source's run to ``out`` (which must not exist)."""
    info = source.run_info()
    if info.state == "STARTED" and not allow_running:
        raise RuntimeError(f"run {info.run_id} is still STARTED: archive a finished run (or pass --allow-running)")
    if out.exists():
        raise FileExistsError(f"{out} exists: an archive is written once, into a new directory")
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    (tmp / "records").mkdir(parents=True)
    counts: dict[str, int] = {}
    try:
        for topic in names:
            records = [r for r in source.raw(topic) if _belongs(r, info.run_id)]
            write_table(tmp / "records" / f"{topic}.parquet", topic, records)
            counts[topic] = len(records)
        ckpts = source.checkpoints_dir()
        copied = 0
        if ckpts.is_dir():
            shutil.copytree(ckpts, tmp / "checkpoints", ignore=shutil.ignore_patterns(".tmp-*"))
            copied = sum(1 for _ in (tmp / "checkpoints").iterdir())
        manifest = {"format": FORMAT, "run_id": info.run_id, "state": info.state,
                    "archived_ms": int(time.time() * 1000), "source": source.where, "records": counts,
                    "checkpoints": copied}
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ArchiveResult(out, info.run_id, counts, copied)


class ArchiveSource:
    """A run read back from its archive (a :class:`~.source.RecordSource`)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        manifest = self.path / "manifest.json"
        if not manifest.is_file():
            raise FileNotFoundError(f"{self.path} is not a run archive (no manifest.json)")
        self.manifest = json.loads(manifest.read_text())
        if self.manifest.get("format") != FORMAT:
            raise ValueError(f"{self.path}: archive format {self.manifest.get('format')!r}, this tool reads {FORMAT}")
        self._info = self._read_info()

    @property
    def where(self) -> str:
        return f"archive {self.path}"

    def _read_info(self) -> RunInfo:
        info: RunInfo | None = None
        for raw in self.raw(topics.RUNS):
            try:
                rec = RunInfo.decode(raw.value, list(raw.headers))
            except DecodeError:  # archives written before undecodable run records were left out
                continue
            if info is not None and not rec.start_offsets:  # later records keep the STARTED one's offsets
                rec = rec.replace(start_offsets=info.start_offsets)
            info = rec
        if info is None:
            raise ValueError(f"{self.path}: the archive holds no record of its run on {topics.RUNS}")
        return info

    def run_info(self) -> RunInfo:
        return self._info

    def raw(self, topic: str, version: int | None = None) -> Iterator[RawRecord]:
        path = self.path / "records" / f"{topic}.parquet"
        if not path.is_file():
            raise FileNotFoundError(f"{self.where} has no records of {topic} (archived: "
                                    f"{sorted(self.manifest.get('records', {}))})")
        table = pq.read_table(path)
        records = (RawRecord(topic, int(r["partition"]), int(r["offset"]), r["key"], r["value"],
                             tuple((h["key"], h["value"]) for h in r["headers"] or ()), int(r["timestamp_ms"]))
                   for r in table.to_pylist())
        return by_version(records, version)

    def checkpoints_dir(self) -> Path:
        return self.path / "checkpoints"
