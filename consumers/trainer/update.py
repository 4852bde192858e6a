"""One policy update from one training batch (pure torch; no Kafka) — the only RL update in the repo.

Given a batch of trajectories (prompt ids, response ids, behaviour log-probs, rewards, group ids):

1. advantages ``A_i`` per trajectory: GRPO ``(r_i - mean_g) / (std_g + eps)``, or PPO-style
   ``r_i - mean_g`` (``loss = "ppo"``), over each trajectory's group ``g``;
2. ``ppo_epochs`` passes, each split into ``minibatches`` optimizer steps of whole groups (shuffled
   per epoch), of the clipped surrogate against the behaviour log-probs, normalised by the
   minibatch's response-token count;
3. gradient-norm clipping at ``grad_clip``, the optimizer step, then the LR scheduler's step. A step whose
   loss or gradient norm is not finite is never taken: :class:`NonFiniteUpdate` is raised before it.

Exactness invariants (tested): micro-batching never changes the update — a minibatch is computed in
micro-batches of at most ``micro_tokens`` padded tokens whose gradients accumulate, each divided by
the minibatch's token count, so their sum is the one-batch token mean; trajectories with ``A == 0``
(e.g. a group whose rewards are all equal) are left out of the forward/backward but kept in the
token count, since their loss and gradient are identically 0. Micro-batches are ordered by prompt,
so a group's samples share one prompt forward (:func:`~.grpo.sequence_logprobs`).

Decoupled PPO (``decoupled=True``, for batches holding stale trajectories): before the first optimizer
step, the log-probs of every trained trajectory under the current weights (the *proximal* policy)
are computed without gradient; the clip then trusts the proximal policy, and each token is weighted
by ``min(exp(proximal - behaviour), tis_cap)`` to correct the behaviour→proximal gap. Without it, a
trajectory one version old starts an update with ``ratio = pi_v / pi_(v-1)`` already outside the clip
range on many tokens (measured: clip fraction 0.2–0.3, approx KL 0.1–0.24 at staleness 1), whose
gradients the clip then zeroes. With ``proximal == behaviour`` (fresh data) both are the same update.

Data parallelism (``dp=DataParallel(rank, world)``, model sharded by :func:`~.distributed.shard_model`):
every rank gets the *whole* batch (same order) and computes the same minibatch split (same seed); in
each minibatch, group ``j`` (in the minibatch's order) is trained by rank ``j % world`` only, while the
loss stays normalised by the *whole* minibatch's token count, so the SUM of the ranks' gradients that
FSDP reduces is the single-rank gradient: N ranks make the update one rank makes on the union
(:mod:`~.distributed` has the formula). Every rank runs the same number of forward/backward passes per
optimizer step (FSDP's collectives must match): a rank with fewer micro-batches than another runs
zero-loss dummy passes (one row of one token; they add exactly 0 to every gradient). Under ``dp`` a
micro-batch is one model call (``share_prompts=False``): the shared-prompt path makes one or two calls
depending on the rows, which would unbalance the collectives between ranks.

Train-inference mismatch: in the first minibatch of the first epoch (no optimizer step yet, so the
trainer's weights are the behaviour version's for a fresh trajectory) every fresh (``staleness == 0``)
trained token gives ``|new_logp - behaviour_logp|``, the gap between what the engine sampled with and
what the trainer computes for the same weights; ``logprob_diff_mean`` / ``logprob_diff_max`` over those
tokens (a uniform random ``1 / minibatches`` of the groups; absent when none is fresh).

Returns python-float statistics of the step (loss, clip fraction, approx KL, reward mean, tokens).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from .distributed import DataParallel, all_reduce_max, all_reduce_sum
from .grpo import group_advantages, micro_batches, ppo_clip_loss, sequence_logprobs


class NonFiniteUpdate(ValueError):
    """An optimizer step would have applied a non-finite loss or gradient; it was not taken."""


@dataclass(frozen=True)
class Sample:
    """What the update needs of one trajectory."""

    prompt_ids: Sequence[int]
    response_ids: Sequence[int]
    behaviour_logprobs: Sequence[float]
    reward: float
    group_id: str
    staleness: int = 0
    """Versions between the trajectory's oldest token and the update (0: fresh, on-policy)."""


def trainable(samples: Sequence[Sample]) -> list[Sample]:
    """The samples an update trains on, in order: those with a response (an empty one has no token)."""
    return [s for s in samples if len(s.response_ids) > 0]


