"""Where a run's prompts come from: the synthetic ``task`` or a ``dataset``; training and held-out rows.

The one place that turns a :class:`~dora_rl.config.DoraConfig` into prompt rows, read by the dataset
producer (training prompts, written to ``dora.prompts``) and by the trainer (held-out prompts, for
evaluation), so both sides agree on the split without talking to each other.

Invariants:

* ``training_prompts(config, n)[i]`` is a pure function of ``(config, i)`` (a resumed or replayed
  run sees the same prompts; a longer ``n`` extends the list, never reorders it);
* with a dataset, no held-out row is ever a training row (:func:`dora_rl.core.prompt_data.split`);
  with a synthetic task, held-out prompts are drawn from another seed (``seed + EVAL_SEED_OFFSET``:
  an overlap can only be a chance duplicate of a generated problem);
* a dataset's identity (source, sha256, rows) is what :func:`dataset_identity` records on the run.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Any

from dora_rl.config import DoraConfig
from dora_rl.core.prompt_data import DataSpec, PromptRow, split, train_order
from dora_rl.prompt_files import identity, load_rows

EVAL_SEED_OFFSET = 1_000_003
"""Held-out prompts of a synthetic task come from ``random.Random(seed + EVAL_SEED_OFFSET)``."""


def data_spec(config: DoraConfig) -> DataSpec | None:
    """The dataset of ``config`` as a :class:`DataSpec`, or None for the synthetic ``task``."""
    if config.dataset is None:
        return None
    return DataSpec(source=config.dataset, prompt_field=config.prompt_field, answer_field=config.answer_field,
                    id_field=config.id_field, template=config.prompt_template, shuffle=config.shuffle,
                    seed=config.seed, heldout=config.heldout, size=config.gym_size,
                    gym_config=dict(config.gym_config))


def _synthetic(config: DoraConfig, seed: int, count: int) -> list[PromptRow]:
    from dora_rl.core.tasks import get_task

    task = get_task(config.task)
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        sample = task.sample(rng)
        rows.append(PromptRow(row_id=f"{config.task}/{seed}/{i}", prompt=sample.prompt, reference=sample.reference,
                              task=config.task))
    return rows


def training_prompts(config: DoraConfig, count: int) -> list[PromptRow]:
    """The first ``count`` training prompts of the run (epochs over the training rows of a dataset)."""
    spec = data_spec(config)
    if spec is None:
        return _synthetic(config, config.seed, count)
    train, _ = split(load_rows(spec), spec)
    return train_order(train, spec, count)


def heldout_prompts(config: DoraConfig) -> list[PromptRow]:
    """At most ``config.eval_prompts`` held-out prompts (all of the dataset's ``heldout`` rows if fewer)."""
    spec = data_spec(config)
    if spec is None:
        return _synthetic(config, config.seed + EVAL_SEED_OFFSET, config.eval_prompts)
    if spec.heldout == 0:
        raise ValueError(f"dataset {spec.source!r}: evaluation needs held-out rows (set heldout > 0)")
    _, held = split(load_rows(spec), spec)
    return held[: config.eval_prompts]


def dataset_identity(config: DoraConfig) -> dict[str, Any] | None:
    """What the run records about its data: the dataset's identity and split, or the synthetic task."""
    spec = data_spec(config)
    if spec is None:
        return {"task": config.task, "seed": config.seed}
    ident = dataclasses.asdict(identity(spec))
    return {**ident, "fields": list(ident["fields"]), "heldout": spec.heldout, "shuffle": spec.shuffle,
            "seed": spec.seed}  # JSON-shaped: the summary on dora.runs holds exactly this
