"""The topic catalogue (DESIGN.md §3) and its idempotent creation.

Each topic has an explicit partition count, retention and message-size limit; creation is
idempotent (an existing topic is left as it is, and a partition count below the catalogue's is
reported, never silently accepted). Replication factor is ``min(3, brokers)`` and
``min.insync.replicas`` is ``min(2, rf)``, so the same catalogue runs on one broker and on a
3-node cluster.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from confluent_kafka.admin import AdminClient, NewTopic

DAY_MS = 24 * 3600 * 1000
MAX_INSTANCES = 16


@dataclass(frozen=True)
class TopicSpec:
    """One topic: name, partitions, record schema and configs."""

    name: str
    partitions: int
    schema: str
    doc: str
    configs: dict[str, str] = field(default_factory=dict)


PROMPTS = "dora.prompts"
REQUESTS = "dora.rollout.requests"
TOKENS = "dora.rollout.tokens"
TRAJECTORIES = "dora.rollout.trajectories"
SCORED = "dora.rollout.scored"
INSTANCES = "dora.instances"
VERSIONS = "dora.policy.versions"
BATCHES = "dora.train.batches"
DLQ = "dora.dlq"
METRICS = "dora.metrics"
RUNS = "dora.runs"
SCHEDULE = "dora.schedule"

BATCH_MAX_BYTES = 64 * 1024 * 1024


def catalogue(num_partitions: int = 4) -> tuple[TopicSpec, ...]:
    """Every topic of the system. ``num_partitions`` spreads the data topics (by group id)."""
    week = str(7 * DAY_MS)
    return (
        TopicSpec(PROMPTS, num_partitions, "dora.v1.Prompt", "dataset prompts, before dispatch",
                  {"retention.ms": week}),
        TopicSpec(REQUESTS, MAX_INSTANCES, "dora.v1.RolloutRequest",
                  "version-tagged requests; partition = instance index", {"retention.ms": week}),
        TopicSpec(TOKENS, num_partitions, "dora.v1.TokenChunk", "streamed token chunks",
                  {"retention.ms": str(DAY_MS)}),
        TopicSpec(TRAJECTORIES, num_partitions, "dora.v1.Trajectory", "completed trajectories",
                  {"retention.ms": week, "max.message.bytes": str(8 * 1024 * 1024)}),
        TopicSpec(SCORED, num_partitions, "dora.v1.Trajectory", "trajectories with rewards",
                  {"retention.ms": week, "max.message.bytes": str(8 * 1024 * 1024)}),
        TopicSpec(INSTANCES, 1, "dora.v1.InstanceStatus", "rollout instance heartbeats",
                  {"retention.ms": str(DAY_MS)}),
        TopicSpec(VERSIONS, 1, "dora.v1.PolicyVersion", "policy version announcements (one order)",
                  {"retention.ms": week, "max.message.bytes": str(8 * 1024 * 1024)}),
        TopicSpec(BATCHES, 1, "dora.v1.TrainBatch", "training batches, trajectories inline",
                  {"retention.ms": week, "max.message.bytes": str(BATCH_MAX_BYTES)}),
        TopicSpec(DLQ, 1, "dora.v1.DeadLetter", "every refused record, with the reason",
                  {"retention.ms": str(30 * DAY_MS), "max.message.bytes": str(BATCH_MAX_BYTES)}),
        TopicSpec(METRICS, 1, "dora.v1.Metric", "numeric monitoring events", {"retention.ms": week}),
        TopicSpec(SCHEDULE, 1, "dora.v1.BatchPlan",
                  "batch plans: which trajectories form each batch (orchestrator -> assembler)",
                  {"retention.ms": week}),
        TopicSpec(RUNS, 1, "dora.v1.RunInfo", "run lifecycle (compacted by run)",
                  {"cleanup.policy": "compact", "max.message.bytes": str(8 * 1024 * 1024)}),
    )


def spec(name: str, num_partitions: int = 4) -> TopicSpec:
    """The catalogue entry of topic ``name``."""
    for s in catalogue(num_partitions):
        if s.name == name:
            return s
    raise KeyError(f"unknown topic {name!r}")


def ensure_topics(admin: AdminClient, num_partitions: int = 4, timeout: float = 30.0) -> dict[str, str]:
    """Create every missing topic; returns ``{topic: 'created' | 'exists'}``.

    Raises RuntimeError if a topic exists with fewer partitions than the catalogue needs, or if
    creation fails for another reason than 'already exists'.
    """
    metadata = admin.list_topics(timeout=timeout)
    brokers = max(1, len(metadata.brokers))
    rf = min(3, brokers)
    result: dict[str, str] = {}
    to_create: list[NewTopic] = []
    for s in catalogue(num_partitions):
        existing = metadata.topics.get(s.name)
        if existing is not None and existing.error is None:
            have = len(existing.partitions)
            if have < s.partitions:
                raise RuntimeError(f"topic {s.name} has {have} partitions, the catalogue needs {s.partitions}")
            result[s.name] = "exists"
            continue
        configs = dict(s.configs)
        configs.setdefault("min.insync.replicas", str(min(2, rf)))
        to_create.append(NewTopic(s.name, num_partitions=s.partitions, replication_factor=rf, config=configs))
    if to_create:
        futures = admin.create_topics(to_create, request_timeout=timeout)
        for name, fut in futures.items():
            try:
                fut.result(timeout=timeout)
                result[name] = "created"
            except Exception as exc:  # KafkaException wraps the broker error
                if "TOPIC_ALREADY_EXISTS" in str(exc):
                    result[name] = "exists"
                else:
                    raise RuntimeError(f"creating topic {name} failed: {exc}") from exc
        wait_for_leaders(admin, [t.topic for t in to_create], timeout)
    return result


def wait_for_leaders(admin: AdminClient, names: list[str], timeout: float = 30.0) -> None:
    """Block until every partition of ``names`` has a leader (new topics take a moment)."""
    deadline = time.monotonic() + timeout
    while True:
        md = admin.list_topics(timeout=timeout)
        missing = [
            f"{n}[{p}]"
            for n in names
            for p, pm in (md.topics[n].partitions.items() if n in md.topics else [(-1, None)])
            if pm is None or pm.leader < 0
        ]
        if not missing:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"no leader after {timeout}s for {missing[:5]}")
        time.sleep(0.2)
