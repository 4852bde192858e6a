"""``--index auto``: a rollout instance started on any host claims its index from the log.

The rule is :mod:`dora_rl.core.instance_ids` (first record of an index in ``dora.instances`` owns it);
this module is the thin Kafka side: read the run's instance records, write a claim, read back.
Written: one ``InstanceStatus`` claim (state ``STARTING``, ``incarnation`` = the instance's name) per
try. Read: ``dora.instances`` from the run's start offsets (the topic has one partition: one order).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
from collections.abc import Iterator, Mapping

from dora_rl.core.instance_ids import first_free, owned_by, owners
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.io import RecordProducer, now_ms, read_all
from dora_rl.infra.kafka.keys import make_key
from dora_rl.infra.kafka.runs import topic_start
from dora_rl.schemas.codec import DecodeError
from dora_rl.schemas.records import InstanceStatus

log = logging.getLogger(__name__)


def default_name() -> str:
    """A name no other process has: ``<hostname>-<pid>-<random>`` (a new index on every start)."""
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}"


def _records(bootstrap: str, run_id: str, start: Mapping[int, int]) -> Iterator[tuple[int, str]]:
    for msg in read_all(bootstrap, topics.in_run(run_id, topics.INSTANCES), start, idle_s=0.5):
        try:
            st = InstanceStatus.decode(msg.value(), msg.headers())
        except DecodeError:  # a malformed record is the orchestrator's to dead-letter; it owns nothing
            continue
        if st.run_id == run_id:
            yield int(st.instance_index), st.incarnation


def claim_index(bootstrap: str, run_id: str, max_instances: int, start_offsets: Mapping[tuple[str, int], int],
                name: str, capacity: int = 0, max_tries: int = 64) -> int:
    """The index ``name`` owns in run ``run_id``: the one it owned before, else a newly claimed one."""
    start = topic_start(start_offsets, topics.in_run(run_id, topics.INSTANCES))
    producer = RecordProducer(bootstrap, f"claim-{name}")
    try:
        for _ in range(max_tries):
            owner_of = owners(_records(bootstrap, run_id, start))
            mine = owned_by(owner_of, name)
            if mine is not None:
                log.info("instance %s owns index %d", name, mine)
                return mine
            index = first_free(owner_of, max_instances)
            claim = InstanceStatus(run_id=run_id, instance_id=f"rollout-{index}", instance_index=index,
                                   loaded_version=-1, state="STARTING", in_flight=0, capacity=capacity,
                                   ts_ms=now_ms(), incarnation=name)
            producer.send(topics.in_run(run_id, topics.INSTANCES), claim, make_key(0, f"rollout-{index}"))
            producer.flush()  # acknowledged: the next read reaches it
            log.info("instance %s claimed index %d; reading back who owns it", name, index)
        raise RuntimeError(f"instance {name}: no index claimed after {max_tries} tries (racing claimants?)")
    finally:
        producer.flush()


__all__ = ["claim_index", "default_name"]
