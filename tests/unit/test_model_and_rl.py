"""Model, task, torch engine and loss: behaviour log-probs are exactly what the trainer recomputes."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from dora_rl.consumers.trainer.grpo import group_advantages, ppo_clip_loss, sequence_logprobs
from dora_rl.modeling import build_tiny_model, decode_completion, encode_prompt, load_policy
from dora_rl.producers.rollout.engine import GenRequest
from dora_rl.producers.rollout.torch_engine import TorchEngine
from dora_rl.producers.tasks import get_task


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, object]:
    torch.set_num_threads(1)
    path = build_tiny_model(tmp_path_factory.mktemp("m") / "tiny", seed=0)
    return load_policy(Path(path))


def test_tiny_model_reloads_from_disk(tiny: tuple[object, object], tmp_path: Path) -> None:
    model, tok = tiny
    assert sum(p.numel() for p in model.parameters()) > 1_000_000  # type: ignore[attr-defined]
    ids = encode_prompt(tok, "abc=")
    assert decode_completion(tok, [*tok.encode("cba", add_special_tokens=False), tok.eos_token_id]) == "cba"  # type: ignore[attr-defined]
    assert ids[0] == tok.bos_token_id  # type: ignore[attr-defined]


def test_engine_logprobs_equal_the_trainers(tiny: tuple[object, object]) -> None:
    model, tok = tiny
    engine = TorchEngine(model, tok, temperature=1.0, seed=1)  # type: ignore[arg-type]
    prompts = ["abcdefghij=", "a=", "jihgf="]
    reqs = [GenRequest(request_id=f"r{i}", prompt_ids=encode_prompt(tok, p), max_new_tokens=20)
            for i, p in enumerate(prompts)]
    chunks: dict[str, list[int]] = {}
    res = engine.generate(reqs, on_chunk=lambda rid, ids, lps: chunks.setdefault(rid, []).extend(ids), chunk_tokens=3)
    for req, r in zip(reqs, res, strict=True):
        assert chunks[req.request_id] == r.token_ids
        logp, mask = sequence_logprobs(model, [req.prompt_ids], [r.token_ids])  # type: ignore[arg-type]
        n = int(mask.sum())
        assert n == len(r.token_ids)
        assert torch.allclose(logp[0, :n], torch.tensor(r.logprobs), atol=1e-4)


def test_resume_from_partial_tokens_is_a_valid_continuation(tiny: tuple[object, object]) -> None:
    model, tok = tiny
    engine = TorchEngine(model, tok, temperature=1.0, seed=2)  # type: ignore[arg-type]
    prompt = encode_prompt(tok, "abcabcabc=")
    first = engine.generate([GenRequest(request_id="x", prompt_ids=prompt, max_new_tokens=16)])[0]
    k = max(1, len(first.token_ids) // 2)
    resumed = engine.generate([GenRequest(request_id="y", prompt_ids=prompt, partial_ids=first.token_ids[:k],
                                          partial_logprobs=first.logprobs[:k], max_new_tokens=16)])[0]
    assert resumed.token_ids[:k] == first.token_ids[:k] and resumed.logprobs[:k] == first.logprobs[:k]
    assert len(resumed.token_ids) <= 16
    logp, mask = sequence_logprobs(model, [prompt], [resumed.token_ids])  # type: ignore[arg-type]
    assert torch.allclose(logp[0, : int(mask.sum())], torch.tensor(resumed.logprobs), atol=1e-4)


def test_group_advantages() -> None:
    adv = group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5, 0.2]), torch.tensor([0, 0, 1, 1, 2]))
    assert adv[0] > 0 > adv[1] and abs(float(adv[0] + adv[1])) < 1e-6
    assert float(adv[2]) == float(adv[3]) == 0.0  # equal rewards: no signal
    assert float(adv[4]) == 0.0  # a group of one


def test_ppo_clip_loss_clips_and_matches_reinforce_at_ratio_one() -> None:
    new = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    beh = torch.tensor([[-1.0, -2.0]])
    mask = torch.ones(1, 2)
    loss, stats = ppo_clip_loss(new, beh, torch.tensor([2.0]), mask, clip_eps=0.2)
    loss.backward()
    assert new.grad is not None
    assert torch.allclose(new.grad, torch.tensor([[-1.0, -1.0]]))  # -A / N per token
    assert stats["clip_frac"] == 0.0
    far = torch.tensor([[0.0, -1.0]], requires_grad=True)  # ratio e > 1 + eps with A > 0: clipped
    loss2, stats2 = ppo_clip_loss(far, beh, torch.tensor([2.0]), mask, clip_eps=0.2)
    loss2.backward()
    assert far.grad is not None and float(far.grad.abs().sum()) == 0.0 and stats2["clip_frac"] == 1.0


def test_reverse_task_is_long_tailed_and_scores_exactly() -> None:
    task = get_task("reverse")
    rng = random.Random(0)
    samples = [task.sample(rng) for _ in range(5000)]
    lengths = np.array([len(s.reference) for s in samples])
    assert np.percentile(lengths, 99) / np.percentile(lengths, 50) >= 10
    for s in samples[:50]:
        assert task.reward(s.reference, s.reference) == 1.0
        assert 0.0 <= task.reward(s.reference, s.reference[::-1] + "x") < 1.0
    assert task.reward("abcd", "") == 0.0
