"""Supervised warm-up on short answers, so that RL starts from a policy with non-zero reward.

Loss: token-level mean negative log-likelihood of the reference answer tokens (EOS included) given
the prompt; prompt tokens are never in the loss. Only samples whose reference has at most
``max_answer_chars`` characters are used (rejection sampling from the task), so the long tail is
left for RL to learn.
"""

from __future__ import annotations

import random

import torch
from dora_rl.producers.tasks import Task, TaskSample
from transformers import PreTrainedTokenizerBase

from dora_rl.modeling import encode_answer, encode_prompt

from .grpo import sequence_logprobs


def short_samples(task: Task, rng: random.Random, n: int, max_answer_chars: int) -> list[TaskSample]:
    """``n`` task samples whose reference is at most ``max_answer_chars`` characters long."""
    out: list[TaskSample] = []
    while len(out) < n:
        s = task.sample(rng)
        if len(s.reference) <= max_answer_chars:
            out.append(s)
    return out


def sft_warmup(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    task: Task,
    steps: int,
    batch_size: int,
    lr: float,
    max_answer_chars: int,
    seed: int,
    grad_clip: float = 1.0,
) -> list[float]:
    """Run ``steps`` AdamW steps of answer-only SFT; returns the loss of every step.

    Deterministic for a given ``seed`` and initial model (the batch stream comes from
    ``random.Random(seed)``). The model is left in ``eval()`` mode.
    """
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    losses: list[float] = []
    model.train()
    for _ in range(steps):
        batch = short_samples(task, rng, batch_size, max_answer_chars)
        prompts = [encode_prompt(tokenizer, s.prompt) for s in batch]
        answers = [encode_answer(tokenizer, s.reference) for s in batch]
        logp, mask = sequence_logprobs(model, prompts, answers, pad_id=int(pad))
        loss = -(logp * mask).sum() / mask.sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        losses.append(float(loss.detach()))
    model.eval()
    return losses