def compute_advantages(samples: Sequence[Sample], loss: str = "grpo") -> torch.Tensor:
    """Per-trajectory advantages over each sample's group (of :func:`trainable` samples: the one
    advantage formula of the repository, also what ``dora-rl replay rescore`` reports)."""
    rewards = torch.tensor([s.reward for s in samples], dtype=torch.float32)
    groups: dict[str, int] = {}
    index = torch.tensor([groups.setdefault(s.group_id, len(groups)) for s in samples], dtype=torch.long)
    if loss == "grpo":
        return group_advantages(rewards, index)
    means = torch.zeros(len(groups)).index_add_(0, index, rewards) / torch.bincount(index).float()
    return rewards - means[index]


def group_minibatches(samples: Sequence[Sample], minibatches: int, gen: np.random.Generator) -> list[list[int]]:
    """Sample indices split into ``minibatches`` chunks of whole groups, groups in a random order.

    Every index appears exactly once; chunks differ in group count by at most one (empty chunks
    are dropped when there are fewer groups than ``minibatches``).
    """
    by_group: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        by_group.setdefault(s.group_id, []).append(i)
    groups = list(by_group.values())
    order = gen.permutation(len(groups))
    chunks = [[i for g in part for i in groups[int(g)]] for part in np.array_split(order, max(1, minibatches))]
    return [c for c in chunks if c]


def prompt_order(samples: Sequence[Sample], index: Sequence[int]) -> list[int]:
    """``index`` sorted by prompt length, then prompt, then response length: a group stays together
    (one shared prompt forward) and rows of similar length share a micro-batch (little padding)."""
    return sorted(index, key=lambda i: (len(samples[i].prompt_ids), tuple(samples[i].prompt_ids),
                                        len(samples[i].response_ids)))


def rank_rows(samples: Sequence[Sample], chunk: Sequence[int], dp: DataParallel) -> list[list[int]]:
    """``chunk`` (a minibatch of whole groups, from :func:`group_minibatches`) split by the rank that trains
    it: the ``j``-th group of the chunk, in chunk order, goes to rank ``dp.owner(j)``. Every index lands in
    exactly one list; ``out[r]`` keeps chunk order. Deterministic, so every rank computes every rank's share."""
    slot: dict[str, int] = {}
    out: list[list[int]] = [[] for _ in range(dp.world)]
    for i in chunk:
        out[dp.owner(slot.setdefault(samples[i].group_id, len(slot)))].append(i)
    return out


def _dummy_pass(model: torch.nn.Module, sample: Sample, temperature: float, pad_id: int, backward: bool) -> None:
    """One forward (and backward if ``backward``) of one row of one token whose loss is multiplied by 0:
    it runs the FSDP collectives of a micro-batch and adds exactly 0 to every gradient."""
    logp, _ = sequence_logprobs(model, [sample.prompt_ids[:1]], [sample.response_ids[:1]], temperature=temperature,
                                pad_id=pad_id, share_prompts=False)
    if backward:
        (logp.sum() * 0.0).backward()


