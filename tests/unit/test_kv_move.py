"""Moving a decoding request with its KV cache (issue 30): exported mid-decode by one torch engine,
imported into another engine's running batch of another size, directly and over the weight channel.

The reference is the same requests decoded without a move. Exact means: the same tokens, and
log-probs within 1e-5 (CPU, fp32). Moves are triggered from ``on_chunk`` (the decode thread), so the
step a request leaves at is fixed, never timed.
"""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch
from channel_kinds import KINDS, TOKEN, transport_options

from dora_rl.infra.weights.channel import make_weight_client, make_weight_server
from dora_rl.modeling import encode_prompt
from dora_rl.producers.rollout import kv_rows, sampling
from dora_rl.producers.rollout.engine import GenRequest, GenResult
from dora_rl.producers.rollout.torch_engine import TorchEngine

torch.set_num_threads(1)

NEVER = 10**6  # an EOS id no token has: every row runs to its cap
SEED = 17
CAP = 36
PROMPTS = ["abc=", "jihgfedcba=", "a=", "cafebabe=", "ddddddddddddd=", "ba="]
MOVE_AT = {"r1": 5, "r3": 5, "r4": 12}  # request -> response tokens it has when it leaves
OTHERS = ["zz=", "qrstuvwxyzq="]  # the receiving instance's own requests (a batch of another size)


def _req(tok, rid: str, prompt: str, cap: int = CAP, res: GenResult | None = None) -> GenRequest:
    return GenRequest(request_id=rid, prompt_ids=encode_prompt(tok, prompt), max_new_tokens=cap,
                      partial_ids=list(res.token_ids) if res else [],
                      partial_logprobs=list(res.logprobs) if res else [], kv=res.kv if res else None)


def _requests(tok) -> list[GenRequest]:
    return [_req(tok, f"r{i}", p) for i, p in enumerate(PROMPTS)]


@pytest.fixture(scope="module")
def reference(sharp_tiny) -> dict[str, GenResult]:
    """Every request decoded without a move, in one batch."""
    model, tok = sharp_tiny
    return {r.request_id: r for r in TorchEngine(model, tok, eos_id=NEVER, seed=SEED).generate(_requests(tok))}


@pytest.fixture(scope="module")
def exported(sharp_tiny) -> dict[str, GenResult]:
    """The same requests on a first instance, three of them exported mid-decode (``MOVE_AT``)."""
    model, tok = sharp_tiny
    eng = TorchEngine(model, tok, eos_id=NEVER, seed=SEED)
    seen: dict[str, int] = {}

    def on_chunk(rid: str, toks: list[int], lps: list[float]) -> None:
        seen[rid] = seen.get(rid, 0) + len(toks)
        if MOVE_AT.get(rid) == seen[rid]:
            assert eng.export([rid])

    results = {r.request_id: r for r in eng.generate(_requests(tok), on_chunk=on_chunk, chunk_tokens=1)}
    return {rid: results[rid] for rid in MOVE_AT}


def _continue_elsewhere(model, tok, moved: dict[str, GenResult]) -> tuple[TorchEngine, dict[str, GenResult]]:
    """A second instance (its own copy of the weights) runs ``OTHERS``; the moved requests join its
    batch after its first step."""
    eng = TorchEngine(copy.deepcopy(model), tok, eos_id=NEVER, seed=SEED)
    joined = threading.Event()

    def on_chunk(rid: str, toks: list[int], lps: list[float]) -> None:
        if not joined.is_set():
            joined.set()
            assert eng.add([_resume(tok, rid, res) for rid, res in moved.items()])

    out = eng.generate([_req(tok, f"o{i}", p, cap=CAP + 20) for i, p in enumerate(OTHERS)],
                       on_chunk=on_chunk, chunk_tokens=1)
    return eng, {r.request_id: r for r in out}


def _resume(tok, rid: str, res: GenResult) -> GenRequest:
    return _req(tok, rid, PROMPTS[int(rid[1:])], res=res)


def _assert_exact(results: dict[str, GenResult], reference: dict[str, GenResult]) -> None:
    for rid in MOVE_AT:
        got, want = results[rid], reference[rid]
        assert got.token_ids == want.token_ids, rid
        assert got.finish_reason == "length" and len(got.token_ids) == CAP
        worst = max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs, strict=True))
        assert worst < 1e-5, (rid, worst)


def test_export_leaves_the_batch_with_its_rows_at_the_chosen_step(sharp_tiny, exported, reference) -> None:
    model, tok = sharp_tiny
    layers = model.config.num_hidden_layers
    for rid, at in MOVE_AT.items():
        res = exported[rid]
        assert res.finish_reason == "abort" and len(res.token_ids) == at
        assert res.token_ids == reference[rid].token_ids[:at]  # the first instance sampled the same stream
        assert res.kv is not None and len(res.kv.keys) == layers
        assert res.kv.length == len(encode_prompt(tok, PROMPTS[int(rid[1:])])) + at
        assert kv_rows.unfit(model, res.kv, res.kv.length) is None


def test_moved_requests_continue_exactly_in_a_batch_of_another_size(sharp_tiny, exported, reference) -> None:
    model, tok = sharp_tiny
    eng, results = _continue_elsewhere(model, tok, exported)
    assert eng.kv_imports == len(MOVE_AT) and not eng.kv_fallbacks
    _assert_exact(results, reference)
    # the receiving instance's own requests are unaffected by the newcomers: the same as decoded alone
    alone = TorchEngine(model, tok, eos_id=NEVER, seed=SEED).generate(
        [_req(tok, f"o{i}", p, cap=CAP + 20) for i, p in enumerate(OTHERS)])
    for r in alone:
        assert results[r.request_id].token_ids == r.token_ids


