"""Continuous batching in the torch engine: requests added to a running ``generate`` join its batch.

The checks are ordered by callbacks (the decode thread waits on an event inside ``on_chunk``), never
by sleeps; exactness is the trainer's recompute of every returned log-prob, as for static batches.
"""

from __future__ import annotations

import threading

import pytest
import torch

from dora_rl.consumers.trainer.grpo import sequence_logprobs
from dora_rl.modeling import encode_prompt
from dora_rl.producers.rollout import torch_batch as tb
from dora_rl.producers.rollout.engine import GenRequest, GenResult
from dora_rl.producers.rollout.torch_engine import TorchEngine

torch.set_num_threads(1)

PROMPTS = ["abc=", "jihgfedcba=", "a=", "cafebabe=", "ddddddddddddddddddddddddddddd="]


def _req(tok, rid: str, prompt: str, max_new: int, partial: GenResult | None = None, k: int = 0) -> GenRequest:
    return GenRequest(request_id=rid, prompt_ids=encode_prompt(tok, prompt), max_new_tokens=max_new,
                      partial_ids=partial.token_ids[:k] if partial else [],
                      partial_logprobs=partial.logprobs[:k] if partial else [])


def _worst(model, reqs: list[GenRequest], results: list[GenResult]) -> float:
    """Max |engine log-prob - trainer log-prob| over every response token."""
    logp, _ = sequence_logprobs(model, [r.prompt_ids for r in reqs], [r.token_ids for r in results])
    return max(float((logp[b, :len(r.token_ids)].detach() - torch.tensor(r.logprobs)).abs().max())
               for b, r in enumerate(results) if r.token_ids)


