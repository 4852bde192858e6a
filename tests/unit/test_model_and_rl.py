"""Model building/loading, the torch rollout engine, GRPO/PPO math, SFT and the synthetic tasks.

Fast (well under a minute on one thread): one tiny model is built per module.
"""

from __future__ import annotations

import math
import random
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from dora_rl.consumers.trainer.grpo import (
    group_advantages,
    ppo_clip_loss,
    sequence_logprobs,
)
from dora_rl.consumers.trainer.sft import sft_warmup
from dora_rl.core.tasks import ChainsumTask, ReverseTask, get_task
from dora_rl.modeling import (
    build_tiny_model,
    decode_completion,
    encode_prompt,
    load_policy,
    load_weights,
    state_dict_for_transfer,
)
from dora_rl.producers.rollout.engine import GenRequest, GenResult
from dora_rl.producers.rollout.torch_engine import TorchEngine

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory):
    path = build_tiny_model(tmp_path_factory.mktemp("tiny") / "m", "1m", seed=0)
    model, tok = load_policy(path)
    # Sharpen the random init so that next-token distributions are far from uniform.
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3.0)
    return path, model, tok


def _requests(tok, prompts: list[str], max_new: int, copies: int = 1) -> list[GenRequest]:
    return [GenRequest(request_id=f"r{i}-{c}", prompt_ids=encode_prompt(tok, p), max_new_tokens=max_new)
            for i, p in enumerate(prompts) for c in range(copies)]


def _engine_vs_trainer(model, reqs: list[GenRequest], results: list[GenResult], temperature: float) -> float:
    """Max |engine log-prob - trainer log-prob| over every response token."""
    logp, mask = sequence_logprobs(model, [r.prompt_ids for r in reqs], [r.token_ids for r in results],
                                   temperature=temperature)
    worst = 0.0
    for b, res in enumerate(results):
        n = len(res.token_ids)
        assert mask[b, :n].sum() == n and mask[b, n:].sum() == 0
        diff = (logp[b, :n].detach() - torch.tensor(res.logprobs)).abs().max()
        worst = max(worst, float(diff))
    return worst


PROMPTS = ["abc=", "jihgfedcba=", "a=", "cafebabe=", "ddddddddddddddddddddddddddddd="]


# --- modeling ------------------------------------------------------------------------------------

def test_tiny_model_builds_reloads_and_is_deterministic(tiny, tmp_path: Path) -> None:
    path, _, _tok = tiny
    model, tok2 = load_policy(path)
    cfg = model.config
    assert type(model).__name__ == "LlamaForCausalLM"
    assert cfg.hidden_size // cfg.num_attention_heads >= 32
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 2_000_000
    assert tok2.padding_side == "left" and tok2.pad_token_id == 0 and tok2.eos_token_id == 2
    ids = encode_prompt(tok2, "12+34=46 abc")
    assert ids[0] == tok2.bos_token_id and decode_completion(tok2, [*ids[1:], tok2.eos_token_id, 5]) == "12+34=46 abc"
    # Same seed -> same weights; other seed -> different weights.
    same, _ = load_policy(build_tiny_model(tmp_path / "same", "1m", seed=0))
    other, _ = load_policy(build_tiny_model(tmp_path / "other", "1m", seed=1))
    w, ws, wo = (m.model.layers[0].self_attn.q_proj.weight for m in (model, same, other))
    assert torch.equal(w, ws) and not torch.equal(w, wo)


def test_state_dict_transfer_roundtrip(tiny, tmp_path: Path) -> None:
    _, model, _ = tiny
    sd = state_dict_for_transfer(model)
    assert "lm_head.weight" not in sd and "model.embed_tokens.weight" in sd  # tied: sent once
    other, _ = load_policy(build_tiny_model(tmp_path / "o", "1m", seed=7))
    x = torch.tensor([[1, 14, 15, 16, 44]])
    assert not torch.allclose(other(x).logits, model(x).logits)
    load_weights(other, sd)
    assert torch.equal(other(x).logits, model(x).logits)
    with pytest.raises(KeyError):
        load_weights(other, {**sd, "bogus": torch.zeros(1)})
    with pytest.raises(KeyError):
        load_weights(other, {k: v for k, v in sd.items() if k != "model.norm.weight"})