def _pad_rows(index: Sequence[int], rows: dict[int, torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """``rows[index[b]]`` right-padded with zeros into a tensor shaped like ``like`` ``[B, R]``."""
    out = torch.zeros_like(like)
    for b, i in enumerate(index):
        out[b, : len(rows[i])] = rows[i]
    return out


@torch.no_grad()
def proximal_logprobs(model: torch.nn.Module, prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
                      order: list[int], temperature: float, pad_id: int, micro_tokens: int,
                      share_prompts: bool = True, packed: bool = False) -> dict[int, torch.Tensor]:
    """Log-probs of ``responses[i]`` (``i`` in ``order``) under the model's current weights, no gradient:
    ``{i: logp [len(responses[i])]}`` — the proximal policy of decoupled PPO. One model call per
    micro-batch of ``micro_batches(order, ..., packed)`` when ``share_prompts`` is False or ``packed``."""
    out: dict[int, torch.Tensor] = {}
    for micro in micro_batches(order, prompts, responses, micro_tokens, packed):
        logp, _ = sequence_logprobs(model, [prompts[i] for i in micro], [responses[i] for i in micro],
                                    temperature=temperature, pad_id=pad_id, share_prompts=share_prompts,
                                    packed=packed)
        for row, i in enumerate(micro):
            out[i] = logp[row, : len(responses[i])].clone()
    return out


def policy_update(model: torch.nn.Module, optimizer: torch.optim.Optimizer, samples: Sequence[Sample],
                  *, loss: str = "grpo", clip_eps: float = 0.2, tis_cap: float | None = 5.0,
                  ppo_epochs: int = 1, minibatches: int = 1, temperature: float = 1.0, pad_id: int = 0,
                  seed: int = 0, micro_tokens: int = 1024, grad_clip: float = 1.0, decoupled: bool = False,
                  lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
                  dp: DataParallel | None = None, packed: bool = False) -> dict[str, float]:
    """Apply one training step on ``samples`` (see the module docstring); returns statistics.

    With ``dp`` (``model`` sharded by :func:`~.distributed.shard_model`, ``optimizer`` over its sharded
    parameters), every rank passes the same ``samples`` and arguments and trains its share of each
    minibatch; collective, so every rank must call it.

    Stats: ``loss`` and ``grad_norm`` are means over optimizer steps; ``clip_frac``, ``approx_kl``,
    ``ratio_mean`` are token-weighted means over everything trained; ``ratio_max`` the maximum;
    ``optimizer_steps``; ``tis_weight_mean`` (decoupled only); ``reward_mean``/``reward_std``/
    ``trained_tokens``/``response_len_mean`` of the batch; ``update_s`` the wall time; ``computed_tokens``
    (prompt + response tokens of every forward with a gradient) and ``logprob_diff_mean``/``_max`` (above).
    ``packed``: micro-batches are packed rows without padding (:func:`~.grpo.packed_logprobs`), their
    budget counted in real tokens.
    Under ``dp`` every figure but ``update_s`` (this rank's wall time) is the global one, the same on
    every rank: the per-step losses and the token-weighted sums are summed over the ranks (all-reduce),
    ``ratio_max`` is their maximum, and the gradient norm is already global (FSDP's DTensor gradients).
    The model is left in ``eval()`` mode.
    """
    t0 = time.perf_counter()
    samples = trainable(samples)
    if not samples:
        raise ValueError("batch has no trajectory with a response")
    adv = compute_advantages(samples, loss)
    dev = next(model.parameters()).device
    gen = np.random.default_rng(seed)
    prompts = [s.prompt_ids for s in samples]
    responses = [s.response_ids for s in samples]
    weighted = {"clip_frac": 0.0, "approx_kl": 0.0, "ratio_mean": 0.0}
    if decoupled:
        weighted["tis_weight_mean"] = 0.0
    live_all = [i for i in range(len(samples)) if float(adv[i]) != 0.0]  # exact: A == 0 rows have zero loss
    live_set = set(live_all)
    behaviour = {i: torch.from_numpy(np.asarray(samples[i].behaviour_logprobs, dtype=np.float32)).to(dev)
                 for i in live_all}  # converted once, reused by every epoch
    # The whole split up front: the same draws of ``gen`` in the same order as split epoch by epoch.
    schedule = [group_minibatches(samples, minibatches, gen) for _ in range(ppo_epochs)]
    proximal: dict[int, torch.Tensor] = {}
    if decoupled and dp is None:
        proximal = proximal_logprobs(model, prompts, responses, prompt_order(samples, live_all), temperature, pad_id,
                                     micro_tokens, packed=packed)
    elif decoupled and dp is not None:  # each rank: the rows it will train in any epoch, padded with dummies
        mine = [sorted({i for epoch in schedule for chunk in epoch for i in rank_rows(samples, chunk, dp)[r]
                        if i in live_set}) for r in range(dp.world)]
        counts = [len(micro_batches(prompt_order(samples, rows), prompts, responses, micro_tokens, packed))
                  for rows in mine]
        proximal = proximal_logprobs(model, prompts, responses, prompt_order(samples, mine[dp.rank]), temperature,
                                     pad_id, micro_tokens, share_prompts=False, packed=packed)
        with torch.no_grad():
            for _ in range(max(counts) - counts[dp.rank]):
                _dummy_pass(model, samples[0], temperature, pad_id, backward=False)
    seen_tokens, ratio_max, computed = 0.0, 1.0, 0
    mismatch = Mismatch()
    first_step = True
    losses: list[float] = []
    norms: list[float] = []
    model.train()
    for epoch in schedule:
        for chunk in epoch:
            mb_tokens = float(sum(len(responses[i]) for i in chunk))  # the WHOLE minibatch's, on every rank
            if dp is None:
                micros = micro_batches(prompt_order(samples, [i for i in chunk if i in live_set]), prompts,
                                       responses, micro_tokens, packed)
                passes = len(micros)
            else:
                per_rank = [micro_batches(prompt_order(samples, [i for i in rows if i in live_set]), prompts,
                                          responses, micro_tokens, packed) for rows in rank_rows(samples, chunk, dp)]
                micros, passes = per_rank[dp.rank], max(len(m) for m in per_rank)
            optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for micro in micros:
                new_logp, mask = sequence_logprobs(model, [prompts[i] for i in micro],
                                                   [responses[i] for i in micro], temperature=temperature,
                                                   pad_id=pad_id, share_prompts=dp is None, packed=packed)
                beh = _pad_rows(micro, behaviour, new_logp)
                computed += sum(len(prompts[i]) + len(responses[i]) for i in micro)
                if first_step:
                    mismatch.add(new_logp, beh, mask, [samples[i].staleness == 0 for i in micro])
                prox = _pad_rows(micro, proximal, new_logp) if decoupled else None
                loss_t, st = ppo_clip_loss(new_logp, beh, adv[torch.as_tensor(micro)].to(dev), mask, clip_eps,
                                           tis_cap if decoupled else None, proximal_logp=prox, num_tokens=mb_tokens)
                loss_t.backward()  # gradients accumulate: the sum over micro-batches is the token mean
                total += float(loss_t.detach())
                for k in weighted:
                    weighted[k] += st.get(k, 0.0) * st["n_tokens"]
                seen_tokens += st["n_tokens"]
                ratio_max = max(ratio_max, st["ratio_max"])
            for _ in range(passes - len(micros)):  # match the other ranks' collectives
                _dummy_pass(model, samples[0], temperature, pad_id, backward=True)
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip if grad_clip > 0 else float("inf"))
            if isinstance(norm, DTensor):
                norm = norm.full_tensor()
            if not math.isfinite(float(norm)) or (dp is None and not math.isfinite(total)):  # norm: global, every rank
                raise NonFiniteUpdate(f"optimizer step {len(losses)}: loss {total}, gradient norm {float(norm)}; "
                                      "no weight was changed by this step")
            optimizer.step()
            first_step = False
            if lr_scheduler is not None:
                lr_scheduler.step()
            losses.append(total)
            norms.append(float(norm))
    model.eval()
    if dp is not None:
        keys = list(weighted)
        summed = all_reduce_sum([weighted[k] for k in keys] + [seen_tokens, *losses], dp)
        weighted = dict(zip(keys, summed[: len(keys)], strict=True))
        seen_tokens, losses = summed[len(keys)], summed[len(keys) + 1:]
        ratio_max = all_reduce_max(ratio_max, dp)
        mismatch = mismatch.all_reduced(dp)
        computed = int(all_reduce_sum([float(computed)], dp)[0])
    out = {k: v / seen_tokens if seen_tokens else 0.0 for k, v in weighted.items()}
    out.update(loss=float(np.mean(losses)), grad_norm=float(np.mean(norms)), ratio_max=ratio_max,
               optimizer_steps=float(len(losses)))
    rewards = np.array([s.reward for s in samples])
    out["reward_mean"] = float(rewards.mean())
    out["reward_std"] = float(rewards.std())
    out["trained_tokens"] = float(sum(len(r) for r in responses))
    out["response_len_mean"] = out["trained_tokens"] / len(samples)
    out["computed_tokens"] = float(computed)
    out.update(mismatch.stats())
    out["update_s"] = time.perf_counter() - t0
    return out


@dataclass
class Mismatch:
    """Running ``|new - behaviour|`` over fresh response tokens (sum, count, max)."""

    total: float = 0.0
    tokens: float = 0.0
    largest: float = 0.0

    def add(self, new_logp: torch.Tensor, behaviour: torch.Tensor, mask: torch.Tensor, fresh: list[bool]) -> None:
        """Add the tokens of the rows marked ``fresh`` (``[B, R]`` tensors, ``mask`` 1 on real tokens)."""
        if not any(fresh):
            return
        rows = mask * torch.tensor(fresh, dtype=mask.dtype, device=mask.device).unsqueeze(-1)
        gap = (new_logp.detach() - behaviour).abs() * rows
        self.total += float(gap.sum())
        self.tokens += float(rows.sum())
        self.largest = max(self.largest, float(gap.max()))

    def all_reduced(self, dp: DataParallel) -> Mismatch:
        total, tokens = all_reduce_sum([self.total, self.tokens], dp)
        return Mismatch(total, tokens, all_reduce_max(self.largest, dp))

    def stats(self) -> dict[str, float]:
        """``logprob_diff_mean`` / ``logprob_diff_max``, or nothing when no fresh token was seen."""
        if self.tokens == 0:
            return {}
        return {"logprob_diff_mean": self.total / self.tokens, "logprob_diff_max": self.largest}
