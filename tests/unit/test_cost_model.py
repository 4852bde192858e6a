"""The emulated cost model (context-dependent decode, quadratic prefill, KV capacity) and the simulator's
closed-form advance, checked against step-by-step arithmetic; and the invariants under KV pressure."""

from __future__ import annotations

import itertools

import pytest

from dora_rl.config import DoraConfig
from dora_rl.core.emulation import (
    EmulatedParams,
    decode_steps_within,
    decode_time,
    kv_admits,
    kv_steps_left,
    prefill_time,
    step_time,
)
from dora_rl.streams.scheduling_events import Tick
from dora_rl.streams.simulator import simulate

P = EmulatedParams(base_step_s=0.02, capacity=8, alpha=0.5, kv_s_per_token=1e-6, time_scale=0.0)


@pytest.mark.parametrize(("n", "ctx"), [(1, 0), (3, 100), (8, 5000), (12, 40_000)])
def test_decode_time_is_the_sum_of_its_steps_and_steps_within_inverts_it(n: int, ctx: int) -> None:
    for k in (0, 1, 2, 17, 500):
        brute = sum(step_time(n, 8, P, ctx + n * j) for j in range(k))
        assert decode_time(k, n, 8, ctx, P) == pytest.approx(brute, rel=1e-9)
    for duration in (0.0, 0.019, 0.5, 3.7, 60.0):
        k = decode_steps_within(duration, n, 8, ctx, P)
        assert decode_time(k, n, 8, ctx, P) <= duration * (1 + 1e-12)
        assert decode_time(k + 1, n, 8, ctx, P) > duration


def test_step_time_grows_with_context_and_prefill_with_its_square() -> None:
    assert step_time(4, 8, P, 10_000) - step_time(4, 8, P, 0) == pytest.approx(0.01)
    q = EmulatedParams(prefill_s_per_token=1e-4, prefill_s_per_token_sq=1e-8)
    assert prefill_time(20_000, q) == pytest.approx(2.0 + 2.0)  # a 20K-token partial pays twice its linear cost
    assert prefill_time(100, q) == pytest.approx(0.01 + 5e-5)


def test_kv_admission_and_overflow() -> None:
    kv = EmulatedParams(kv_capacity_tokens=1000)
    assert kv_admits(0, 0, 5000, kv), "an empty instance runs a request longer than its cache"
    assert kv_admits(800, 3, 190, kv) and not kv_admits(800, 3, 197, kv)
    assert kv_steps_left(900, 4, kv) == 25 and kv_steps_left(999, 4, kv) == 0
    assert kv_steps_left(5000, 1, kv) is None, "one sequence alone never preempts itself"
    assert kv_steps_left(10**9, 4, EmulatedParams()) is None


def _cfg(mode: str, s: int, rbs: int, steps: int = 6) -> DoraConfig:
    return DoraConfig.from_dict({"mode": mode, "max_staleness": s, "steps": steps, "train_batch_size": 32,
                                 "group_size": 4, "rollout_batch_size": rbs, "num_instances": 4,
                                 "instance_concurrency": 16, "max_new_tokens": 512, "engine": "emulated"})


@pytest.mark.parametrize(("mode", "s", "rbs"), [("sync", 0, 32), ("dora", 2, 96), ("partial", 0, 64)])
def test_kv_pressure_preempts_and_recomputes_but_loses_nothing(mode: str, s: int, rbs: int) -> None:
    tight = EmulatedParams(time_scale=0.0, seed=3, kv_s_per_token=2e-7, kv_capacity_tokens=600,
                           prefill_s_per_token_sq=1e-9)
    r = simulate(_cfg(mode, s, rbs), tight, prompt_tokens=40)
    assert r.steps == 6 and r.batch_sizes == [32] * 6 and r.refused == 0
    assert r.lost.preemptions > 0 and r.lost.reprefill_s > 0
    if mode != "partial":
        assert r.mixed_version_trajectories == 0, "a preempted sequence resumes on its own version (C1)"
    roomy = simulate(_cfg(mode, s, rbs), EmulatedParams(time_scale=0.0, seed=3, kv_s_per_token=2e-7,
                                                       prefill_s_per_token_sq=1e-9), prompt_tokens=40)
    assert roomy.lost.preemptions == 0
    assert r.wall_s > roomy.wall_s, "recomputing preempted sequences costs time"


def test_lost_time_adds_up_to_the_instances_wall_time() -> None:
    r = simulate(_cfg("sync", 0, 32), EmulatedParams(time_scale=0.0, seed=1, kv_s_per_token=1e-7))
    parts = r.lost.decode_s + r.lost.prefill_s + r.lost.reprefill_s + r.lost.switch_s + r.lost.idle_s
    assert parts == pytest.approx(4 * r.wall_s, rel=1e-6)
    assert 0 < r.lost.intra_bubble_s < r.lost.decode_s
    assert r.lost.idle_s > 0.2 * 4 * r.wall_s, "sync leaves instances idle while the trainer runs"


