"""Runs: ids, start offsets and lifecycle records on ``dora.runs``.

A run id is ``<UTC yyyymmdd-hhmmss>-<4 hex>``, so ids sort by start time. When a run starts, the
end offset of every partition of every data topic is recorded in its :class:`RunInfo`; all of the
run's records lie at or after those offsets, which is where its consumers, the audit and replay
begin reading.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterable, Mapping

from confluent_kafka import Consumer, Message, TopicPartition
from confluent_kafka.admin import AdminClient

from dora_rl.config import DoraConfig
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.io import RecordProducer, metadata, now_ms, read_all, reader_config, watermarks
from dora_rl.infra.kafka.security import client_config, security_errors_fatal
from dora_rl.infra.kafka.signing import signature_problem, signed
from dora_rl.infra.kafka.topic_admin import ensure_topics
from dora_rl.schemas.codec import DecodeError
from dora_rl.schemas.records import RunInfo, TopicOffset


def new_run_id() -> str:
    """A fresh, time-sortable run id."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(2)


def end_offsets(bootstrap: str, run_id: str, timeout: float = 15.0) -> list[TopicOffset]:
    """Current end (high watermark) offsets of every partition of the run's topics (``topics.in_run``)."""
    consumer = Consumer(reader_config(bootstrap, "dora-offsets"))
    try:
        md = metadata(consumer, None, timeout)
        out: list[TopicOffset] = []
        for name in [topics.in_run(run_id, s.name) for s in topics.catalogue() if s.name not in topics.GLOBAL_TOPICS]:
            if name not in md.topics:
                raise RuntimeError(f"topic {name} of run {run_id} does not exist (`dora-rl create` makes them)")
            for p in sorted(md.topics[name].partitions):
                _, high = watermarks(consumer, TopicPartition(name, p), timeout)
                out.append(TopicOffset(topic=name, partition=p, offset=high))
        return out
    finally:
        consumer.close()


class RunExists(ValueError):
    """A run id given for a new run is recorded already (a run is never overwritten: resume it instead)."""


def start_run(bootstrap: str, config: DoraConfig, run_id: str | None = None, token: str = "") -> RunInfo:
    """Create the run's topics (``dora.<run_id>.*``, decision 0063) and record the run (state STARTED) with
    their start offsets, signed with the run's ``token``; returns it. A given ``run_id`` that is recorded
    already raises :class:`RunExists` (its config and start offsets would be replaced)."""
    if run_id is not None and run_id in list_runs(bootstrap):
        raise RunExists(f"run {run_id!r} exists on this cluster: choose another id, or continue it with "
                        f"`dora-rl resume {run_id}`")
    run_id = topics.check_run_id(run_id or new_run_id())
    ensure_topics(AdminClient(client_config(bootstrap)), config.num_partitions,
                         instances=config.instance_limit, run_id=run_id)
    info = RunInfo(run_id=run_id, state="STARTED", mode=config.mode,
                   config_json=config.to_json(), created_ms=now_ms(),
                   start_offsets=tuple(end_offsets(bootstrap, run_id)))
    return publish(bootstrap, info, token)


def publish(bootstrap: str, info: RunInfo, token: str = "") -> RunInfo:
    """Write a run record (compacted by run id), signed with the run's ``token`` (decision 0060); returns it."""
    info = signed(info.replace(signature=None), token)
    producer = RecordProducer(bootstrap, "dora-runs")
    producer.send(topics.RUNS, info, f"run/{info.run_id}")
    producer.flush()
    return info


def finish_run(bootstrap: str, info: RunInfo, summary_json: str, failed: bool = False, token: str = "") -> RunInfo:
    """Record the end of a run with its summary (signed with the run's ``token``)."""
    return publish(bootstrap, info.replace(state="FAILED" if failed else "FINISHED", summary_json=summary_json), token)