# --- engine ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_equal_trainer_logprobs(tiny, temperature: float) -> None:
    _, model, tok = tiny
    reqs = _requests(tok, PROMPTS, max_new=20, copies=3)
    # Stop on a frequent token (besides EOS) so that both "stop" and "length" endings occur.
    free = TorchEngine(model, tok, temperature=temperature, eos_id=10**6, seed=3).generate(reqs)
    eos_ids = [tok.eos_token_id, Counter(t for r in free for t in r.token_ids).most_common(1)[0][0]]
    eng = TorchEngine(model, tok, temperature=temperature, eos_id=eos_ids, seed=3)
    chunks: dict[str, list[int]] = {}
    finished: list[str] = []
    results = eng.generate(reqs, on_chunk=lambda rid, t, lp: chunks.setdefault(rid, []).extend(t),
                           chunk_tokens=4, on_finish=lambda r: finished.append(r.request_id))
    assert [r.request_id for r in results] == [q.request_id for q in reqs]
    assert sorted(finished) == sorted(q.request_id for q in reqs)
    reasons = {r.finish_reason for r in results}
    assert reasons == {"stop", "length"}
    for r in results:
        assert chunks[r.request_id] == r.token_ids and len(r.logprobs) == len(r.token_ids)
        assert all(lp <= 0.0 for lp in r.logprobs)
        assert r.first_token_s <= r.finished_s
        if r.finish_reason == "stop":
            assert r.token_ids[-1] in eos_ids and not set(r.token_ids[:-1]) & set(eos_ids)
        else:
            assert len(r.token_ids) == 20 and not set(r.token_ids) & set(eos_ids)
    assert _engine_vs_trainer(model, reqs, results, temperature) < 1e-4


def test_chunked_prefill_matches_single_prefill(tiny) -> None:
    _, model, tok = tiny
    reqs = _requests(tok, PROMPTS, max_new=12, copies=2)
    a = TorchEngine(model, tok, seed=5, prefill_tokens=10**9).generate(reqs)
    b = TorchEngine(model, tok, seed=5, prefill_tokens=8).generate(reqs)  # one prompt per chunk
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert np.allclose(x.logprobs, y.logprobs, atol=1e-5)


def test_resume_from_partial_is_consistent(tiny) -> None:
    _, model, tok = tiny
    eng = TorchEngine(model, tok, temperature=1.0, eos_id=10**6, seed=11)  # never stops: 16 tokens each
    reqs = _requests(tok, PROMPTS, max_new=16)
    full = eng.generate(reqs)
    resumed_reqs = [GenRequest(request_id=q.request_id, prompt_ids=q.prompt_ids, partial_ids=r.token_ids[:k],
                               partial_logprobs=r.logprobs[:k], max_new_tokens=16)
                    for k, (q, r) in zip([0, 1, 5, 9, 15], zip(reqs, full, strict=True), strict=True)]
    new_chunks: dict[str, list[int]] = {}
    resumed = eng.generate(resumed_reqs, on_chunk=lambda rid, t, lp: new_chunks.setdefault(rid, []).extend(t))
    for q, r in zip(resumed_reqs, resumed, strict=True):
        k = len(q.partial_ids)
        assert r.token_ids[:k] == q.partial_ids and r.logprobs[:k] == q.partial_logprobs
        assert len(r.token_ids) == 16 and r.finish_reason == "length"  # the cap counts partial tokens
        assert new_chunks[q.request_id] == r.token_ids[k:]  # only new tokens are streamed
    # The continuation is sampled from the same conditional distribution as an uninterrupted run.
    assert _engine_vs_trainer(model, resumed_reqs, resumed, 1.0) < 1e-4
    # Already-finished partials come straight back.
    done = TorchEngine(model, tok).generate([GenRequest(request_id="x", prompt_ids=[1, 14], partial_ids=[20, 2],
                                    partial_logprobs=[-1.0, -2.0], max_new_tokens=8)])[0]
    assert done.finish_reason == "stop" and done.token_ids == [20, 2] and done.logprobs == [-1.0, -2.0]


