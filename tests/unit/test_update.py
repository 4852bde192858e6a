"""One policy update: micro-batching by length gives the same gradient as one big batch."""

from __future__ import annotations

import copy

import numpy as np
import torch

from dora_rl.consumers.trainer.grpo import micro_batches
from dora_rl.consumers.trainer.update import (
    Sample,
    compute_advantages,
    group_minibatches,
    policy_update,
    prompt_order,
)
from dora_rl.modeling import build_tiny_model, load_policy


def _samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        n = int(torch.randint(1, 40, (1,), generator=g))
        out.append(Sample(prompt_ids=[1, 5, 6, 7], response_ids=torch.randint(4, 50, (n,), generator=g).tolist(),
                          behaviour_logprobs=(-torch.rand(n, generator=g) * 3).tolist(), reward=float(i % 3) / 2,
                          group_id=f"g{i // 4}"))
    return out


def test_micro_batches_cover_every_row_once_within_budget() -> None:
    s = _samples()
    order = prompt_order(s, range(len(s)))
    buckets = micro_batches(order, [x.prompt_ids for x in s], [x.response_ids for x in s], budget=100)
    assert [i for b in buckets for i in b] == order
    for b in buckets:
        width = max(len(s[i].prompt_ids) for i in b) + max(len(s[i].response_ids) for i in b)
        assert width * len(b) <= 100 or len(b) == 1


def test_group_minibatches_keep_groups_whole_and_cover_everything_once() -> None:
    s = [Sample([1, k % 5], [3], [-1.0], 0.0, f"g{k // 4}") for k in range(40)]  # 10 groups of 4
    chunks = group_minibatches(s, 4, np.random.default_rng(0))
    assert sorted(i for c in chunks for i in c) == list(range(40))
    assert sorted(len(c) for c in chunks) == [8, 8, 12, 12]
    for c in chunks:
        assert len(c) == len({s[i].group_id for i in c}) * 4
    assert len(group_minibatches(s[:8], 4, np.random.default_rng(0))) == 2  # 2 groups: no empty chunk


def test_micro_batched_update_equals_one_batch(tmp_path) -> None:  # type: ignore[no-untyped-def]
    model, _ = load_policy(build_tiny_model(tmp_path / "m", seed=3))
    twin = copy.deepcopy(model)
    s = _samples()
    opt_a = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_b = torch.optim.SGD(twin.parameters(), lr=0.1)
    a = policy_update(model, opt_a, s, micro_tokens=10_000)
    b = policy_update(twin, opt_b, s, micro_tokens=60)
    for (n1, p1), (_, p2) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.allclose(p1, p2, atol=1e-6), n1
    assert abs(a["loss"] - b["loss"]) < 1e-5
    assert abs(a["clip_frac"] - b["clip_frac"]) < 1e-6


def test_grpo_advantages_are_zero_mean_per_group() -> None:
    adv = compute_advantages(_samples())
    assert abs(float(adv[:4].sum())) < 1e-5 and abs(float(adv[4:].sum())) < 1e-5


def test_zero_advantage_skip_and_grouping_do_not_change_the_update(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Groups of equal rewards (A == 0) are skipped, yet the update equals the plain token-mean
    REINFORCE/PPO step computed by hand over the whole batch (one optimizer step, SGD)."""
    model, _ = load_policy(build_tiny_model(tmp_path / "m", seed=5))
    twin = copy.deepcopy(model)
    s = _samples()
    s = [Sample(x.prompt_ids, x.response_ids, x.behaviour_logprobs, 0.5 if i < 4 else x.reward, x.group_id)
         for i, x in enumerate(s)]  # group g0: all rewards equal -> A == 0
    stats = policy_update(model, torch.optim.SGD(model.parameters(), lr=0.1), s, micro_tokens=40)
    assert stats["optimizer_steps"] == 1.0
    from dora_rl.consumers.trainer.grpo import ppo_clip_loss, sequence_logprobs
    adv = compute_advantages(s)
    assert float(adv[:4].abs().sum()) == 0.0
    new, mask = sequence_logprobs(twin, [x.prompt_ids for x in s], [x.response_ids for x in s],
                                  share_prompts=False)
    beh = torch.zeros_like(new)
    for row, x in enumerate(s):
        beh[row, : len(x.behaviour_logprobs)] = torch.tensor(x.behaviour_logprobs)
    opt = torch.optim.SGD(twin.parameters(), lr=0.1)
    loss, _ = ppo_clip_loss(new, beh, adv, mask)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(twin.parameters(), 1.0)
    opt.step()
    for (n1, p1), (_, p2) in zip(model.named_parameters(), twin.named_parameters(), strict=True):
        assert torch.allclose(p1, p2, atol=1e-6), n1


def test_decoupled_ppo_clips_against_the_proximal_policy(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Stale behaviour log-probs (here: the current ones - 0.5) put every ratio at e^0.5 > 1 + eps, so
    plain PPO clips the A > 0 tokens; decoupled PPO starts at ratio 1 (proximal = current weights) and
    weighs tokens by exp(proximal - behaviour) = e^0.5. With fresh data both give the same update."""
    from dora_rl.consumers.trainer.grpo import sequence_logprobs

    model, _ = load_policy(build_tiny_model(tmp_path / "m", seed=7))
    base = _samples()
    with torch.no_grad():
        cur, _ = sequence_logprobs(model, [s.prompt_ids for s in base], [s.response_ids for s in base])
    fresh = [Sample(s.prompt_ids, s.response_ids, cur[i, : len(s.response_ids)].tolist(), s.reward, s.group_id)
             for i, s in enumerate(base)]
    stale = [Sample(s.prompt_ids, s.response_ids, [x - 0.5 for x in s.behaviour_logprobs], s.reward, s.group_id)
             for s in fresh]
    twins = [copy.deepcopy(model) for _ in range(4)]
    plain = policy_update(twins[0], torch.optim.SGD(twins[0].parameters(), lr=0.1), stale)
    dec = policy_update(twins[1], torch.optim.SGD(twins[1].parameters(), lr=0.1), stale, decoupled=True)
    assert plain["clip_frac"] > 0.3 and dec["clip_frac"] == 0.0
    assert abs(dec["tis_weight_mean"] - float(np.exp(0.5))) < 1e-4
    policy_update(twins[2], torch.optim.SGD(twins[2].parameters(), lr=0.1), fresh)
    policy_update(twins[3], torch.optim.SGD(twins[3].parameters(), lr=0.1), fresh, decoupled=True)
    for (n1, p1), (_, p2) in zip(twins[2].named_parameters(), twins[3].named_parameters(), strict=True):
        assert torch.allclose(p1, p2, atol=1e-5), n1