def test_the_emulated_engine_spends_the_same_model_time_as_the_cost_model() -> None:
    """The engine (which sleeps these model seconds) and the simulator call the same functions: one
    request alone, then two together, cost prefill + :func:`decode_time` with the context growing."""
    from dora_rl.core.emulation import planned_length
    from dora_rl.producers.rollout.emulated import EmulatedEngine
    from dora_rl.producers.rollout.engine import GenRequest

    p = EmulatedParams(base_step_s=1e-3, capacity=4, kv_s_per_token=1e-5, prefill_s_per_token=1e-4,
                       prefill_s_per_token_sq=1e-7, time_scale=0.0, seed=4)
    one = GenRequest(request_id="g1/0", prompt_ids=[5] * 30, max_new_tokens=200)
    n1, _ = planned_length("g1/0", 200, p)
    eng = EmulatedEngine(p)
    eng.generate([one], chunk_tokens=7)
    assert eng.model_time_s == pytest.approx(prefill_time(30, p) + decode_time(n1, 1, 4, 30, p), rel=1e-9)
    two = [GenRequest(request_id="g7/0", prompt_ids=[5] * 30, max_new_tokens=200),
           GenRequest(request_id="g7/1", prompt_ids=[5] * 50, partial_ids=[7] * 10, partial_logprobs=[-0.1] * 10,
                      max_new_tokens=200)]
    a, b = (planned_length(r.request_id, 200, p)[0] - len(r.partial_ids) for r in two)
    first, last = sorted([(a, 30), (b, 60)])  # (new tokens, context at admission)
    assert 0 < first[0] < last[0]
    expected = (prefill_time(30, p) + prefill_time(60, p) + decode_time(first[0], 2, 4, 90, p)
                + decode_time(last[0] - first[0], 1, 4, last[1] + first[0], p))
    eng = EmulatedEngine(p)
    eng.generate(two, chunk_tokens=5)
    assert eng.model_time_s == pytest.approx(expected, rel=1e-9)


def test_the_emulated_engine_waits_for_kv_room_preempts_and_still_returns_the_same_tokens() -> None:
    from dora_rl.producers.rollout.emulated import EmulatedEngine
    from dora_rl.producers.rollout.engine import GenRequest

    base = dict(base_step_s=1e-3, capacity=8, kv_s_per_token=1e-6, prefill_s_per_token=1e-4, time_scale=0.0,
                seed=2, median_fraction=0.3)
    reqs = [GenRequest(request_id=f"g{i}/0", prompt_ids=[5] * 20, max_new_tokens=120) for i in range(8)]
    roomy = EmulatedEngine(EmulatedParams(**base))
    tight = EmulatedEngine(EmulatedParams(**base, kv_capacity_tokens=150))
    free = {r.request_id: r.token_ids for r in roomy.generate(reqs)}
    got = tight.generate(reqs)
    assert {r.request_id: r.token_ids for r in got} == free, "preempted sequences resume exactly"
    assert tight.preemptions > 0 and roomy.preemptions == 0
    assert tight.model_time_s > roomy.model_time_s


def test_step_overhead_is_the_frozen_one_at_tp4_and_grows_with_tp_and_hop_latency() -> None:
    """``hardware_costs.step_overhead_s``: TP 4 gives the frozen overhead whatever the hop latency (every
    paper-setup figure is unchanged); TP 8 adds the ring all-reduce's extra (bandwidth: 0.25 of the message
    more per all-reduce, 2 per layer; latency: 8 hops more), so it grows with the hop latency."""
    from dora_rl.core.hardware_costs import H800, QWEN25_32B, Efficiencies, rollout_params, step_overhead_s

    eff = Efficiencies()
    for hop in (0.0, 2e-6):
        assert step_overhead_s(H800, QWEN25_32B, eff, 4, 256, hop) == eff.step_overhead_s
    message = 256 * QWEN25_32B.hidden * 2
    extra_bw = 2 * QWEN25_32B.layers * (2 * 7 / 8 - 2 * 3 / 4) * message / H800.nvlink_bw
    assert step_overhead_s(H800, QWEN25_32B, eff, 8, 256, 0.0) == pytest.approx(eff.step_overhead_s + extra_bw)
    assert step_overhead_s(H800, QWEN25_32B, eff, 8, 256, 2e-6) == pytest.approx(
        eff.step_overhead_s + extra_bw + 2 * QWEN25_32B.layers * 8 * 2e-6)
    p4 = rollout_params(H800, QWEN25_32B, eff, 4, 256)
    assert p4 == rollout_params(H800, QWEN25_32B, eff, 4, 256, hop_latency_s=5e-6)
    # TP 8: half the weight read per GPU, so a faster step and more KV room per instance than TP 4
    p8 = rollout_params(H800, QWEN25_32B, eff, 8, 256)
    assert p8.base_step_s < p4.base_step_s and p8.kv_capacity_tokens > 2 * p4.kv_capacity_tokens


