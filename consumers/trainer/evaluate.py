"""Held-out evaluation during training: greedy pass@1 of one policy version, and the paired bootstrap.

Called by the trainer role at version 0, every ``eval_every`` versions and at the last one, on the
run's held-out prompts (:func:`dora_rl.prompt_source.heldout_prompts`: rows never trained on). One
evaluation = greedy decoding (``do_sample=False``, at most ``max_new_tokens``) of every prompt, each
completion scored by the run's reward function through :class:`~dora_rl.infra.reward_worker.RewardRunner`
(the same function and timeout as the scorer; a refused call scores 0 and is counted in ``refused``).

Definitions (tested in ``tests/unit/test_evaluate.py``):

* ``correct[i] = 1`` iff prompt ``i``'s reward is ``>= 1 - 1e-9`` (a fully correct answer; partial
  credit counts in ``reward_mean`` only); ``pass_at_1 = mean(correct)``;
* :func:`~dora_rl.core.paired_bootstrap.paired_bootstrap` (pure numpy, in ``core``) of two evaluations on
  the same prompts (same order): the difference ``mean(b) - mean(a)`` and its percentile interval over
  ``resamples`` resamples of the prompt indices (the same indices for both: a paired interval);
* the outcome vector travels as a ``0``/``1`` string (``EvalResult.correct``), so one metric record on
  ``dora.metrics`` carries a whole evaluation and the summary can compute the interval from the log.

Greedy decoding makes an evaluation a deterministic function of (weights, prompts, reward function).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dora_rl.core.prompt_data import PromptRow
from dora_rl.core.rewards import RewardRequest
from dora_rl.infra.reward_worker import RewardRunner
from dora_rl.modeling import decode_completion, encode_prompt

CORRECT_AT = 1.0 - 1e-9


@dataclass(frozen=True)
class EvalResult:
    """One evaluation of one version on ``n`` held-out prompts."""

    version: int
    n: int
    pass_at_1: float
    reward_mean: float
    correct: str
    """``"0"``/``"1"`` per prompt, in the held-out order."""
    refused: int
    """Prompts whose reward call was refused (timeout, crash, invalid value): scored 0."""
    eval_s: float
    completion_tokens_mean: float


@torch.no_grad()
def greedy_completions(model: torch.nn.Module, tokenizer: object, prompts: Sequence[list[int]], max_new_tokens: int,
                       batch_tokens: int = 8192) -> list[list[int]]:
    """Greedy completions (token ids, EOS excluded) of ``prompts``, in their order; batched by length
    with at most ``batch_tokens`` padded tokens (prompt + completion) per batch."""
    eos = int(tokenizer.eos_token_id)  # type: ignore[attr-defined]
    pad = tokenizer.pad_token_id  # type: ignore[attr-defined]
    pad = eos if pad is None else int(pad)
    dev = next(model.parameters()).device
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: dict[int, list[int]] = {}
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end - start + 1) * (len(prompts[order[end]]) + max_new_tokens) <= batch_tokens:
            end += 1
        chunk = order[start:end]
        longest = max(len(prompts[i]) for i in chunk)
        ids = torch.full((len(chunk), longest), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), longest), dtype=torch.long)
        for row, i in enumerate(chunk):  # left padding: every prompt ends where generation starts
            ids[row, longest - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[row, longest - len(prompts[i]):] = 1
        gen = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new_tokens,  # type: ignore[operator]
                             do_sample=False, eos_token_id=eos, pad_token_id=pad)
        for row, i in enumerate(chunk):
            toks = [int(t) for t in gen[row, longest:].tolist()]
            out[i] = toks[: toks.index(eos)] if eos in toks else toks
        start = end
    return [out[i] for i in range(len(prompts))]


def evaluate(model: torch.nn.Module, tokenizer: object, rows: Sequence[PromptRow], reward_fn: str,
             reward_timeout_s: float, max_new_tokens: int, version: int) -> EvalResult:
    """Greedy pass@1 of ``model`` on ``rows`` (see the module docstring)."""
    if not rows:
        raise ValueError("evaluation needs at least one held-out prompt")
    t0 = time.perf_counter()
    was_training = model.training
    model.eval()
    try:
        prompts = [encode_prompt(tokenizer, r.prompt) for r in rows]  # type: ignore[arg-type]
        completions = greedy_completions(model, tokenizer, prompts, max_new_tokens)
    finally:
        model.train(was_training)
    texts = [decode_completion(tokenizer, c) for c in completions]  # type: ignore[arg-type]
    with RewardRunner(reward_fn, reward_timeout_s) as runner:
        outcomes = runner.score_many([RewardRequest(r.task, r.reference, t, item=f"eval v{version} {r.row_id}")
                                      for r, t in zip(rows, texts, strict=True)])
    rewards = [o if isinstance(o, float) else 0.0 for o in outcomes]
    correct = "".join("1" if r >= CORRECT_AT else "0" for r in rewards)
    return EvalResult(version=version, n=len(rows), pass_at_1=correct.count("1") / len(rows),
                      reward_mean=float(np.mean(rewards)), correct=correct,
                      refused=sum(not isinstance(o, float) for o in outcomes), eval_s=time.perf_counter() - t0,
                      completion_tokens_mean=float(np.mean([len(c) for c in completions])))
