"""The dataset producer: writes a run's prompts to ``dora.prompts``.

Writes ``dora.prompts`` (key ``v-/<group_id>``, one partition: the orchestrator dispatches in dataset order);
read by the orchestrator. Prompt ``i`` of a run has ``prompt_id = group_id = "<run_id>/p<i>"`` and is the
``i``-th of :func:`dora_rl.prompt_source.training_prompts` (the synthetic task or the dataset's training
rows): deterministic in the config, so a replayed or resumed run sees the same prompts.

Idempotent: the prompts written by one process commit in one Kafka transaction
(``transactional.id = dora.<run>.dataset``, so a restarted producer fences its predecessor), hence the
committed prompts of a run are always a prefix ``p0 .. p<k-1>``; a restarted (or resumed, with more
steps) producer counts that prefix and writes only ``p<k> ..``. No prompt id is ever written twice.
A prompt over the topic's record limit is refused to ``dora.dlq`` (``oversize``) in the same
transaction and its index left out.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from dora_rl.config import DoraConfig
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.io import RecordProducer, RecordTooLarge, now_ms, read_all
from dora_rl.infra.kafka.keys import make_key
from dora_rl.infra.kafka.signing import signed
from dora_rl.schemas.codec import DecodeError
from dora_rl.schemas.records import DeadLetter, Prompt


def generate_prompts(run_id: str, config: DoraConfig, count: int,
                     encode: Callable[[str], list[int]]) -> Iterator[Prompt]:
    """The run's first ``count`` training prompts (:func:`dora_rl.prompt_source.training_prompts`:
    deterministic in the config), tokenized by ``encode`` (the policy's rule,
    :func:`dora_rl.policy_source.prompt_encoder`: its chat template if any)."""
    from dora_rl.prompt_source import training_prompts

    for i, row in enumerate(training_prompts(config, count)):
        gid = f"{run_id}/p{i}"
        ids = encode(row.prompt)
        yield Prompt(run_id=run_id, prompt_id=gid, group_id=gid, task=row.task, prompt_text=row.prompt,
                     prompt_ids=np.asarray(ids, dtype=np.int32), reference=row.reference, created_ms=now_ms())


def prompts_written(bootstrap: str, run_id: str, start: dict[int, int]) -> int:
    """How many prompts of ``run_id`` are committed (their ids are the prefix ``p0 .. p<k-1>``)."""
    k = 0
    for msg in read_all(bootstrap, topics.in_run(run_id, topics.PROMPTS), start):
        try:
            prompt = Prompt.decode(msg.value(), msg.headers())
        except DecodeError:
            continue
        if prompt.run_id == run_id:
            k = max(k, int(prompt.prompt_id.rsplit("/p", 1)[1]) + 1)
    return k


def produce_prompts(bootstrap: str, run_id: str, config: DoraConfig, count: int, encode: Callable[[str], list[int]],
                    start: dict[int, int] | None = None, token: str = "") -> int:
    """Write the prompts not written yet, in one transaction; returns how many were written (an oversize
    prompt's refusal signed with the run's ``token``, so the audit counts its group refused)."""
    producer = RecordProducer(bootstrap, f"dataset-{run_id}", **{"transactional.id": f"dora.{run_id}.dataset"})
    producer.init_transactions(60)
    have = prompts_written(bootstrap, run_id, start or {})
    if have >= count:
        return 0
    producer.raw.begin_transaction()
    n = 0
    for i, prompt in enumerate(generate_prompts(run_id, config, count, encode)):
        if i < have:
            continue  # written by a predecessor
        try:
            producer.send(topics.in_run(run_id, topics.PROMPTS), prompt, make_key(None, prompt.group_id),
                          partition=0)  # dataset order
        except RecordTooLarge as exc:  # refused with the reason, in the same transaction; never dispatched
            letter = signed(DeadLetter(component="dataset", reason=f"oversize prompt: {exc}", error_type="oversize",
                                source_topic=topics.PROMPTS, source_partition=0, source_offset=-1, ts_ms=now_ms(),
                                run_id=run_id, key=make_key(None, prompt.group_id).encode(),
                                group_id=prompt.group_id), token)
            producer.send(topics.in_run(run_id, topics.DLQ), letter, make_key(None, prompt.group_id))
            continue
        n += 1
    producer.raw.commit_transaction(120)
    return n
