"""A run's prompts (``dora_rl/prompt_source.py``): the dataset producer's training rows and the trainer's
held-out rows come from one place, agree on the split, and are a pure function of the config."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from dora_rl.config import DoraConfig
from dora_rl.core.prompt_data import parse_gym_reference
from dora_rl.core.rewards import task_reward
from dora_rl.core.tasks import get_task
from dora_rl.modeling import build_char_tokenizer, encode_prompt
from dora_rl.producers.dataset import generate_prompts
from dora_rl.prompt_source import EVAL_SEED_OFFSET, dataset_identity, heldout_prompts, training_prompts


def _jsonl(path: Path, n: int) -> Path:
    with path.open("w") as f:
        for i in range(n):
            f.write(json.dumps({"id": f"q{i}", "question": f"{i}+{i}=", "answer": str(2 * i)}) + "\n")
    return path


def test_synthetic_prompts_are_the_task_stream() -> None:
    cfg = DoraConfig(task="reverse", seed=5).validate()
    rng = random.Random(5)
    want = [get_task("reverse").sample(rng) for _ in range(6)]
    got = training_prompts(cfg, 6)
    assert [(r.prompt, r.reference, r.task) for r in got] == [(s.prompt, s.reference, "reverse") for s in want]
    assert training_prompts(cfg, 3) == got[:3]  # a longer run extends, never reorders
    held = heldout_prompts(DoraConfig(task="reverse", seed=5, eval_prompts=4).validate())
    rng = random.Random(5 + EVAL_SEED_OFFSET)
    assert [r.prompt for r in held] == [get_task("reverse").sample(rng).prompt for _ in range(4)]


def test_dataset_split_is_shared_and_disjoint(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", 40)
    cfg = DoraConfig(dataset=str(path), prompt_field="question", id_field="id", reward_fn="exact", heldout=10,
                     eval_prompts=8, prompt_template="Q: {question}", seed=3).validate()
    train = training_prompts(cfg, 70)  # more than one epoch of the 30 training rows
    held = heldout_prompts(cfg)
    assert len(held) == 8 and not {r.row_id for r in held} & {r.row_id for r in train}
    assert len({r.row_id for r in train}) == 30
    assert training_prompts(cfg, 70) == train and training_prompts(cfg, 31) == train[:31]
    assert all(r.prompt.startswith("Q: ") for r in train)
    ident = dataset_identity(cfg)
    assert ident is not None and ident["rows"] == 40 and len(ident["sha256"]) == 64 and ident["heldout"] == 10
    with pytest.raises(ValueError, match="held-out"):
        heldout_prompts(DoraConfig(dataset=str(path), prompt_field="question", reward_fn="exact").validate())


def test_producer_writes_the_training_rows(tmp_path: Path) -> None:
    path = _jsonl(tmp_path / "d.jsonl", 12)
    cfg = DoraConfig(dataset=str(path), prompt_field="question", reward_fn="exact", heldout=2).validate()
    tok = build_char_tokenizer()
    prompts = list(generate_prompts("run", cfg, 5, lambda text: encode_prompt(tok, text)))
    rows = training_prompts(cfg, 5)
    assert [p.prompt_text for p in prompts] == [r.prompt for r in rows]
    assert [p.reference for p in prompts] == [r.reference for r in rows]
    assert [p.prompt_id for p in prompts] == [f"run/p{i}" for i in range(5)]
    assert prompts[0].task == "math"  # a file's rows carry DataSpec.task; the reward function is the config's


def test_task_verifier_of_a_reasoning_gym_dataset() -> None:
    cfg = DoraConfig(dataset="reasoning_gym:basic_arithmetic", gym_size=20, heldout=5, eval_prompts=5).validate()
    held = heldout_prompts(cfg)
    row = training_prompts(cfg, 1)[0]
    assert row.task == "reasoning_gym:basic_arithmetic" and len(held) == 5
    gold = parse_gym_reference(row.reference)[2]["answer"]
    assert task_reward(row.task, row.reference, f"Answer: {gold}") == 1.0
    assert task_reward(row.task, row.reference, "Answer: not a number") == 0.0
