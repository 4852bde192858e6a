"""Supervised warm-up on short answers, so that RL starts from a policy with non-zero reward.

Loss: token-level mean negative log-likelihood of the reference answer tokens (EOS included) given
the prompt; prompt tokens are never in the loss. Only samples whose reference has at most
``max_answer_chars`` characters are used (rejection sampling from the task), so the long tail is
left for RL to learn.
"""

from __future__ import annotations

import random

import torch
from transformers import PreTrainedTokenizerBase

from dora_rl.core.tasks import Task, TaskSample
from dora_rl.modeling import encode_answer, encode_prompt

from .grpo import micro_batches, sequence_logprobs, warmup_cosine_schedule


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
    grad_clip: float = 0.0,
    micro_tokens: int = 2048,
    warmup_frac: float = 0.1,
    final_lr_frac: float = 0.05,
) -> list[float]:
    """Run ``steps`` AdamW steps of answer-only SFT; returns the loss of every step.

    Learning rate: linear warm-up from ``lr / w`` to ``lr`` over ``w = warmup_frac * steps`` steps, then
    cosine decay to ``final_lr_frac * lr`` (measured on the 1.6M model, 200 steps: eval reward 0.46–0.56
    with this schedule vs 0.26–0.32 at a constant lr 3e-3).

    Deterministic for a given ``seed`` and initial model (the batch stream comes from
    ``random.Random(seed)``). The model is left in ``eval()`` mode. ``grad_clip`` (max grad norm) is
    off by default: at lr 3e-3, clipping at 1.0 measurably slowed the warm-up of the tiny model.
    Each batch is computed in length-sorted micro-batches of at most ``micro_tokens`` padded tokens
    with gradient accumulation (loss normalised by the batch's answer-token count): same gradient as
    one padded batch, less padding.
    """
    rng = random.Random(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = warmup_cosine_schedule(opt, max(1, int(warmup_frac * steps)), steps, final_lr_frac)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    losses: list[float] = []
    model.train()
    for _ in range(steps):
        batch = short_samples(task, rng, batch_size, max_answer_chars)
        prompts = [encode_prompt(tokenizer, s.prompt) for s in batch]
        answers = [encode_answer(tokenizer, s.reference) for s in batch]
        n_tok = float(sum(len(a) for a in answers))
        order = sorted(range(len(batch)), key=lambda i: len(prompts[i]) + len(answers[i]))
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for micro in micro_batches(order, prompts, answers, micro_tokens):
            logp, mask = sequence_logprobs(model, [prompts[i] for i in micro], [answers[i] for i in micro],
                                           pad_id=int(pad))
            loss = -(logp * mask).sum() / n_tok
            loss.backward()
            total += float(loss.detach())
        if grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        opt.step()
        sched.step()
        losses.append(total)
    model.eval()
    return losses
