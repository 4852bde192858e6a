"""One policy update from one training batch (pure torch; no Kafka).

Given a batch of trajectories (prompt ids, response ids, behaviour log-probs, rewards, group ids):

1. advantages ``A_i`` per trajectory: GRPO ``(r_i - mean_g) / (std_g + eps)``, or PPO-style
   ``r_i - mean_g`` (``loss = "ppo"``), over each trajectory's group ``g``;
2. ``ppo_epochs`` passes, each split into ``minibatches`` optimizer steps, of the clipped
   surrogate against the behaviour log-probs (token-level mean over the minibatch);
3. gradient-norm clipping at 1.0, AdamW.

Returns python-float statistics of the step (loss, clip fraction, approx KL, reward mean, tokens).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .grpo import group_advantages, ppo_clip_loss, sequence_logprobs


@dataclass(frozen=True)
class Sample:
    """What the update needs of one trajectory."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    behaviour_logprobs: Sequence[float]
    reward: float
    group_id: str


def compute_advantages(samples: Sequence[Sample], loss: str = "grpo") -> torch.Tensor:
    """Per-trajectory advantages over each sample's group."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    groups: dict[str, int] = {}
    index = torch.tensor([groups.setdefault(s.group_id, len(groups)) for s in samples], dtype=torch.long)
    if loss == "grpo":
        return group_advantages(rewards, index)
    means = torch.zeros(len(groups)).index_add_(0, index, rewards) / torch.bincount(index).float()
    return rewards - means[index]


def length_buckets(samples: Sequence[Sample], index: list[int], micro_tokens: int) -> list[list[int]]:
    """``index`` split into micro-batches of similar length, each with at most ``micro_tokens``
    padded tokens (rows x longest row), longest first; a row longer than the budget is alone."""
    order = sorted(range(len(samples)), key=lambda j: -(len(samples[j].prompt_ids) + len(samples[j].response_ids)))
    out: list[list[int]] = []
    cur: list[int] = []
    width = 0
    for j in order:
        w = len(samples[j].prompt_ids) + len(samples[j].response_ids)
        if cur and max(width, w) * (len(cur) + 1) > micro_tokens:
            out.append(cur)
            cur, width = [], 0
        cur.append(index[j])
        width = max(width, w)
    if cur:
        out.append(cur)
    return out


def policy_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, samples: Sequence[Sample],
                  *, loss: str = "grpo", clip_eps: float = 0.2, tis_cap: float | None = None,
                  ppo_epochs: int = 1, minibatches: int = 1, temperature: float = 1.0, pad_id: int = 0,
                  seed: int = 0, micro_tokens: int = 8192,
                  lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None) -> dict[str, float]:
    """Apply one training step on ``samples``; returns statistics.

    Each optimizer step's sequences are sorted by length and cut into micro-batches of at most
    ``micro_tokens`` padded tokens whose gradients accumulate (long-tailed lengths would
    otherwise pad every row to the longest one); the loss is normalised by the optimizer step's
    total response tokens, so the result equals one big batch up to float rounding.
    """
    t0 = time.perf_counter()
    samples = [s for s in samples if len(s.response_ids) > 0]
    if not samples:
        raise ValueError("batch has no trajectory with a response")
    adv = compute_advantages(samples, loss)
    gen = np.random.default_rng(seed)
    model.train()
    stats_acc: dict[str, list[float]] = {}
    n = len(samples)
    for _ in range(ppo_epochs):
        order = gen.permutation(n)
        for chunk in np.array_split(order, minibatches):
            if len(chunk) == 0:
                continue
            mb_tokens = float(sum(len(samples[i].response_ids) for i in chunk))
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for micro in length_buckets([samples[i] for i in chunk], list(chunk), micro_tokens):
                mb = [samples[i] for i in micro]
                new_logp, mask = sequence_logprobs(model, [s.prompt_ids for s in mb],
                                                   [s.response_ids for s in mb], temperature=temperature,
                                                   pad_id=pad_id)
                beh = torch.zeros_like(new_logp)
                for row, s in enumerate(mb):
                    beh[row, : len(s.behaviour_logprobs)] = torch.as_tensor(
                        np.asarray(s.behaviour_logprobs, dtype=np.float32))
                loss_t, st = ppo_clip_loss(new_logp, beh, adv[torch.as_tensor(micro)], mask, clip_eps, tis_cap,
                                           num_tokens=mb_tokens)
                loss_t.backward()  # gradients accumulate: the sum over micro-batches is the token mean
                total += float(loss_t.detach())
                w = float(mask.sum()) / mb_tokens
                for k, v in st.items():
                    stats_acc.setdefault(k, []).append(float(v) * w)
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            if lr_scheduler is not None:
                lr_scheduler.step()
            stats_acc.setdefault("loss", []).append(total)
            stats_acc.setdefault("grad_norm", []).append(float(gnorm))
    model.eval()
    steps_taken = ppo_epochs * min(minibatches, n)
    out = {k: float(np.sum(v) / steps_taken) if k not in ("loss", "grad_norm") else float(np.mean(v))
           for k, v in stats_acc.items()}
    rewards = np.array([s.reward for s in samples])
    out["reward_mean"] = float(rewards.mean())
    out["reward_std"] = float(rewards.std())
    out["trained_tokens"] = float(sum(len(s.response_ids) for s in samples))
    out["response_len_mean"] = out["trained_tokens"] / len(samples)
    out["update_s"] = time.perf_counter() - t0
    return out
