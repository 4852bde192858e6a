"""The emulated engine: long-tailed, group-correlated lengths; calibrated timing; the Engine contract."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dora_rl.core.emulation import (
    EmulatedParams,
    batch_finish_times,
    group_of,
    planned_length,
    planned_response,
    sample_lengths,
    step_time,
    workload_key,
)
from dora_rl.producers.rollout.emulated import EmulatedEngine
from dora_rl.producers.rollout.engine import GenRequest, GenResult

FAST = EmulatedParams(base_step_s=1e-4, prefill_s_per_token=1e-7)


def _req(rid: str, n: int = 512, partial: GenResult | None = None) -> GenRequest:
    if partial is None:
        return GenRequest(request_id=rid, prompt_ids=[5, 6, 7], max_new_tokens=n)
    return GenRequest(request_id=rid, prompt_ids=[5, 6, 7], partial_ids=partial.token_ids,
                      partial_logprobs=partial.logprobs, max_new_tokens=n)


def test_length_distribution_is_long_tailed_with_a_cap_spike() -> None:
    p = EmulatedParams()
    lengths = sample_lengths(4000, p, 512)
    p50, p99 = np.percentile(lengths, [50, 99])
    assert 25 <= p50 <= 65, p50  # median_fraction 0.08 * 512 = 41
    assert p99 / p50 >= 10
    at_cap = float(np.mean(lengths == 512))
    assert 0.015 <= at_cap <= 0.05, at_cap
    assert lengths.min() >= 1 and lengths.max() == 512
    # the cap fraction is a knob, not an accident
    more = sample_lengths(4000, EmulatedParams(cap_fraction=0.10), 512)
    assert 0.08 <= float(np.mean(more == 512)) <= 0.12
    # the finish reason follows the length
    for i in range(200):
        n, reason = planned_length(f"g{i}/0", 512, p)
        assert (reason == "length") == (n == 512)


def _between_group_share(p: EmulatedParams, groups: int = 400, size: int = 8) -> float:
    logl = np.log(sample_lengths(groups * size, p, 4096, group_size=size)).reshape(groups, size)
    return float(np.var(logl.mean(axis=1)) / np.var(logl))


def test_lengths_are_correlated_within_a_group() -> None:
    correlated = _between_group_share(EmulatedParams(group_correlation=0.5))
    independent = _between_group_share(EmulatedParams(group_correlation=0.0))
    # expected shares: 0.5 + 0.5/8 = 0.56 vs 1/8 = 0.125
    assert correlated > 0.4, correlated
    assert independent < 0.2, independent
    assert group_of("run/p7/3") == "run/p7" and group_of("solo") == "solo"


def test_outputs_are_deterministic_in_the_seed() -> None:
    a = planned_response("g1/0", 512, EmulatedParams(seed=1))
    assert a == planned_response("g1/0", 512, EmulatedParams(seed=1))
    assert a != planned_response("g1/0", 512, EmulatedParams(seed=2))
    ids, lps, reason = a
    assert all(3 <= t < 32000 for t in ids[:-1]) and 2 not in ids[:-1]
    assert all(-3 <= lp < 0 for lp in lps)
    assert (ids[-1] == 2) == (reason == "stop")
    reqs = [_req(f"g{i // 4}/{i % 4}", 128) for i in range(8)]
    r1 = EmulatedEngine(FAST).generate(reqs)
    r2 = EmulatedEngine(FAST).generate(reqs)
    assert [(r.token_ids, r.logprobs, r.finish_reason) for r in r1] == \
        [(r.token_ids, r.logprobs, r.finish_reason) for r in r2]


def test_a_runs_prompt_draws_the_same_response_whatever_the_run_id() -> None:
    """Two runs with one seed (two modes of a benchmark) see one workload: prompt ``i`` sample ``k`` of any run."""
    p = EmulatedParams(seed=3)
    assert workload_key("20261129-070215-b7fb/p12/3") == "p12/3" and workload_key("g1/0") == "g1/0"
    one = [planned_response(f"20261129-070215-b7fb/p{i}/{k}", 256, p) for i in range(20) for k in range(4)]
    other = [planned_response(f"20261129-064508-d04d/p{i}/{k}", 256, p) for i in range(20) for k in range(4)]
    assert one == other
    assert len({len(ids) for ids, _, _ in one}) > 10  # the prompt and sample index still draw the length
    assert planned_length("r1/p0/0", 256, p) != planned_length("r1/p0/0", 256, EmulatedParams(seed=4))


def test_step_time_is_flat_up_to_capacity_then_linear() -> None:
    p = EmulatedParams(base_step_s=0.02, capacity=64)
    assert step_time(0, 64, p) == 0.0
    assert step_time(1, 64, p) == step_time(64, 64, p) == pytest.approx(0.02)
    assert step_time(128, 64, p) == pytest.approx(0.04)
    assert step_time(96, 64, p) == pytest.approx(0.03)
    assert step_time(64, 32, p) == pytest.approx(0.04)  # the capacity argument wins
    smooth = EmulatedParams(base_step_s=0.02, capacity=64, alpha=0.5)
    assert step_time(32, 64, smooth) == pytest.approx(0.025)
    assert step_time(64, 64, smooth) == pytest.approx(0.03)
    assert step_time(128, 64, smooth) == pytest.approx(0.06)
    # batch timeline: prefill 10 tokens, then 2 active for 3 steps, 1 active for 2 more
    q = EmulatedParams(base_step_s=1.0, capacity=1, prefill_s_per_token=0.1)
    assert batch_finish_times([3, 5, 0], 10, q) == pytest.approx([1.0 + 6.0, 1.0 + 6.0 + 2.0, 0.0])


def test_engine_time_follows_the_model_and_finishes_in_completion_order() -> None:
    p = EmulatedParams(base_step_s=2e-3, capacity=4, prefill_s_per_token=1e-4, median_fraction=0.1)
    reqs = [_req(f"g{i}/0", 96) for i in range(8)]
    lengths = [planned_length(r.request_id, 96, p)[0] for r in reqs]
    assert len(set(lengths)) > 3
    eng = EmulatedEngine(p)
    order: list[str] = []
    t0 = time.monotonic()
    results = eng.generate(reqs, on_finish=lambda r: order.append(r.request_id))
    wall = time.monotonic() - t0
    expected = batch_finish_times(lengths, sum(len(r.prompt_ids) for r in reqs), p)
    assert eng.model_time_s == pytest.approx(max(expected))
    assert max(expected) * 0.95 <= wall <= max(expected) + 0.3, (wall, max(expected))
    assert order == [reqs[i].request_id for i in sorted(range(8), key=lambda i: (lengths[i], i))]
    assert [len(r.token_ids) for r in results] == lengths
    fin = {r.request_id: r.finished_s for r in results}
    assert [fin[rid] for rid in order] == sorted(fin[rid] for rid in order)
    assert all(r.first_token_s <= r.finished_s for r in results)


def test_chunks_concatenate_to_the_full_response() -> None:
    reqs = [_req(f"g{i}/{i}", 200) for i in range(6)]
    chunks: dict[str, list[list[int]]] = {r.request_id: [] for r in reqs}
    lps: dict[str, list[float]] = {r.request_id: [] for r in reqs}

    def on_chunk(rid: str, ids: list[int], lp: list[float]) -> None:
        chunks[rid].append(list(ids))
        lps[rid].extend(lp)

    results = EmulatedEngine(FAST).generate(reqs, on_chunk=on_chunk, chunk_tokens=7)
    for r in results:
        assert [t for c in chunks[r.request_id] for t in c] == r.token_ids
        assert lps[r.request_id] == r.logprobs
        assert all(len(c) == 7 for c in chunks[r.request_id][:-1])
        assert 1 <= len(chunks[r.request_id][-1]) <= 7
        assert r.finish_reason == ("stop" if r.token_ids[-1] == 2 else "length")
        assert r.finish_reason != "length" or len(r.token_ids) == 200


def _long_request_id(p: EmulatedParams, n: int, at_least: int) -> str:
    return next(f"g{i}/0" for i in range(1000) if planned_length(f"g{i}/0", n, p)[0] >= at_least)


def test_abort_returns_partial_tokens_and_resume_is_exact() -> None:
    rid = _long_request_id(FAST, 512, 100)
    full = EmulatedEngine(FAST).generate([_req(rid)])[0]
    eng = EmulatedEngine(FAST)

    def on_chunk(r: str, ids: list[int], lp: list[float]) -> None:
        eng.abort([r])  # from inside the decode loop: finishes after this chunk

    part = eng.generate([_req(rid), _req("other/0", 8)], on_chunk=on_chunk, chunk_tokens=16)[0]
    assert part.finish_reason == "abort"
    assert part.token_ids == full.token_ids[:16] and part.logprobs == full.logprobs[:16]
    got: list[int] = []
    resumed = EmulatedEngine(FAST).generate([_req(rid, partial=part)],
                                            on_chunk=lambda r, ids, lp: got.extend(ids))[0]
    assert resumed.token_ids == full.token_ids and resumed.logprobs == full.logprobs
    assert resumed.finish_reason == full.finish_reason
    assert got == full.token_ids[16:]  # only the new tokens are streamed


def test_abort_from_another_thread_is_prompt() -> None:
    p = EmulatedParams(base_step_s=5e-3)
    rid = _long_request_id(p, 4096, 400)  # >= 2 s uninterrupted
    eng = EmulatedEngine(p)
    out: list[GenResult] = []
    streamed: list[int] = []
    decoding = threading.Event()

    def on_chunk(_rid: str, ids: list[int], _lp: list[float]) -> None:
        streamed.extend(ids)
        if len(streamed) >= 10:
            decoding.set()

    th = threading.Thread(target=lambda: out.extend(eng.generate([_req(rid, 4096)], on_chunk=on_chunk,
                                                                 chunk_tokens=1)))
    th.start()
    # abort once it is decoding (an event, not a sleep: a loaded machine may start the thread late)
    assert decoding.wait(30), "the decode never started"
    t_abort = time.monotonic()
    eng.abort()
    th.join(5)
    assert time.monotonic() - t_abort < 0.5  # prompt: far under the >= 2 s left of the response
    assert out[0].finish_reason == "abort"
    assert 10 <= len(out[0].token_ids) < 400  # what was decoded before the abort is kept, no more
    assert out[0].token_ids[:len(streamed)] == streamed[:len(out[0].token_ids)]
    assert out[0].token_ids == planned_response(rid, 4096, p)[0][:len(out[0].token_ids)]


def test_edge_requests_finish_at_admission() -> None:
    eng = EmulatedEngine(FAST)
    eng.abort(["pre/0"])  # aborted before its generate starts
    done = GenRequest(request_id="eos/0", prompt_ids=[4], partial_ids=[9, 2], partial_logprobs=[-1.0, -0.5],
                      max_new_tokens=8)
    full = GenRequest(request_id="cap/0", prompt_ids=[4], partial_ids=[9, 9], partial_logprobs=[-1.0, -1.0],
                      max_new_tokens=2)
    res = eng.generate([_req("pre/0"), done, full])
    assert [r.finish_reason for r in res] == ["abort", "stop", "length"]
    assert res[0].token_ids == [] and res[1].token_ids == [9, 2]
    assert eng.generate([_req("pre/0", 4)])[0].finish_reason != "abort"  # the abort was consumed


def test_params_from_dict_and_load() -> None:
    p = EmulatedParams.from_dict({"capacity": 8, "load_s": 0.05, "time_scale": 0.5})
    assert p.capacity == 8
    with pytest.raises(ValueError, match="unknown EmulatedParams keys"):
        EmulatedParams.from_dict({"capcity": 8})
    with pytest.raises(ValueError, match="cap_fraction"):
        EmulatedParams(cap_fraction=1.5)
    eng = EmulatedEngine(p)
    t0 = time.monotonic()
    eng.load_state_dict({"anything": object()})
    assert 0.02 <= time.monotonic() - t0 < 0.5 and eng.loads == 1
    assert eng.model_time_s == pytest.approx(0.05) and eng.label == "emulated"


def test_a_moved_kv_cache_is_charged_as_bytes_not_a_prefill() -> None:
    """A resume whose partial came from the same version (``kv_moved``) costs ``kv_move_s_per_token`` per
    context token when the engine models KV moves; otherwise (or with no cost set) it is prefilled again.
    The tokens are the same either way."""
    p = EmulatedParams(base_step_s=1e-5, prefill_s_per_token=1e-3, kv_move_s_per_token=1e-6, time_scale=0.0)
    rid = _long_request_id(p, 512, 100)
    part = EmulatedEngine(p).generate([_req(rid)])[0]
    part = GenResult(rid, part.token_ids[:60], part.logprobs[:60], "abort", part.first_token_s, part.finished_s)
    spent = {}
    for moved, params in (("prefill", p), ("kv", p), ("no_cost", EmulatedParams(**{**p.__dict__,
                                                                                    "kv_move_s_per_token": 0.0}))):
        eng = EmulatedEngine(params)
        req = GenRequest(request_id=rid, prompt_ids=[5, 6, 7], partial_ids=part.token_ids,
                         partial_logprobs=part.logprobs, max_new_tokens=512, kv_moved=moved != "prefill")
        out = eng.generate([req])[0]
        spent[moved] = (eng.model_time_s, out.token_ids)
    assert spent["prefill"][1] == spent["kv"][1] == spent["no_cost"][1]
    assert spent["prefill"][0] - spent["kv"][0] == pytest.approx(63 * 1e-3 - 63 * 1e-6, rel=1e-6)
    assert spent["no_cost"][0] == pytest.approx(spent["prefill"][0])


def test_an_exported_request_carries_rows_an_importer_checks_against_its_tokens() -> None:
    """``export`` (decision 0065): a decoding request leaves with stand-in rows (its context's ids); an engine
    that gets them with the resume charges the KV move; rows of another context are prefilled, and counted."""
    from dora_rl.producers.rollout.emulated import stand_in_rows, stand_in_tokens

    p = EmulatedParams(base_step_s=1e-5, prefill_s_per_token=1e-3, kv_move_s_per_token=1e-6, time_scale=0.0)
    rid = _long_request_id(p, 512, 100)
    full = EmulatedEngine(p).generate([_req(rid)])[0]
    eng = EmulatedEngine(p)
    assert eng.exports_kv
    part = eng.generate([_req(rid)], chunk_tokens=16, on_chunk=lambda r, ids, lps: eng.export([r]))[0]
    assert part.finish_reason == "abort" and part.kv is not None and 0 < len(part.token_ids) < len(full.token_ids)
    assert stand_in_tokens(part.kv) == [5, 6, 7, *part.token_ids]
    spent = {}
    for name, rows in (("rows", part.kv), ("foreign", stand_in_rows([5, 6, 7, 1])), ("none", None)):
        eng = EmulatedEngine(p)
        req = GenRequest(request_id=rid, prompt_ids=[5, 6, 7], partial_ids=part.token_ids,
                         partial_logprobs=part.logprobs, max_new_tokens=512, kv=rows)
        out = eng.generate([req])[0]
        assert out.token_ids == full.token_ids  # the same response wherever it continues
        spent[name] = (eng.model_time_s, eng.kv_imports, eng.kv_fallbacks)
    ctx = 3 + len(part.token_ids)
    assert spent["rows"][1:] == (1, 0) and spent["foreign"][1:] == (0, 1) and spent["none"][1:] == (0, 0)
    assert spent["foreign"][0] - spent["rows"][0] == pytest.approx(ctx * (1e-3 - 1e-6), rel=1e-6)
    assert spent["none"][0] == pytest.approx(spent["foreign"][0])  # no rows and not kv_moved: a prefill


def test_a_request_added_while_the_last_one_is_aborted_is_generated_not_dropped() -> None:
    """The race a CI run hung on (2026-11-28): ``add`` admitted a request between the loop taking the incoming
    ones and an abort emptying the call, and the call then ended and cleared it; the worker held it as running,
    nothing generated it, and the run stalled. Here the add lands exactly in that window."""
    eng = EmulatedEngine(FAST)
    rid = _long_request_id(FAST, 512, 100)
    finished: list[str] = []
    original = eng._aborted
    added: list[bool] = []

    def aborted_then_add(epoch0: int) -> tuple[set[str], bool]:
        ids, every = original(epoch0)
        if rid in ids and not added:  # after the swap of incoming requests, before the abort empties the call
            added.append(eng.add([_req("late/0", 8)]))
        return ids, every

    eng._aborted = aborted_then_add  # type: ignore[method-assign]

    def on_chunk(r: str, ids: list[int], lp: list[float]) -> None:
        eng.abort([r])

    results = eng.generate([_req(rid)], on_chunk=on_chunk, chunk_tokens=16,
                           on_finish=lambda res: finished.append(res.request_id))
    assert added == [True]
    assert "late/0" in finished and any(r.request_id == "late/0" and r.finish_reason != "abort" for r in results)
