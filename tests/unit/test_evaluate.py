"""Held-out evaluation (``consumers/trainer/evaluate.py``): greedy decoding, pass@1, paired bootstrap.

The module-level reward functions are imported by the reward runner's worker by entry point.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dora_rl.consumers.trainer.evaluate import evaluate, greedy_completions
from dora_rl.core.paired_bootstrap import paired_bootstrap
from dora_rl.core.prompt_data import PromptRow
from dora_rl.modeling import build_tiny_model, encode_prompt, load_policy

HERE = __name__


def even_length(task: str, reference: str, completion: str) -> float:
    """1 for a completion of even length, 0.5 for length 1, else 0 (so pass@1 != reward mean)."""
    if len(completion) == 1:
        return 0.5
    return 1.0 if len(completion) % 2 == 0 else 0.0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, object]:
    return load_policy(build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "1m", seed=2))


def test_greedy_completions_are_the_argmax_path(tiny: tuple[torch.nn.Module, object]) -> None:
    model, tok = tiny
    prompts = [encode_prompt(tok, p) for p in ("abc=", "hgfedcba=", "j=")]  # type: ignore[arg-type]
    batched = greedy_completions(model, tok, prompts, max_new_tokens=6)
    for p, got in zip(prompts, batched, strict=True):
        ids = list(p)
        want: list[int] = []
        with torch.no_grad():
            for _ in range(6):  # one prompt alone, step by step, no padding: the reference greedy path
                nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
                if nxt == tok.eos_token_id:  # type: ignore[attr-defined]
                    break
                ids.append(nxt)
                want.append(nxt)
        assert got == want
    assert greedy_completions(model, tok, prompts, max_new_tokens=6, batch_tokens=16) == batched  # any batching


def test_evaluate_counts_only_full_rewards(tiny: tuple[torch.nn.Module, object]) -> None:
    model, tok = tiny
    rows = [PromptRow(row_id=str(i), prompt=p, reference="", task="reverse")
            for i, p in enumerate(["abc=", "ab=", "hij=", "aaaa=", "jihg=", "b="])]
    res = evaluate(model, tok, rows, f"{HERE}:even_length", 10.0, max_new_tokens=5, version=3)
    completions = greedy_completions(model, tok, [encode_prompt(tok, r.prompt) for r in rows], 5)  # type: ignore[arg-type]
    texts = [tok.decode(c, skip_special_tokens=True) for c in completions]  # type: ignore[attr-defined]
    rewards = [even_length("", "", t) for t in texts]
    assert res.version == 3 and res.n == 6 and res.refused == 0
    assert res.correct == "".join("1" if r == 1.0 else "0" for r in rewards)
    assert res.pass_at_1 == pytest.approx(res.correct.count("1") / 6)
    assert res.reward_mean == pytest.approx(float(np.mean(rewards)))
    assert model.training is False


def test_paired_bootstrap_interval() -> None:
    before = "0" * 100
    after = "1" * 30 + "0" * 70
    diff, lo, hi = paired_bootstrap(before, after, resamples=4000)
    assert diff == pytest.approx(0.30)
    assert 0.2 < lo < 0.3 < hi < 0.4  # binomial sd of the mean ~0.046: the 95% interval is about ±0.09
    same, lo0, hi0 = paired_bootstrap(after, after)
    assert same == 0.0 and lo0 == 0.0 and hi0 == 0.0  # paired: identical outcomes have no spread
    flipped = "1" * 15 + "0" * 85  # a noisy change around zero covers zero
    d2, lo2, hi2 = paired_bootstrap("0" * 85 + "1" * 15, flipped)
    assert d2 == 0.0 and lo2 < 0 < hi2
    with pytest.raises(ValueError, match="one length"):
        paired_bootstrap("01", "011")


def test_evaluate_refuses_empty(tiny: tuple[torch.nn.Module, object], tmp_path: Path) -> None:
    model, tok = tiny
    with pytest.raises(ValueError, match="at least one"):
        evaluate(model, tok, [], "task", 1.0, 4, 0)
