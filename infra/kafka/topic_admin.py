"""Creating and deleting the catalogue's topics on a cluster (:mod:`dora_rl.infra.kafka.topics` declares them).

Creation is idempotent (an existing topic is left as it is, and a partition count below the catalogue's is
reported, never silently accepted). Replication factor is ``min(3, brokers)`` and ``min.insync.replicas`` is
``min(2, rf)``, so the same catalogue runs on one broker and on a 3-node cluster. A run's topics
(``dora.<run_id>.*``, decision 0063) are made with the run and deleted only on request, once it is over.
"""

from __future__ import annotations

import dataclasses
import time

from confluent_kafka.admin import AdminClient, NewPartitions, NewTopic

from dora_rl.infra.kafka import topics


def ensure_topics(admin: AdminClient, num_partitions: int = 4, timeout: float = 30.0,
                  instances: int = topics.MAX_INSTANCES, run_id: str | None = None) -> dict[str, str]:
    """Create every missing topic of :data:`topics.GLOBAL_TOPICS` and, with ``run_id``, of that run
    (:func:`topics.in_run`); returns ``{topic: 'created' | 'exists' | 'grown'}``.

    The request topic (partition = instance index) is grown to ``instances`` partitions when it has
    fewer: no key maps to its partitions, so adding some moves nothing. Raises RuntimeError if another
    topic exists with fewer partitions than the catalogue needs (growing a key-partitioned topic would
    move keys), or if creation fails for another reason than 'already exists'.
    """
    metadata = admin.list_topics(timeout=timeout)
    brokers = max(1, len(metadata.brokers))
    rf = min(3, brokers)
    result: dict[str, str] = {}
    to_create: list[NewTopic] = []
    for entry in topics.catalogue(num_partitions, instances):
        if entry.name not in topics.GLOBAL_TOPICS and run_id is None:
            continue
        s = dataclasses.replace(entry, name=topics.in_run(run_id or "", entry.name))
        existing = metadata.topics.get(s.name)
        if existing is not None and existing.error is None:
            have = len(existing.partitions)
            if have < s.partitions and s.partitioning == "instance":
                for fut in admin.create_partitions([NewPartitions(s.name, s.partitions)],
                                                   request_timeout=timeout).values():
                    fut.result(timeout=timeout)
                wait_for_leaders(admin, [s.name], timeout)
                result[s.name] = "grown"
                continue
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


def run_topic_names(run_id: str) -> list[str]:
    """Every topic of run ``run_id`` (the catalogue's, but the shared ones)."""
    return [topics.in_run(run_id, s.name) for s in topics.catalogue() if s.name not in topics.GLOBAL_TOPICS]


def delete_run_topics(admin: AdminClient, run_id: str, timeout: float = 30.0) -> list[str]:
    """Delete the topics of run ``run_id`` that exist (its records with them); returns their names. The caller
    checks that the run is over: a role still running would fail on its next read or write."""
    existing = set(admin.list_topics(timeout=timeout).topics)
    doomed = [name for name in run_topic_names(run_id) if name in existing]
    for name, fut in (admin.delete_topics(doomed, operation_timeout=timeout) if doomed else {}).items():
        try:
            fut.result(timeout=timeout)
        except Exception as exc:  # KafkaException wraps the broker error
            if "UNKNOWN_TOPIC_OR_PART" not in str(exc):
                raise RuntimeError(f"deleting topic {name} failed: {exc}") from exc
    return doomed
