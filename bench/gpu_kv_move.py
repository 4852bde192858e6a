"""The ``kv_move`` section of ``bench/gpu_check.py``: a request moved with its KV cache on the device.

The CPU test (``tests/unit/test_kv_move.py``) holds the move exact in fp32: the same tokens and log-probs
within 1e-5. On a GPU the kernels a batch runs depend on its shape, so a request's logits differ by float
rounding between batch sizes even without a move. This section measures three runs of the same requests on
the tiny 10M model (embeddings scaled by 3, as the CPU test's ``sharp_tiny``), in fp32 and bf16:

- ``reference``: every request decoded in one batch, never moved;
- ``rebatched``: the same requests decoded one batch per request (the rounding a batch shape alone brings);
- ``moved``: three requests exported mid-decode from the reference batch and continued in another engine's
  batch of another size.

Per run against the reference: the fraction of requests whose tokens are identical, and the largest
log-prob gap over the tokens both runs share before their first difference. A move adds nothing of its own
when ``moved`` is no worse than ``rebatched``; the fp32 check asks exactly that.
"""

from __future__ import annotations

import copy
import threading
from typing import Any

import torch
from gpu_sections import Context, tiny

from dora_rl.modeling import encode_prompt
from dora_rl.producers.rollout.engine import GenRequest, GenResult
from dora_rl.producers.rollout.torch_engine import TorchEngine

NEVER = 10**6
SEED = 17
CAP = 48
SMALL_CAP = 24
PROMPTS = ["abc=", "jihgfedcba=", "a=", "cafebabe=", "ddddddddddddd=", "ba=", "xyz=", "qqqq="]
MOVE_AT = {"r1": 5, "r3": 9, "r4": 20}
OTHERS = ["zz=", "qrstuvwxyzq=", "mnop="]


def _req(tok: Any, rid: str, prompt: str, cap: int, res: GenResult | None = None) -> GenRequest:
    return GenRequest(request_id=rid, prompt_ids=encode_prompt(tok, prompt), max_new_tokens=cap,
                      partial_ids=list(res.token_ids) if res else [],
                      partial_logprobs=list(res.logprobs) if res else [], kv=res.kv if res else None)


def _all(tok: Any, cap: int) -> list[GenRequest]:
    return [_req(tok, f"r{i}", p, cap) for i, p in enumerate(PROMPTS)]


def _moved(model: Any, tok: Any, cap: int) -> tuple[dict[str, GenResult], int]:
    """Export ``MOVE_AT`` mid-decode from the full batch; continue them in a second engine's batch."""
    first = TorchEngine(model, tok, eos_id=NEVER, seed=SEED)
    seen: dict[str, int] = {}

    def leave(rid: str, toks: list[int], lps: list[float]) -> None:
        seen[rid] = seen.get(rid, 0) + len(toks)
        if MOVE_AT.get(rid) == seen[rid]:
            first.export([rid])

    out = {r.request_id: r for r in first.generate(_all(tok, cap), on_chunk=leave, chunk_tokens=1)}
    second = TorchEngine(copy.deepcopy(model), tok, eos_id=NEVER, seed=SEED)
    joined = threading.Event()

    def join(rid: str, toks: list[int], lps: list[float]) -> None:
        if not joined.is_set():
            joined.set()
            second.add([_req(tok, r, PROMPTS[int(r[1:])], cap, res=out[r]) for r in MOVE_AT])

    others = [_req(tok, f"o{i}", p, cap + 20) for i, p in enumerate(OTHERS)]
    done = {r.request_id: r for r in second.generate(others, on_chunk=join, chunk_tokens=1)}
    return {rid: done[rid] for rid in MOVE_AT}, second.kv_imports


def _compare(got: dict[str, GenResult], ref: dict[str, GenResult]) -> dict[str, float]:
    same, worst = 0, 0.0
    for rid, res in got.items():
        want = ref[rid]
        same += res.token_ids == want.token_ids
        shared = next((i for i, (a, b) in enumerate(zip(res.token_ids, want.token_ids, strict=True)) if a != b),
                      min(len(res.token_ids), len(want.token_ids)))
        gaps = [abs(a - b) for a, b in zip(res.logprobs[:shared], want.logprobs[:shared], strict=True)]
        worst = max([worst, *gaps])
    return {"same_tokens": same / len(got), "max_logprob_gap": worst}


def _one_dtype(ctx: Context, dtype: torch.dtype) -> dict[str, Any]:
    model, tok, _ = tiny(ctx, "1m" if ctx.small else "10m", dtype=dtype)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(3.0)
    cap = SMALL_CAP if ctx.small else CAP
    ref = {r.request_id: r for r in TorchEngine(model, tok, eos_id=NEVER, seed=SEED).generate(_all(tok, cap))}
    alone = {rid: TorchEngine(model, tok, eos_id=NEVER, seed=SEED).generate(
        [_req(tok, rid, PROMPTS[int(rid[1:])], cap)])[0] for rid in MOVE_AT}
    moved, imports = _moved(model, tok, cap)
    return {"kv_imports": imports, "rebatched": _compare(alone, ref), "moved": _compare(moved, ref)}


def kv_move(ctx: Context) -> dict[str, Any]:
    body = {"fp32": _one_dtype(ctx, torch.float32), "bf16": _one_dtype(ctx, torch.bfloat16)}
    fp32 = body["fp32"]
    ctx.check("kv_move.fp32.imports", fp32["kv_imports"], len(MOVE_AT), fp32["kv_imports"] == len(MOVE_AT))
    ctx.check("kv_move.fp32.same_tokens_vs_rebatched", fp32["moved"]["same_tokens"],
              fp32["rebatched"]["same_tokens"], fp32["moved"]["same_tokens"] >= fp32["rebatched"]["same_tokens"])
    return body