def test_the_import_runs_no_prefill(sharp_tiny, exported) -> None:
    model, tok = sharp_tiny
    eng = TorchEngine(model, tok, eos_id=NEVER, seed=SEED)
    widths: list[int] = []
    handle = model.register_forward_pre_hook(
        lambda mod, args, kwargs: widths.append(kwargs["input_ids"].shape[1]), with_kwargs=True)
    try:
        eng.generate([_resume(tok, rid, res) for rid, res in exported.items()])
    finally:
        handle.remove()
    assert widths and set(widths) == {1}  # decode steps only
    assert eng.kv_imports == len(MOVE_AT)


def test_rows_that_do_not_fit_are_prefilled_and_counted(sharp_tiny, exported, reference) -> None:
    model, tok = sharp_tiny
    eng = TorchEngine(model, tok, eos_id=NEVER, seed=SEED)
    res = exported["r4"]
    assert res.kv is not None
    short = GenResult(res.request_id, res.token_ids[:-1], res.logprobs[:-1], "abort", 0.0, 0.0, res.kv)
    truncated = kv_rows.KvRows(res.kv.keys[:-1], res.kv.values[:-1], res.kv.logits)
    got = {r.request_id: r for r in eng.generate([
        _resume(tok, "r4", short),  # one token fewer than the rows cover
        GenRequest(request_id="r3", prompt_ids=encode_prompt(tok, PROMPTS[3]), max_new_tokens=CAP,
                   partial_ids=exported["r3"].token_ids, partial_logprobs=exported["r3"].logprobs,
                   kv=truncated)])}  # a layer short
    assert eng.kv_imports == 0 and eng.kv_fallbacks == {"length": 1, "layers": 1}
    for rid in ("r3", "r4"):  # a prefill of prompt + partial continues the same stream
        assert got[rid].token_ids == reference[rid].token_ids


@pytest.mark.parametrize("kind", KINDS)
def test_rows_moved_over_the_weight_channel(kind: str, sharp_tiny, exported, reference) -> None:
    model, tok = sharp_tiny
    k, opts = transport_options(kind)
    rows = {rid: res.kv for rid, res in exported.items() if res.kv is not None}
    with make_weight_server(k, TOKEN, **opts) as server:  # type: ignore[arg-type]
        manifest = server.serve(7, kv_rows.to_tensors(rows))
        client = make_weight_client(k, TOKEN, **opts)
        try:
            arrived = kv_rows.from_tensors(client.fetch(manifest, [server.address]))
        finally:
            client.close()
    assert set(arrived) == set(MOVE_AT)
    for rid, kv in arrived.items():  # bit for bit
        assert all(torch.equal(a, b) for a, b in zip(kv.keys + kv.values, rows[rid].keys + rows[rid].values,
                                                    strict=True))
        assert torch.equal(kv.logits, rows[rid].logits)
    moved = {rid: GenResult(rid, exported[rid].token_ids, exported[rid].logprobs, "abort", 0.0, 0.0, arrived[rid])
             for rid in MOVE_AT}
    eng, results = _continue_elsewhere(model, tok, moved)
    assert eng.kv_imports == len(MOVE_AT)
    _assert_exact(results, reference)


def test_from_tensors_refuses_names_and_sets_it_does_not_know() -> None:
    t = torch.zeros(2, 3, 4)
    with pytest.raises(ValueError, match="not a KV-rows tensor name"):
        kv_rows.from_tensors({"model.embed": t})
    with pytest.raises(ValueError, match="without 'v0'"):
        kv_rows.from_tensors({"a|k0": t, "a|logits": torch.zeros(5)})
    with pytest.raises(ValueError, match="without 'logits'"):
        kv_rows.from_tensors({"a|k0": t, "a|v0": t})
    ok = kv_rows.from_tensors({"x|y|k0": t, "x|y|v0": t, "x|y|logits": torch.zeros(5)})
    assert set(ok) == {"x|y"} and ok["x|y"].length == 3


def test_a_stream_draws_from_the_distribution_and_ignores_the_batch() -> None:
    probs = torch.tensor([0.5, 0.25, 0.25, 0.0])
    logp = probs.log().expand(4000, 4)
    toks = sampling.sample(logp, 3, ["q"] * 4000, list(range(4000)))[:, 0]
    counts = torch.bincount(toks, minlength=4).tolist()
    assert counts[3] == 0
    for c, p in zip(counts[:3], probs[:3].tolist(), strict=False):  # within 4 binomial sigmas
        assert abs(c - 4000 * p) < 4 * math.sqrt(4000 * p * (1 - p))
    alone = [int(sampling.sample(logp[:1], 3, ["q"], [i])) for i in range(20)]
    assert alone == toks[:20].tolist()  # a row draws the same token alone or among 4,000
    assert sampling.sample(logp[:1], 4, ["q"], [0]).shape == (1, 1)
    us = {sampling.uniform(3, "q", i) for i in range(1000)}
    assert len(us) == 1000 and all(0.0 < u < 1.0 for u in us)
    assert sampling.uniform(3, "q", 0) != sampling.uniform(3, "r", 0) != sampling.uniform(4, "r", 0)
