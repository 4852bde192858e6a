"""The dataset producer: writes a run's prompts to ``dora.prompts``.

Writes ``dora.prompts`` (key ``v-/<group_id>``, partition from the group id); read by the
orchestrator. Prompt ``i`` of a run has ``prompt_id = group_id = "<run_id>/p<i>"``; the stream is
deterministic in ``(task, seed)``, so a replayed or resumed run sees the same prompts.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import numpy as np

from dora_rl.infra import topics
from dora_rl.infra.kafka_io import RecordProducer, now_ms
from dora_rl.infra.keys import make_key, partition_for
from dora_rl.schemas.records import Prompt


def generate_prompts(run_id: str, task_name: str, count: int, seed: int, tokenizer: object) -> Iterator[Prompt]:
    """``count`` prompts of ``task_name``, deterministic in ``seed``."""
    from dora_rl.core.tasks import get_task
    from dora_rl.modeling import encode_prompt

    task = get_task(task_name)
    rng = random.Random(seed)
    for i in range(count):
        sample = task.sample(rng)
        gid = f"{run_id}/p{i}"
        ids = encode_prompt(tokenizer, sample.prompt)  # type: ignore[arg-type]
        yield Prompt(run_id=run_id, prompt_id=gid, group_id=gid, task=task_name, prompt_text=sample.prompt,
                     prompt_ids=np.asarray(ids, dtype=np.int32), reference=sample.reference, created_ms=now_ms())


def produce_prompts(bootstrap: str, run_id: str, task_name: str, count: int, seed: int, tokenizer: object,
                    num_partitions: int) -> int:
    """Write the prompts; returns how many were written (all flushed)."""
    producer = RecordProducer(bootstrap, f"dataset-{run_id}")
    n = 0
    for prompt in generate_prompts(run_id, task_name, count, seed, tokenizer):
        producer.send(topics.PROMPTS, prompt, make_key(None, prompt.group_id),
                      partition=partition_for(prompt.group_id, num_partitions))
        n += 1
    producer.flush()
    return n
