"""Verifiers (``dora_rl.core.verifiers``), alone and through the reward runner.

``sleeps_forever`` is a reward function the runner's worker imports by entry point
(``f"{__name__}:sleeps_forever"``), so it must stay at module level.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from dora_rl.core.prompt_data import DataSpec, gym_reference
from dora_rl.core.rewards import BUILTIN, RewardError, RewardRequest, UnknownTaskError
from dora_rl.core.verifiers import (
    exact_reward,
    extract_boxed,
    extract_gym_answer,
    format_reward,
    math_reward,
    reasoning_gym_reward,
)
from dora_rl.infra.reward_worker import RewardRunner
from dora_rl.prompt_files import load_rows

HERE = __name__


def sleeps_forever(task: str, reference: str, completion: str) -> float:
    """A verifier that hangs: the runner must cut it off."""
    while True:
        time.sleep(60)


RECORDS = [
    {"id": "half", "problem": "Write one half in simplest form.", "solution": "\\frac12"},
    {"id": "decimal", "problem": "What is 1/2 as a decimal?", "solution": "0.5"},
    {"id": "sum", "problem": "What is 3 + 4?", "solution": "7"},
]
COMPLETIONS = {"half": "One half is 0.5, so the answer is \\boxed{0.5}.",
               "decimal": "Dividing 1 by 2 gives \\boxed{\\frac12}",
               "sum": "3 + 4 = 8, so \\boxed{8}"}


def test_acceptance_prompts_from_jsonl_and_parquet_scored_by_math_verify_through_the_runner(tmp_path: Path) -> None:
    """The issue's acceptance test, as one flow."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    jsonl = tmp_path / "prompts.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    parquet = tmp_path / "prompts.parquet"
    pq.write_table(pa.Table.from_pylist(RECORDS), parquet)
    specs = [DataSpec(str(p), prompt_field="problem", answer_field="solution", id_field="id",
                      template="Problem: {problem}\nSolution:") for p in (jsonl, parquet)]
    rows = load_rows(specs[0])
    assert rows == load_rows(specs[1])
    assert rows[0].prompt == "Problem: Write one half in simplest form.\nSolution:" and rows[0].task == "math"

    with RewardRunner("math", timeout_s=30.0, spare=False) as runner:  # 30 s covers math-verify's import
        out = runner.score_many([RewardRequest(r.task, r.reference, COMPLETIONS[r.row_id], r.row_id) for r in rows])
    assert out == [1.0, 1.0, 0.0]  # \frac12 == 0.5 both ways; 8 != 7

    with RewardRunner(f"{HERE}:sleeps_forever", timeout_s=1.0) as runner:
        t0 = time.monotonic()
        hung = runner.score(rows[2].task, rows[2].reference, COMPLETIONS["sum"], item=rows[2].row_id)
        assert time.monotonic() - t0 < 5.0
    assert isinstance(hung, RewardError) and hung.kind == "timeout"
    assert "trajectory sum " in hung.message and "1 s" in hung.message


def test_builtin_names_resolve_to_the_verifiers() -> None:
    assert BUILTIN["math"] is math_reward and BUILTIN["exact"] is exact_reward
    assert BUILTIN["format"] is format_reward and BUILTIN["reasoning_gym"] is reasoning_gym_reward


@pytest.mark.parametrize("reference,completion", [
    ("0.5", "\\boxed{\\frac12}"), ("\\frac12", "0.5"), ("\\frac{1}{2}", "The answer is $\\frac12$."),
    ("1/2", "so \\boxed{0.5}"), ("x^2+2x+1", "\\boxed{(x+1)^2}"), ("3\\sqrt{2}", "\\boxed{\\sqrt{18}}"),
    ("She earns 9 * 8 = 72.\n#### 72", "\\boxed{72}"), ("7", "First 3, then the final answer is 7"),
    ("5", "\\boxed{4} no wait, \\boxed{5}"),
])
def test_math_equivalent_forms_score_one(reference: str, completion: str) -> None:
    assert math_reward("math", reference, completion) == 1.0