def list_runs(bootstrap: str, token: str = "") -> dict[str, RunInfo]:
    """Latest record of every run, by run id (sorted by id, i.e. by start time). Given a run's ``token``, only
    records signed with it count, so only that run is listed, from its genuine records (decision 0060)."""
    runs: dict[str, RunInfo] = {}
    for msg in read_all(bootstrap, topics.RUNS):
        try:
            info = RunInfo.decode(msg.value(), msg.headers())
        except DecodeError:
            continue
        if signature_problem(info, token, "run record") is not None:
            continue
        prev = runs.get(info.run_id)
        # the STARTED record carries the offsets; later records keep them
        if prev is not None and not info.start_offsets:
            info = info.replace(start_offsets=prev.start_offsets)
        runs[info.run_id] = info
    return dict(sorted(runs.items()))


def get_run(bootstrap: str, run_id: str | None = None, token: str = "") -> RunInfo:
    """The run ``run_id``, or the most recent run when None; LookupError if there is none. Given the run's
    ``token``: its latest record signed with it (a record anyone else wrote is passed by)."""
    runs = list_runs(bootstrap, token)
    if not runs:
        raise LookupError("no runs recorded on this cluster (topic dora.runs is empty)" if not token else
                          "no run record signed with this run's token on dora.runs")
    if run_id is None:
        return runs[sorted(runs)[-1]]
    if run_id not in runs:
        raise LookupError(f"run {run_id!r} not found; known runs: {sorted(runs)[-10:]}")
    return runs[run_id]


def offsets_map(info: RunInfo) -> dict[tuple[str, int], int]:
    """``{(topic, partition): offset}`` of a run's start."""
    return {(o.topic, o.partition): o.offset for o in info.start_offsets}


def topic_start(start: Mapping[tuple[str, int], int], topic: str) -> dict[int, int]:
    """``{partition: offset}`` of one topic, picked from a run's start (:func:`offsets_map`'s shape)."""
    return {p: o for (t, p), o in start.items() if t == topic}


def read_run(bootstrap: str, info: RunInfo, topic: str) -> Iterable[Message]:
    """Every committed record of catalogue topic ``topic`` of run ``info`` (its own topic, ``topics.in_run``),
    from the run's start to the current end."""
    name = topics.in_run(info.run_id, topic)
    return read_all(bootstrap, name, topic_start(offsets_map(info), name))


class RetentionGap(RuntimeError):
    """A run cannot be resumed: retention deleted records its roles still need."""


def retention_gaps(bootstrap: str, info: RunInfo, timeout: float = 15.0) -> list[str]:
    """Where retention deleted records that run ``info``'s roles would read on a resume.

    For every partition of every topic a role reads, a role resumes from its group's committed offset,
    or from the run's start offset where none of the run's groups (``dora.<run_id>.*``) committed one;
    a gap is such an offset below the partition's first retained offset (its low watermark), so
    records the run never processed are gone (a consumer would otherwise skip them silently).
    """
    from confluent_kafka import ConsumerGroupTopicPartitions
    from confluent_kafka.admin import AdminClient

    admin = AdminClient(client_config(bootstrap))
    prefix = f"dora.{info.run_id}."
    with security_errors_fatal("listing consumer groups"):
        listed = admin.list_consumer_groups(request_timeout=timeout).result()
    committed: dict[tuple[str, int], int] = {}
    for g in (g.group_id for g in listed.valid if g.group_id.startswith(prefix)):
        res = admin.list_consumer_group_offsets([ConsumerGroupTopicPartitions(g)], request_timeout=timeout)
        with security_errors_fatal(f"offsets of group {g}"):
            committed_tps = res[g].result().topic_partitions or []
        for tp in committed_tps:
            if tp.offset >= 0:
                key = (tp.topic, tp.partition)
                committed[key] = min(committed.get(key, tp.offset), tp.offset)
    start = offsets_map(info)
    read_by_roles = {topics.in_run(info.run_id, s.name) for s in topics.catalogue()
                     if set(s.readers) & set(topics.ROLE_NAMES)}
    consumer = Consumer(reader_config(bootstrap, "dora-offsets"))
    gaps: list[str] = []
    try:
        for (topic, partition), begin in sorted(start.items()):
            if topic not in read_by_roles:
                continue
            need = committed.get((topic, partition), begin)
            low, _ = watermarks(consumer, TopicPartition(topic, partition), timeout)
            if need < low:
                gaps.append(f"{topic}[{partition}]: the run needs records from offset {need}, but retention "
                            f"deleted everything below {low}")
    finally:
        consumer.close()
    return gaps
