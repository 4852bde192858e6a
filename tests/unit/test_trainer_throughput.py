"""The trainer's use of the device (``consumers/trainer/throughput.py``, packed micro-batches in ``grpo.py``,
the mismatch statistics of ``update.py``): pure arithmetic and CPU forwards, no broker."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dora_rl.consumers.trainer.grpo import micro_batches, sequence_logprobs
from dora_rl.consumers.trainer.throughput import (
    CPU_MICRO_TOKENS,
    mfu,
    micro_token_budget,
    parameter_count,
    resolved_micro_tokens,
)
from dora_rl.consumers.trainer.update import Sample, policy_update
from dora_rl.modeling import build_tiny_model, load_policy

torch.set_num_threads(1)
GIB = 1024**3
SMOL = dict(hidden=576, intermediate=1536, layers=30, vocab=49152)  # SmolLM2-135M's shape


def test_micro_budget_follows_the_formula_and_the_device() -> None:
    params = 134_515_008
    got = micro_token_budget(80 * GIB, params, bf16=True, **SMOL)
    per_tok = 30 * (8 * 576 + 4 * 1536) * 2 + 49152 * 14
    assert got == int((0.5 * 80 * GIB - params * 16) // per_tok) // 256 * 256
    assert 16_384 <= got <= 65_536  # an H100 holds more than 16x the old fixed 1,024
    assert micro_token_budget(80 * GIB, params, bf16=False, **SMOL) < got  # fp32 activations take twice the room
    assert micro_token_budget(80 * GIB, params, bf16=True, checkpointing=True, **SMOL) > got
    assert micro_token_budget(24 * GIB, params, bf16=True, **SMOL) < got  # a smaller card, a smaller budget
    assert micro_token_budget(1 * GIB, params, bf16=True, **SMOL) == 1024  # clamped at the floor
    assert micro_token_budget(10_000 * GIB, params, bf16=True, **SMOL) == 65_536  # and the ceiling
    assert got % 256 == 0


def test_micro_tokens_resolve_configured_then_cpu(tmp_path: Path) -> None:
    model, _ = load_policy(build_tiny_model(tmp_path / "m", "1m", seed=0))
    assert resolved_micro_tokens(4096, model, bf16=True, checkpointing=False) == 4096
    assert resolved_micro_tokens(0, model, bf16=True, checkpointing=False) == CPU_MICRO_TOKENS
    assert parameter_count(model) == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    assert mfu(6.0, 10.0, 2.0, None) is None
    assert mfu(6.0e6, 1000.0, 2.0, 1e12) == pytest.approx(3e-3)


def test_packed_micro_batches_count_real_tokens() -> None:
    prompts = [[1] * 5, [1] * 5, [1] * 2, [1] * 9]
    responses = [[2] * 3, [2] * 10, [2] * 1, [2] * 1]
    order = [2, 0, 1, 3]
    assert micro_batches(order, prompts, responses, 20, packed=True) == [[2, 0], [1], [3]]  # 3+8=11, +15>20
    assert micro_batches(order, prompts, responses, 20) == [[2, 0], [1], [3]]  # padded: 2*(5+3)=16, 3*15>20
    assert micro_batches(order, prompts, responses, 30, packed=True) == [[2, 0, 1], [3]]  # 26, then 36 > 30
    assert [i for m in micro_batches(order, prompts, responses, 1, packed=True) for i in m] == order  # one row fits


def _samples(model: torch.nn.Module, stale_every: int = 0) -> list[Sample]:
    g = torch.Generator().manual_seed(5)
    out = []
    for k in range(6):
        prompt = [1, *torch.randint(4, 40, (3 + k % 4,), generator=g).tolist()]
        for j in range(4):
            resp = torch.randint(4, 40, (int(torch.randint(1, 20, (1,), generator=g)),), generator=g).tolist()
            with torch.no_grad():
                own, _ = sequence_logprobs(model, [prompt], [resp])
            stale = int(stale_every > 0 and (k * 4 + j) % stale_every == 0)
            out.append(Sample(prompt, resp, (own[0] - 0.01 * stale).tolist(), float((j + k) % 2), f"g{k}", stale))
    return out


@pytest.mark.parametrize("decoupled", [False, True])
def test_packed_loss_and_update_equal_padded(tmp_path: Path, decoupled: bool) -> None:
    path = build_tiny_model(tmp_path / "m", "1m", seed=1)
    model, _ = load_policy(path)
    samples = _samples(model)
    prompts, responses = [s.prompt_ids for s in samples], [s.response_ids for s in samples]
    padded, mask_a = sequence_logprobs(model, prompts, responses, share_prompts=False)
    packed, mask_b = sequence_logprobs(model, prompts, responses, packed=True)
    assert torch.equal(mask_a, mask_b)
    assert float((padded - packed).detach().abs().max()) < 1e-5
    moved = {}
    for pack in (False, True):
        m, _ = load_policy(path)
        before = torch.cat([p.detach().flatten().clone() for p in m.parameters()])
        opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
        stats = policy_update(m, opt, samples, minibatches=2, micro_tokens=64, packed=pack, decoupled=decoupled)
        moved[pack] = (torch.cat([p.detach().flatten() for p in m.parameters()]) - before, stats)
    rel = float((moved[True][0] - moved[False][0]).norm() / moved[False][0].norm())
    assert rel < 1e-3, rel
    assert moved[True][1]["loss"] == pytest.approx(moved[False][1]["loss"], abs=1e-5)
    # packed computes no padding: fewer computed tokens per micro-batch budget, the same real tokens
    assert moved[True][1]["computed_tokens"] == moved[False][1]["computed_tokens"]


def test_mismatch_is_measured_on_fresh_tokens_before_any_step(tmp_path: Path) -> None:
    model, _ = load_policy(build_tiny_model(tmp_path / "m", "1m", seed=2))
    samples = _samples(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats = policy_update(model, opt, samples, minibatches=3, seed=0)
    # behaviour log-probs are the model's own (another batch shape): the gap is float rounding only
    assert 0 <= stats["logprob_diff_mean"] <= stats["logprob_diff_max"] < 1e-4
    model2, _ = load_policy(build_tiny_model(tmp_path / "m", "1m", seed=2))
    shifted = [Sample(s.prompt_ids, s.response_ids, list(np.asarray(s.behaviour_logprobs) - 0.5), s.reward,
                      s.group_id) for s in samples]
    stats2 = policy_update(model2, torch.optim.AdamW(model2.parameters(), lr=1e-3), shifted, minibatches=3, seed=0)
    assert stats2["logprob_diff_mean"] == pytest.approx(0.5, abs=1e-4)  # a known gap is reported as it is
    all_stale = [Sample(s.prompt_ids, s.response_ids, s.behaviour_logprobs, s.reward, s.group_id, 1) for s in samples]
    model3, _ = load_policy(build_tiny_model(tmp_path / "m", "1m", seed=2))
    stats3 = policy_update(model3, torch.optim.AdamW(model3.parameters(), lr=1e-3), all_stale, minibatches=3)
    assert "logprob_diff_mean" not in stats3  # stale tokens measure policy drift, not the mismatch


def test_fp32_head_keeps_names_and_ties_and_computes_fp32_logits(tmp_path: Path) -> None:
    from dora_rl.modeling import Fp32Head, keep_lm_head_fp32, state_dict_for_transfer

    path = build_tiny_model(tmp_path / "m", "1m", seed=3)
    plain, _ = load_policy(path, dtype=torch.bfloat16)
    model, _ = load_policy(path, dtype=torch.bfloat16)
    names = list(state_dict_for_transfer(model))
    keep_lm_head_fp32(model)
    assert isinstance(model.get_output_embeddings(), Fp32Head)
    assert list(state_dict_for_transfer(model)) == names  # same names, the tie kept (sent once)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        logits, rounded = model(input_ids=ids).logits, plain(input_ids=ids).logits
    assert logits.dtype == torch.float32 and rounded.dtype == torch.bfloat16
    assert float((logits - rounded.float()).abs().max()) < 0.1  # the same logits, without bf16's rounding
    with pytest.raises(TypeError, match=r"plain nn\.Linear"):
        keep_lm_head_fp32(torch.nn.Linear(2, 2))