@pytest.mark.parametrize("reference,completion", [
    ("7", "\\boxed{8}"), ("0.5", "\\boxed{0.25}"), ("7", "I do not know"), ("5", "\\boxed{5} no wait, \\boxed{6}"),
    ("x^2+2x+1", "\\boxed{(x-1)^2}"), ("7", ""),
])
def test_math_wrong_answers_score_zero(reference: str, completion: str) -> None:
    assert math_reward("math", reference, completion) == 0.0


def test_math_blank_reference_is_a_data_error() -> None:
    with pytest.raises(ValueError, match="cannot parse the reference"):
        math_reward("math", "  ", "\\boxed{1}")


def test_extract_boxed_takes_the_last_closed_box_with_nested_braces() -> None:
    assert extract_boxed("\\boxed{1} then \\boxed{\\frac{a}{b}} end") == "\\frac{a}{b}"
    assert extract_boxed("\\boxed{2} and \\boxed{unclosed") == "2"
    assert extract_boxed("no box") is None


def test_exact_normalises_whitespace_and_one_trailing_period() -> None:
    assert exact_reward("t", "Paris", "  Paris.\n") == 1.0
    assert exact_reward("t", "42.", "42") == 1.0
    assert exact_reward("t", "Paris", "paris") == 0.0  # case-sensitive
    assert exact_reward("t", "42", "42..") == 0.0  # only one period is dropped
    assert exact_reward("t", "4 2", "42") == 0.0


@pytest.mark.parametrize("completion,score", [
    ("so \\boxed{42}", 1.0), ("\\boxed{ \\frac{1}{2} }.", 1.0), ("Answer: 42", 0.0), ("\\boxed{}", 0.0),
    ("\\boxed{ }", 0.0), ("\\boxed{42", 0.0), ("42", 0.0),
])
def test_format_wants_a_closed_nonblank_box(completion: str, score: float) -> None:
    assert format_reward("t", "ignored", completion) == score


@pytest.mark.parametrize("completion,gold,expected", [
    ("<think>2+2</think><answer> 4 </answer>", "4", "4"),
    ("work...\n**Answer:** hello world.", "hello world", "hello world"),
    ("Answer: 14\nbecause 7 * 2 = 14 and 3 apples", "14", "14"),
    ("Let me add them.\nThe total is 1,234.", "1234", "1234"),
    ("Reversed:\nolleh", "olleh", "olleh"),
    ("Answer:\n1 2\n3 4", "1 2\n3 4", "1 2\n3 4"),
    ("Here is the grid.\n\n1 2\n3 4\n", "1 2\n3 4", "1 2\n3 4"),
    ("I got \\boxed{-3}", "-3", "-3"),
    ("The answer is 3 or maybe 5", "3", "5"),  # one candidate: the last number, never the best of several
    ("The sentence ends.", "The sentence ends.", "The sentence ends."),
])
def test_gym_answer_extraction_is_lenient_but_single(completion: str, gold: str, expected: str) -> None:
    assert extract_gym_answer(completion, gold) == expected


def test_reasoning_gym_reward_uses_the_datasets_own_verifier() -> None:
    row = load_rows(DataSpec("reasoning_gym:spell_backward", size=3, seed=1))[0]
    word = json.loads(row.reference)["entry"]["answer"]
    assert reasoning_gym_reward(row.task, row.reference, f"Spelled backward:\n{word}") == 1.0
    assert reasoning_gym_reward(row.task, row.reference, f"<answer>{word}x</answer>") < 1.0
    chain = load_rows(DataSpec("reasoning_gym:chain_sum", size=3, seed=1))[0]
    gold = json.loads(chain.reference)["entry"]["answer"]
    assert reasoning_gym_reward(chain.task, chain.reference, f"The sum is +0{gold}.00") == 1.0  # its own tolerance


def test_reasoning_gym_reward_refuses_other_tasks_and_bad_references() -> None:
    reference = gym_reference("chain_sum", {}, {"question": "1+1=?", "answer": "2", "metadata": {}})
    assert reasoning_gym_reward("reasoning_gym:chain_sum", reference, "2") == 1.0
    with pytest.raises(UnknownTaskError):
        reasoning_gym_reward("math", reference, "2")
    with pytest.raises(ValueError, match="does not match"):
        reasoning_gym_reward("reasoning_gym:products", reference, "2")
    with pytest.raises(ValueError, match="not a reasoning-gym reference"):
        reasoning_gym_reward("reasoning_gym:chain_sum", "2", "2")