def test_colocated_instances_pause_while_the_trainer_holds_their_gpus() -> None:
    """Kimi-style partial: generation stops for every training step, so each instance is idle at least the
    trainer's busy time; disaggregated, the same run decodes through training and ends sooner."""
    p = EmulatedParams(time_scale=0.0, seed=2, kv_s_per_token=1e-7)
    apart = simulate(_cfg("partial", 2, 64), p, train_s_fixed=2.0)
    together = simulate(_cfg("partial", 2, 64), p, train_s_fixed=2.0, colocated=True)
    for r in (apart, together):
        assert r.steps == 6 and r.batch_sizes == [32] * 6 and r.refused == 0
    assert together.lost.idle_s >= 4 * together.trainer_busy_s * (1 - 1e-9)
    assert apart.lost.idle_s < 4 * apart.trainer_busy_s, "disaggregated, instances decode while it trains"
    assert together.wall_s > apart.wall_s


def test_colocated_pause_frees_the_kv_cache_so_work_in_flight_is_prefilled_again() -> None:
    """The trainer needs the GPUs' memory: at each colocated step the instances' sequences lose their KV and
    resume with a re-prefill of their context (``colocated_keeps_kv`` keeps it, an upper bound); nothing is
    lost either way."""
    p = EmulatedParams(time_scale=0.0, seed=2, kv_s_per_token=1e-7, prefill_s_per_token=1e-4)
    runs = {keep: simulate(_cfg("partial", 2, 64), p, train_s_fixed=2.0, colocated=True, colocated_keeps_kv=keep)
            for keep in (True, False)}
    for r in runs.values():
        assert r.steps == 6 and r.batch_sizes == [32] * 6 and r.refused == 0
    assert runs[False].lost.reprefill_s > runs[True].lost.reprefill_s
    assert runs[False].lost.preemptions == runs[True].lost.preemptions, "a pause is not a KV-overflow preemption"


def test_the_rules_run_on_a_timer_as_the_orchestrators_punctuate_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A timed rule (a re-partition every ``repartition_s``) must fire in an idle gap, such as every instance
    having finished its work while a long step trains: the rules tick at least every ``tick_s``."""
    import dora_rl.streams.simulator as simulator

    ticks: list[float] = []
    real = simulator.make_scheduler

    def recording(config: DoraConfig):  # type: ignore[no-untyped-def]
        sched = real(config)
        handle = sched.handle
        monkeypatch.setattr(sched, "handle", lambda e: (isinstance(e, Tick) and ticks.append(e.now), handle(e))[1])
        return sched

    monkeypatch.setattr(simulator, "make_scheduler", recording)
    p = EmulatedParams(time_scale=0.0, seed=1, kv_s_per_token=1e-7)
    r = simulate(_cfg("dora", 2, 64), p, train_s_fixed=50.0, tick_s=0.5)
    assert r.steps == 6
    gaps = [b - a for a, b in itertools.pairwise(ticks)]
    assert ticks[-1] >= r.wall_s - 0.5 and max(gaps) <= 0.5 + 1e-9


def test_a_run_where_nothing_can_happen_is_an_error_not_a_silent_spin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rules that never dispatch: only the timer ticks, and the run stops with an error naming the stall."""
    import dora_rl.streams.simulator as simulator

    real = simulator.make_scheduler

    def idle(config: DoraConfig):  # type: ignore[no-untyped-def]
        sched = real(config)
        monkeypatch.setattr(sched, "_dispatch", lambda: [])
        return sched

    monkeypatch.setattr(simulator, "make_scheduler", idle)
    with pytest.raises(RuntimeError, match="stalled"):
        simulate(_cfg("dora", 2, 64), EmulatedParams(time_scale=0.0))


def test_partial_keeping_its_kv_across_versions_pays_moves_not_re_prefills() -> None:
    """``kv_across_versions`` (decision 0073's ceiling): a partial-rollout trajectory moved to the newest version
    is charged as a KV move instead of a re-prefill; the run is otherwise the same (TBS exact, nothing refused)."""
    p = EmulatedParams(time_scale=0.0, seed=1, cap_fraction=0.1, prefill_s_per_token=1e-4, kv_move_s_per_token=1e-6)
    runs = {keep: simulate(_cfg("partial", 2, 64), p, train_s_fixed=2.0, kv_across_versions=keep)
            for keep in (False, True)}
    for r in runs.values():
        assert r.steps == 6 and r.batch_sizes == [32] * 6 and r.refused == 0
        assert r.mixed_version_trajectories > 0, "partial rollout moves work to new weights: the test needs some"
    assert runs[False].lost.reprefill_s > 0 and runs[False].lost.kv_move_s == 0
    assert runs[True].lost.kv_move_s > 0 and runs[True].lost.reprefill_s < runs[False].lost.reprefill_s