def test_abort_and_weight_swap(tiny, tmp_path: Path) -> None:
    _, model, tok = tiny
    eng = TorchEngine(model, tok, eos_id=10**6, seed=1)
    reqs = _requests(tok, PROMPTS[:3], max_new=40)
    eng.abort(["r2-0"])  # aborted before it starts

    def on_chunk(rid: str, toks: list[int], lps: list[float]) -> None:
        if rid == "r0-0":
            eng.abort([rid])  # from the decode thread, after its first chunk

    res = {r.request_id: r for r in eng.generate(reqs, on_chunk=on_chunk, chunk_tokens=4)}
    # Effective at the next decode step: the 4-token chunk plus one more token.
    assert res["r0-0"].finish_reason == "abort" and len(res["r0-0"].token_ids) == 5
    assert res["r1-0"].finish_reason == "length" and len(res["r1-0"].token_ids) == 40
    assert res["r2-0"].finish_reason == "abort" and res["r2-0"].token_ids == []
    # abort(None) stops a running call.
    box: list[list[GenResult]] = []
    started = threading.Event()
    t = threading.Thread(target=lambda: box.append(eng.generate(
        _requests(tok, PROMPTS[:2], max_new=100_000), on_chunk=lambda *a: started.set(), chunk_tokens=1)))
    t.start()
    assert started.wait(30)
    eng.abort()
    t.join(30)
    assert not t.is_alive() and {r.finish_reason for r in box[0]} == {"abort"}
    # New weights: the engine now samples from them, and log-probs follow.
    other, _ = load_policy(build_tiny_model(tmp_path / "w", "1m", seed=9))
    eng.load_state_dict(state_dict_for_transfer(other))
    reqs = _requests(tok, PROMPTS, max_new=8)
    assert _engine_vs_trainer(other, reqs, eng.generate(reqs), 1.0) < 1e-4


# --- GRPO / PPO --------------------------------------------------------------------------------------

def test_group_advantages_known_values() -> None:
    r = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 2.0, 3.0, 1.0])
    g = torch.tensor([7, 7, 7, 7, 1, 1, 4, 9, 9])  # any ids, any order, any sizes
    a = group_advantages(r, g, eps=0.0)
    s = 1.0 / math.sqrt(1.0 / 3.0) * 0.5  # (r - 0.5) / std, std = sqrt(1/3) (Bessel)
    assert torch.allclose(a, torch.tensor([s, -s, s, -s, 0.0, 0.0, 0.0, 1 / math.sqrt(2), -1 / math.sqrt(2)]))
    assert a[4] == 0.0 and a[5] == 0.0 and a[6] == 0.0  # equal rewards / singleton: exactly 0
    a_eps = group_advantages(r, g)  # default eps=1e-4 shrinks slightly
    assert 0 < float(a_eps[0]) < s
    d = group_advantages(r, g, scale=False)
    assert torch.allclose(d, torch.tensor([0.5, -0.5, 0.5, -0.5, 0.0, 0.0, 0.0, 1.0, -1.0]))
    eq = group_advantages(torch.full((4,), 0.1), torch.zeros(4, dtype=torch.long))
    assert torch.equal(eq, torch.zeros(4))


def test_ppo_clip_loss_reinforce_at_ratio_one_and_clipping() -> None:
    torch.manual_seed(0)
    beh = -torch.rand(3, 5)
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 1 + [0.0] * 4])
    adv = torch.tensor([1.5, -0.5, 2.0])
    new = beh.clone().requires_grad_(True)
    loss, st = ppo_clip_loss(new, beh, adv, mask)
    loss.backward()
    ref = beh.clone().requires_grad_(True)
    (-(ref * adv[:, None] * mask).sum() / mask.sum()).backward()  # REINFORCE, token-level mean
    assert new.grad is not None and ref.grad is not None
    assert torch.allclose(new.grad, ref.grad) and abs(loss.item() - float(-(adv[:, None] * mask).sum() / 9)) < 1e-6
    assert st["clip_frac"] == 0.0 and st["ratio_mean"] == pytest.approx(1.0) and st["approx_kl"] == pytest.approx(0)

    one = torch.ones(1, 1)
    cases = [  # (ratio, advantage, expected loss, gradient zero?)
        (1.5, 1.0, -1.2, True),    # A > 0, ratio above 1 + eps: clipped
        (1.5, -1.0, 1.5, False),   # A < 0, ratio above: pessimistic unclipped term, gradient flows
        (0.5, -1.0, 0.8, True),    # A < 0, ratio below 1 - eps: clipped
        (0.5, 1.0, -0.5, False),   # A > 0, ratio below: unclipped
    ]
    for ratio, a, want, zero_grad in cases:
        b = torch.full((1, 1), -1.0)
        n = (b + math.log(ratio)).requires_grad_(True)
        loss, st = ppo_clip_loss(n, b, torch.tensor([a]), one, clip_eps=0.2)
        loss.backward()
        assert n.grad is not None
        assert loss.item() == pytest.approx(want, abs=1e-6)
        assert (float(n.grad.abs().sum()) == 0.0) == zero_grad
        assert st["clip_frac"] == (1.0 if zero_grad else 0.0)
        assert st["approx_kl"] == pytest.approx(-math.log(ratio), abs=1e-6)
    # Decoupled PPO + truncated IS: w = min(pi_prox / pi_behaviour, cap), and the clip trusts pi_prox.
    b, prox = torch.full((1, 2), -2.0), torch.full((1, 2), -1.0)  # pi_prox / pi_b = e
    n = prox.clone().requires_grad_(True)
    loss, st = ppo_clip_loss(n, b, torch.tensor([1.0]), torch.ones(1, 2), tis_cap=2.0, proximal_logp=prox)
    assert loss.item() == pytest.approx(-2.0) and st["tis_weight_mean"] == pytest.approx(2.0)
    # num_tokens: the normaliser of a micro-batch is the whole batch's token count.
    loss_n, _ = ppo_clip_loss(beh, beh, adv, mask, num_tokens=18.0)
    assert float(loss_n) == pytest.approx(float(-(adv[:, None] * mask).sum() / 18))


