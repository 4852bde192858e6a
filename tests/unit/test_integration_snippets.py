"""The Python snippets of ``docs/integration.md`` run, and agree with the product: the partition of a group,
the run's start positions, and the built-in tasks' rewards."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

from dora_rl.core.tasks import get_task
from dora_rl.infra.kafka.keys import partition_for

DOC = (Path(__file__).resolve().parents[2] / "docs" / "integration.md").read_text()


def _snippets() -> dict[str, Any]:
    section = DOC[DOC.index("## Snippets"):DOC.index("## Worked example 1")]
    blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 3, "docs/integration.md's snippets changed: update this test"
    scope: dict[str, Any] = {}
    for block in blocks:
        exec(compile(block, "docs/integration.md", "exec"), scope)  # the doc's own code
    return scope


def test_the_documented_partition_is_the_products() -> None:
    doc = _snippets()["partition_for"]
    rng = random.Random(0)
    for _ in range(2000):
        group = f"run-{rng.randrange(10**6)}/p{rng.randrange(10**5)}" + "é" * rng.randrange(3)
        n = rng.randrange(1, 64)
        assert doc(group, n) == partition_for(group, n), group


def test_the_documented_start_positions_pick_the_topics_offsets() -> None:
    info = {"start_offsets": [{"topic": "dora.rollout.trajectories", "partition": 1, "offset": 40},
                              {"topic": "dora.prompts", "partition": 0, "offset": 7},
                              {"topic": "dora.rollout.trajectories", "partition": 0, "offset": 12}]}
    tps = _snippets()["start_positions"](info, "dora.rollout.trajectories")
    assert sorted((tp.partition, tp.offset) for tp in tps) == [(0, 12), (1, 40)]


def test_the_documented_rewards_are_the_tasks() -> None:
    scope, rng = _snippets(), random.Random(1)
    for name in ("reverse", "chainsum"):
        task, doc = get_task(name), scope[f"{name}_reward"]
        for _ in range(300):
            sample = task.sample(rng)
            answer = list(sample.reference)
            for _ in range(rng.randrange(4)):  # some exact, some damaged, some cut short
                if answer:
                    answer[rng.randrange(len(answer))] = rng.choice("0123456789abc#,")
            completion = "".join(answer[: rng.randrange(len(answer) + 1)] if rng.random() < 0.2 else answer)
            assert doc(sample.reference, completion) == task.reward(sample.reference, completion)
