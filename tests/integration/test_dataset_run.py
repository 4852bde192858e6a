"""A run on a dataset instead of a synthetic task, end to end through the real broker: prompts from a
JSONL file (training rows only), scored by a named verifier, the held-out pass@1 measured during the run,
and what a user reads afterwards (the summary's evaluations and data identity, TensorBoard event files).
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import pytest

from dora_rl.config import DoraConfig
from dora_rl.infra.kafka import topics
from dora_rl.prompt_source import heldout_prompts, training_prompts
from dora_rl.schemas.records import Prompt

pytestmark = pytest.mark.broker


def _dataset(path: Path) -> Path:
    rng = random.Random(1)
    with path.open("w") as f:
        for i in range(48):
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            f.write(json.dumps({"id": f"r{i}", "question": f"{a}+{b}=", "answer": str(a + b)}) + "\n")
    return path


def test_run_on_a_jsonl_dataset_with_evaluation(bootstrap: str, dora_home: Path, tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dora_rl.infra.kafka.runs import get_run, read_run
    from dora_rl.launcher import run

    data = _dataset(tmp_path / "arith.jsonl")
    config = DoraConfig.from_dict(dict(
        mode="dora", max_staleness=1, steps=2, train_batch_size=16, rollout_batch_size=16, group_size=4,
        num_instances=1, instance_concurrency=16, max_new_tokens=8, sft_steps=5, engine="torch",
        weight_transport="tcp", seed=4, dataset=str(data), prompt_field="question", id_field="id",
        reward_fn="exact", heldout=12, eval_every=2, eval_prompts=12))
    summary = run(config, bootstrap, quiet=True)
    assert summary["steps"] == 2 and summary["failed"] is None

    # the prompts on the topic are the training rows, in order, and never a held-out row
    info = get_run(bootstrap, summary["run_id"])
    written = [p for p in (Prompt.decode(m.value(), m.headers()) for m in read_run(bootstrap, info, topics.PROMPTS))
               if p.run_id == summary["run_id"]]
    rows = training_prompts(config, len(written))
    assert [p.prompt_text for p in written] == [r.prompt for r in rows]
    assert not {r.row_id for r in heldout_prompts(config)} & {r.row_id for r in rows}

    # evaluations at version 0 and at the last version, on all 12 held-out prompts, with the paired interval
    evals = summary["eval"]
    assert [e["version"] for e in evals] == [0, 2] and all(e["n"] == 12 for e in evals)
    assert all(0.0 <= e["pass_at_1"] <= 1.0 and e["eval_s"] > 0 for e in evals)
    delta = summary["eval_delta"]
    assert delta["from_version"] == 0 and delta["to_version"] == 2
    lo, hi = delta["ci95"]
    assert lo <= delta["pass_at_1_diff"] <= hi
    # version 0's evaluation ran inside the RL window, the last version's after the last step
    assert summary["train_wall_s_excl_eval"] == pytest.approx(summary["rl_wall_s"] - evals[0]["eval_s"], abs=0.01)

    # the data identity recorded with the run's summary names the file by its bytes
    assert summary["data"]["sha256"] == hashlib.sha256(data.read_bytes()).hexdigest()
    assert summary["data"]["rows"] == 48 and summary["data"]["heldout"] == 12
    assert json.loads(get_run(bootstrap, summary["run_id"]).summary_json or "{}")["data"] == summary["data"]

    # TensorBoard event files in the run directory
    acc = EventAccumulator(summary["tensorboard"])
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"trainer/reward_mean", "trainer/eval_pass_at_1", "trainer/loss"} <= tags
    assert [e.step for e in acc.Scalars("trainer/reward_mean")] == [0, 1]
    assert [e.step for e in acc.Scalars("trainer/eval_pass_at_1")] == [0, 2]