def test_sequence_logprobs_padding_invariant(tiny) -> None:
    _, model, _ = tiny
    p1, r1 = [1, 14, 15, 44], [20, 21, 2]
    alone, m1 = sequence_logprobs(model, [p1], [r1])
    batch, mb = sequence_logprobs(model, [p1, [1] + [30] * 25 + [44]], [r1, [22] * 9])
    assert m1.sum() == 3 and mb[0].sum() == 3 and mb[1].sum() == 9
    assert torch.allclose(alone[0, :3], batch[0, :3], atol=1e-5)


def test_shared_prompt_logprobs_equal_the_plain_path_with_gradients(tiny) -> None:
    """A GRPO group's samples share one prompt forward (KV cache rows repeated): same log-probs and
    the same gradients as running every row on its own."""
    path, _, _ = tiny
    rng = random.Random(0)
    prompts, responses = [], []
    for _ in range(5):
        p = [1, *rng.choices(range(4, 14), k=rng.randint(2, 20)), 44]
        for _ in range(3):
            prompts.append(p)
            responses.append([*rng.choices(range(4, 14), k=rng.randint(0, 15)), 2])
    grads = []
    for share in (False, True):
        model, _ = load_policy(path)
        lp, mask = sequence_logprobs(model, prompts, responses, share_prompts=share)
        (lp * torch.linspace(0.5, 1.5, lp.shape[1])).sum().backward()
        grads.append((lp.detach(), mask, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (lp0, m0, g0), (lp1, m1, g1) = grads
    assert torch.equal(m0, m1)
    assert torch.allclose(lp0, lp1, atol=1e-5)
    for n in g0:
        assert torch.allclose(g0[n], g1[n], atol=1e-5, rtol=1e-4), n


def test_sft_warmup_learns(tiny) -> None:
    path, _, _ = tiny
    model, tok = load_policy(path)
    losses = sft_warmup(model, tok, get_task("reverse"), steps=20, batch_size=16, lr=3e-3,
                        max_answer_chars=8, seed=0)
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.3


# --- tasks ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("name,ratio", [("reverse", 10.0), ("chainsum", 6.0)])
def test_task_lengths_long_tailed_and_reward_bounds(name: str, ratio: float) -> None:
    task = get_task(name)
    rng = random.Random(0)
    samples = [task.sample(rng) for _ in range(5000)]
    lens = np.array([len(s.reference) for s in samples])
    p50, p99 = np.percentile(lens, [50, 99])
    assert p99 / p50 >= ratio, (p50, p99)
    assert all(task.reward(s.reference, s.reference) == 1.0 for s in samples)
    junk = random.Random(1)
    for s in samples[:500]:
        guess = "".join(junk.choice("abcdefghij0123456789#,") for _ in range(junk.randint(0, 40)))
        assert 0.0 <= task.reward(s.reference, guess) <= 1.0
    again = [task.sample(random.Random(0)) for _ in range(3)]
    assert again[0] == samples[0]


def test_reward_values() -> None:
    rev = ReverseTask()
    assert rev.sample(random.Random(3)).prompt.endswith("=")
    assert rev.reward("abcd", "abce") == pytest.approx(0.375)   # 0.5 * 3/4
    assert rev.reward("abcd", "abcdab") == pytest.approx(0.5 * 4 / 6)
    assert rev.reward("abcd", "abcdabc") == 0.0                 # length off by > 50 %
    assert rev.reward("abcd", "") == 0.0
    cs = ChainsumTask()
    s = cs.sample(random.Random(0))
    terms = [int(t) for t in s.prompt[:-1].split("+")]
    assert s.reference.endswith(f"#{sum(terms) % 10}")
    assert cs.reward("33,92,79,43#3", "12#3") == 1.0 and cs.reward("33,92,79,43#3", "33,92,79,43#4") == 0.0
    assert cs.reward("33,92,79,43#3", "33,92,79,43") == 0.0
