"""One policy update: micro-batching by length gives the same gradient as one big batch."""

from __future__ import annotations

import copy

import torch

from dora_rl.consumers.trainer.update import Sample, compute_advantages, length_buckets, policy_update
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


def test_length_buckets_cover_every_row_once_within_budget() -> None:
    s = _samples()
    buckets = length_buckets(s, list(range(len(s))), micro_tokens=100)
    flat = sorted(i for b in buckets for i in b)
    assert flat == list(range(len(s)))
    for b in buckets:
        width = max(len(s[i].prompt_ids) + len(s[i].response_ids) for i in b)
        assert width * len(b) <= 100 or len(b) == 1


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