class _Recorder:
    """Callbacks that log (kind, request id) in order and run ``hook`` on each chunk (decode thread)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []
        self.chunks: dict[str, list[int]] = {}
        self.hook = lambda rid: None

    def on_chunk(self, rid: str, toks: list[int], lps: list[float]) -> None:
        self.events.append(("chunk", rid))
        self.chunks.setdefault(rid, []).extend(toks)
        self.hook(rid)

    def on_finish(self, res: GenResult) -> None:
        self.events.append(("finish", res.request_id))

    def first(self, kind: str, rid: str) -> int:
        return self.events.index((kind, rid))


def _generate_in_thread(eng: TorchEngine, reqs: list[GenRequest], rec: _Recorder,
                        chunk_tokens: int = 1) -> tuple[threading.Thread, list[list[GenResult]]]:
    box: list[list[GenResult]] = []
    t = threading.Thread(target=lambda: box.append(eng.generate(reqs, on_chunk=rec.on_chunk,
                                                                chunk_tokens=chunk_tokens,
                                                                on_finish=rec.on_finish)))
    t.start()
    return t, box


def test_added_request_starts_before_the_running_rows_finish(sharp_tiny) -> None:
    model, tok = sharp_tiny
    eng = TorchEngine(model, tok, eos_id=10**6, seed=2)  # never stops: every row runs to its cap
    first = [_req(tok, f"r{i}", p, max_new=60) for i, p in enumerate(PROMPTS[:3])]
    # A GRPO group of identical prompts (computed once), one longer than any running row (the running
    # rows get more left padding), one short one that finishes long before the running rows.
    joined = [_req(tok, f"g{c}", PROMPTS[3], max_new=8) for c in range(3)]
    joined += [_req(tok, "long", PROMPTS[4] * 2, max_new=30), _req(tok, "short", PROMPTS[2], max_new=3)]
    rec, started, added = _Recorder(), threading.Event(), threading.Event()

    def hook(rid: str) -> None:  # the decode thread stops after its first chunk until the add is done
        if not started.is_set():
            started.set()
            assert added.wait(30)

    rec.hook = hook
    prefills: list[tuple[int, ...]] = []
    handle = model.register_forward_pre_hook(
        lambda mod, args, kwargs: prefills.append(tuple(kwargs["input_ids"].shape))
        if kwargs["input_ids"].shape[1] > 1 else None, with_kwargs=True)
    try:
        assert not eng.add(joined[:1])  # no call runs: nothing admitted
        t, box = _generate_in_thread(eng, first, rec)
        assert started.wait(30)
        assert eng.add(joined[:3]) and eng.add(joined[3:])  # from another thread, like the rollout worker
        added.set()
        t.join(60)
    finally:
        handle.remove()
    # The first rows' prefill, then one for the five joined at the same step: 3 distinct prompts (the
    # group's computed once), padded to the longest.
    assert prefills[1:] == [(3, len(joined[3].prompt_ids))]
    assert not t.is_alive() and box
    results = box[0]
    assert [r.request_id for r in results] == [r.request_id for r in first + joined]
    res = {r.request_id: r for r in results}
    first_done = min(rec.first("finish", r.request_id) for r in first)
    for q in joined:  # every joined row decodes (and the short ones finish) while the first rows still run
        assert rec.first("chunk", q.request_id) < first_done
        assert res[q.request_id].first_token_s <= min(res[r.request_id].finished_s for r in first)
        assert rec.chunks[q.request_id] == res[q.request_id].token_ids
        assert res[q.request_id].finish_reason == "length"
        assert len(res[q.request_id].token_ids) == q.max_new_tokens
    for rid in ("short", "g0", "g1", "g2"):
        assert rec.first("finish", rid) < first_done
    assert all(len(res[r.request_id].token_ids) == 60 for r in first)
    # Exact: the trainer's recompute of every token, running and joined rows alike.
    assert _worst(model, first + joined, results) < 1e-4
    assert not eng.add(joined[:1])  # the call is over


def test_added_resume_continues_exactly_and_chunks_only_new_tokens(sharp_tiny) -> None:
    model, tok = sharp_tiny
    eng = TorchEngine(model, tok, eos_id=10**6, seed=4)
    alone = eng.generate([_req(tok, "x", PROMPTS[1], max_new=20)])[0]
    rec, started, added = _Recorder(), threading.Event(), threading.Event()

    def hook(rid: str) -> None:
        if rid == "run" and not started.is_set():
            started.set()
            assert added.wait(30)

    rec.hook = hook
    t, box = _generate_in_thread(eng, [_req(tok, "run", PROMPTS[0], max_new=50)], rec, chunk_tokens=4)
    assert started.wait(30)
    resumed = _req(tok, "x", PROMPTS[1], max_new=20, partial=alone, k=7)
    assert eng.add([resumed])
    added.set()
    t.join(60)
    res = {r.request_id: r for r in box[0]}
    x = res["x"]
    assert x.token_ids[:7] == alone.token_ids[:7] and x.logprobs[:7] == alone.logprobs[:7]
    assert len(x.token_ids) == 20 and x.finish_reason == "length"  # the cap counts partial tokens
    assert rec.chunks["x"] == x.token_ids[7:]  # only new tokens are streamed
    assert rec.first("finish", "x") < rec.first("finish", "run")
    assert _worst(model, [_req(tok, "x", PROMPTS[1], 20), _req(tok, "run", PROMPTS[0], 50)],
                  [x, res["run"]]) < 1e-4


def test_abort_of_joined_requests_and_rejoin_under_the_same_id(sharp_tiny) -> None:
    model, tok = sharp_tiny
    eng = TorchEngine(model, tok, eos_id=10**6, seed=6)
    rec = _Recorder()
    step = {"n": 0}

    def hook(rid: str) -> None:  # runs in the decode thread: every add/abort lands at a known step
        if rid != "run":
            return
        step["n"] += 1
        if step["n"] == 1:
            eng.abort(["pre"])  # aborted before it joins: finishes at once, empty
            assert eng.add([_req(tok, "pre", PROMPTS[2], max_new=10), _req(tok, "mid", PROMPTS[3], max_new=40)])
        elif step["n"] == 5:
            eng.abort(["mid"])  # aborted while running: its partial comes back
        elif step["n"] == 8:
            part = partial_of["mid"]
            # The aborted id joins the same running call again (a migration back): it continues.
            assert eng.add([_req(tok, "mid", PROMPTS[3], max_new=40, partial=part, k=len(part.token_ids))])

    partial_of: dict[str, GenResult] = {}

    def on_finish(res: GenResult) -> None:
        rec.on_finish(res)
        if res.finish_reason == "abort":
            partial_of.setdefault(res.request_id, res)

    rec.hook = hook
    results = eng.generate([_req(tok, "run", PROMPTS[0], max_new=30)], on_chunk=rec.on_chunk, chunk_tokens=1,
                           on_finish=on_finish)
    assert [r.request_id for r in results] == ["run", "pre", "mid", "mid"]
    pre, mid_aborted, mid = results[1], results[2], results[3]
    assert pre.finish_reason == "abort" and pre.token_ids == []
    assert mid_aborted.finish_reason == "abort" and 1 <= len(mid_aborted.token_ids) < 40
    assert mid.finish_reason == "length" and len(mid.token_ids) == 40
    assert mid.token_ids[:len(mid_aborted.token_ids)] == mid_aborted.token_ids
    assert _worst(model, [_req(tok, "run", PROMPTS[0], 30), _req(tok, "mid", PROMPTS[3], 40)],
                  [results[0], mid]) < 1e-4
    # abort(None) stops joined requests too.
    rec2, started, added = _Recorder(), threading.Event(), threading.Event()

    def hook2(rid: str) -> None:
        if not started.is_set():
            started.set()
            assert added.wait(30)

    rec2.hook = hook2
    t, box2 = _generate_in_thread(eng, [_req(tok, "a", PROMPTS[0], max_new=100_000)], rec2)
    assert started.wait(30)
    assert eng.add([_req(tok, "b", PROMPTS[1], max_new=100_000)])
    added.set()
    while "b" not in rec2.chunks and t.is_alive():  # b decodes (the decode thread runs until aborted)
        t.join(0.01)
    eng.abort()
    t.join(30)
    assert not t.is_alive() and [(r.request_id, r.finish_reason) for r in box2[0]] == [("a", "abort"), ("b", "abort")]
    assert not eng.add([_req(tok, "c", PROMPTS[1], max_new=5)])


def test_model_without_mergeable_cache_batches_statically(sharp_tiny) -> None:
    model, tok = sharp_tiny
    eng = TorchEngine(model, tok, seed=0)
    assert eng.continuous
    eng.continuous = False  # what a model with sliding-window cache layers gets
    rec, started, answer = _Recorder(), threading.Event(), []

    def hook(rid: str) -> None:
        if not started.is_set():
            started.set()
            answer.append(eng.add([_req(tok, "late", PROMPTS[1], max_new=4)]))

    rec.hook = hook
    res = eng.generate([_req(tok, "r", PROMPTS[0], max_new=6)], on_chunk=rec.on_chunk, chunk_tokens=1)
    assert answer == [False] and [r.request_id for r in res] == ["r"]


def test_batch_rows_reuse_slots_widen_trim_and_compact_as_if_alone(sharp_tiny) -> None:
    """The batch mechanics directly: after every join (into a finished row's slot, appended, wider
    than the batch), trim and compaction, each live row's next-token logits equal a forward over its
    own sequence alone."""
    model, _ = sharp_tiny
    seqs: dict[int, list[int]] = {0: [1, 14, 15, 16, 44], 1: [1, *range(14, 25), 44], 2: [1, 14, 44],
                                  3: [1, 20, 21, 44], 4: [1, 20, 21, 44], 5: [1, *range(14, 40), 44], 6: [1, 30, 44]}

    def check(batch: tb.Batch, live: set[int]) -> None:
        for b, i in enumerate(batch.rows):
            if i in live:
                alone = model(input_ids=torch.tensor([seqs[i]])).logits[0, -1]
                assert (batch.logits[b] - alone).abs().max() < 1e-4, (i, b)

    def step(batch: tb.Batch, live: set[int], n: int = 2) -> None:
        for k in range(n):
            toks = [17 + (i + k) % 9 for i in batch.rows]
            for i, t in zip(batch.rows, toks, strict=True):
                seqs[i] = [*seqs[i], t]
            tb.feed(model, batch, torch.tensor(toks).unsqueeze(1))
            check(batch, live)

    with torch.no_grad():
        batch = tb.prefill(model, [seqs[i] for i in (0, 1, 2)], [0, 1, 2], 0, 8)  # chunked: one row each
        live = {0, 1, 2}
        check(batch, live)
        step(batch, live)
        live.discard(1)  # row 1 finishes; a GRPO pair joins: one takes its slot, one is appended
        new = tb.prefill(model, [seqs[3], seqs[4]], [3, 4], 0, 4096)
        batch = tb.absorb(batch, new, [1])
        assert batch.rows == [0, 3, 2, 4]
        live |= {3, 4}
        check(batch, live)
        step(batch, live)
        live.discard(0)  # the widest rows finish: the leading columns go (no copy)
        width = batch.mask.shape[1]
        tb.trim(batch, [b for b, i in enumerate(batch.rows) if i in live])
        assert batch.mask.shape[1] < width
        step(batch, live)
        batch = tb.absorb(batch, tb.prefill(model, [seqs[5]], [5], 0, 4096), [0])  # wider than the batch
        live.add(5)
        check(batch, live)
        step(batch, live, 3)
        batch = tb.select(batch, [b for b, i in enumerate(batch.rows) if i in {3, 5}])  # compaction
        live = {3, 5}
        batch = tb.absorb(batch, tb.prefill(model, [seqs[6]], [6], 0, 4096), [])
        live.add(6)
        check(batch, live)
        step(batch, live, 40)  # past the buffers' first slack: they grow


def test_refill_on_finish_like_the_worker_is_exact(sharp_tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slot freed by a finished request is refilled at once (the worker's pattern under a capacity):
    joiners take the finished rows' slots; every log-prob still matches the trainer's recompute."""
    model, tok = sharp_tiny
    eng = TorchEngine(model, tok, eos_id=10**6, seed=8)
    reqs = [_req(tok, f"q{i}", PROMPTS[i % len(PROMPTS)] * (1 + i % 3), max_new=4 + 7 * (i % 4)) for i in range(14)]
    queue = list(reqs[6:])
    absorbed: list[int] = []
    real_absorb = tb.absorb

    def spy(batch: tb.Batch, new: tb.Batch, free: list[int]) -> tb.Batch:
        absorbed.append(min(len(free), len(new.rows)))
        return real_absorb(batch, new, free)

    def on_finish(res: GenResult) -> None:
        if queue:
            assert eng.add([queue.pop(0)])

    monkeypatch.setattr("dora_rl.producers.rollout.torch_engine.absorb", spy)
    results = eng.generate(reqs[:6], on_finish=on_finish)
    assert [r.request_id for r in results] == [r.request_id for r in reqs]
    assert all(len(r.token_ids) == q.max_new_tokens for q, r in zip(reqs, results, strict=True))
    assert sum(absorbed) > 0  # some joiners took finished rows' slots
    assert _worst(model, reqs, results) < 1e-4
