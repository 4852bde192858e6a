"""KV-aware admission and consolidation (``streams/kv_room.py``) as pure rules, and the scheduler's use of them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from dora_rl.config import DoraConfig
from dora_rl.core.emulation import EmulatedParams
from dora_rl.streams.dora_policy import DoraScheduler
from dora_rl.streams.dora_rules import dora_scheduler
from dora_rl.streams.kv_room import (
    MIN_SAMPLES,
    LengthMoments,
    consolidated_quotas,
    excess,
    kv_slots,
    straggler_slots,
    urgency,
)
from dora_rl.streams.repartition import keep_order
from dora_rl.streams.scheduling_events import Completed, PromptQueued, Scored, VersionSeen
from dora_rl.streams.simulator import simulate


def test_busy_context_is_the_time_average_of_a_linearly_growing_context() -> None:
    m = LengthMoments()
    for n in range(MIN_SAMPLES):
        m.add(100, 1000 if n % 2 else 3000)
    # E[P] + E[L^2] / (2 E[L]) = 100 + (1e6 + 9e6) / 2 / (2 * 2000)
    assert m.busy_context() == pytest.approx(100 + 5e6 / 4000)


def test_slots_are_the_engine_limit_until_enough_completions_are_seen() -> None:
    m = LengthMoments()
    for _ in range(MIN_SAMPLES - 1):
        m.add(0, 1000)
    assert m.busy_context() is None and kv_slots(100_000, m, 256) == 256
    m.add(0, 1000)
    assert kv_slots(100_000, m, 256) == 200  # 100k / 500
    assert kv_slots(0, m, 256) == 256  # KV size unknown
    assert kv_slots(100, m, 256) == 1  # never 0


def test_old_versions_keep_what_their_work_needs_and_the_newest_the_rest() -> None:
    q = consolidated_quotas({3: 250, 4: 90}, {3: 6, 4: 3, 5: 1}, latest=5, n=10, slots=100)
    assert q == {3: 3, 4: 1, 5: 6} and sum(q.values()) == 10
    # no floor: an old version with nothing in flight keeps nothing
    assert consolidated_quotas({3: 0}, {3: 4, 5: 6}, latest=5, n=10, slots=100) == {5: 10}
    # an old version never grows past what it holds, but keeps one if it holds none (its instances were lost)
    assert consolidated_quotas({3: 900}, {3: 2, 5: 8}, latest=5, n=10, slots=100)[3] == 2
    assert consolidated_quotas({3: 900}, {5: 10}, latest=5, n=10, slots=100)[3] == 1


def test_hysteresis_frees_an_instance_only_when_the_rest_would_stay_below_full() -> None:
    held = {3: 3, 5: 7}
    assert consolidated_quotas({3: 195}, held, 5, 10, 100, hysteresis=0.1)[3] == 3  # 2 x 90 < 195
    assert consolidated_quotas({3: 180}, held, 5, 10, 100, hysteresis=0.1)[3] == 2
    assert consolidated_quotas({3: 195}, held, 5, 10, 100, hysteresis=0.0)[3] == 2


def test_a_version_due_next_step_is_never_packed() -> None:
    assert consolidated_quotas({3: 10, 4: 10}, {3: 4, 4: 4, 5: 2}, 5, 10, 100, due=3) == {3: 4, 4: 1, 5: 5}


def test_a_due_version_gives_up_the_instances_it_left_empty() -> None:
    # 4 held, 2 of them decode its work: it keeps those 2 (not packed onto 1), the empty ones go
    assert consolidated_quotas({3: 10, 4: 10}, {3: 4, 4: 4, 5: 2}, 5, 10, 100, due=3,
                               loaded={3: 2}) == {3: 2, 4: 1, 5: 7}
    # its work all moving (no instance decodes it): it still keeps one
    assert consolidated_quotas({3: 10}, {3: 4, 5: 6}, 5, 10, 100, due=3, loaded={3: 0})[3] == 1


@pytest.mark.parametrize("free_empty", [True, False])
def test_the_scheduler_frees_an_empty_instance_of_the_due_version(free_empty: bool) -> None:
    s: DoraScheduler[str] = dora_scheduler(_cfg(2, 64, consolidate_level=False, consolidate_unpack_due=True,
                                               consolidate_free_empty_due=free_empty))
    for g in range(40):
        s.handle(PromptQueued(f"g{g}", "p"))
    s.handle(VersionSeen(0, 0.0))
    on = {d.trajectory_id: d.instance for d in s.decide().dispatches}
    emptied = min(on.values())
    for t, i in on.items():
        if i == emptied:
            s.handle(Completed(t))
    s.handle(VersionSeen(2, 2.0))  # version 0 is now due at the next step (S = 2); the newest can take work
    version = s.state.instance_version
    assert version[emptied] == (2 if free_empty else 0)
    assert all(version[i] == 0 for i in set(on.values()) - {emptied})  # those decoding it: not packed


def test_the_least_loaded_are_freed_and_levelling_moves_only_a_clear_excess() -> None:
    assert keep_order([1, 2, 3, 4], {1: 5, 2: 50, 3: 5, 4: 20}) == [2, 4, 1, 3]
    assert excess({1: 100, 2: 0, 3: 2, 4: 2}) == {1: 74}  # level 26, high 26 * 1.5 + 4 = 43
    assert excess({1: 30, 2: 20, 3: 25}) == {}
    # an instance left nearly empty while the rest decode: those above the level move down to it
    assert excess({1: 48, 2: 0, 3: 48, 4: 48}) == {1: 12, 3: 12, 4: 12}  # level 36, low 36 * 0.5 - 4 = 14
    assert excess({1: 48, 2: 15, 3: 48, 4: 48}) == {1: 8, 3: 8, 4: 8}  # level 40, low 16
    assert excess({1: 48, 2: 17, 3: 48, 4: 48}) == {}  # level 41, low 16.5: within the band
    assert excess({}) == {}


def test_the_rules_see_completed_token_counts_never_the_engines_lengths() -> None:
    """Admission may use only what the trajectories topic carries: no scheduling module imports the
    emulated engine (where the true lengths are drawn), and slots move only with reported completions."""
    root = Path(__file__).resolve().parents[2] / "streams"
    for name in ("kv_room.py", "dora_policy.py", "repartition.py", "planning.py", "partial_policy.py"):
        tree = ast.parse((root / name).read_text())
        imported = {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        imported |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        assert not any("emulation" in m for m in imported), f"{name} imports the engine's length model"
    cfg = _cfg(2, 96, instance_kv_tokens=4000, consolidate_kv_admission=True)
    s: DoraScheduler[str] = dora_scheduler(cfg)
    s.handle(VersionSeen(0, 0.0))
    s.repartition()
    assert s.slots == cfg.instance_concurrency  # nothing completed yet: the engine's limit
    for g in range(MIN_SAMPLES):
        s.handle(PromptQueued(f"g{g}", "p"))
    tids = [d.trajectory_id for d in s.decide().dispatches]
    for t in tids[:MIN_SAMPLES]:
        s.handle(Completed(t))  # no token counts: nothing learned
    s.repartition()
    assert s.slots == cfg.instance_concurrency
    for t in tids[MIN_SAMPLES:2 * MIN_SAMPLES]:
        s.handle(Completed(t, 16, 184))
    s.repartition()
    assert s.slots == min(cfg.instance_concurrency, int(4000 / (16 + 184 / 2)))


BASE = dict(steps=12, train_batch_size=32, group_size=4, num_instances=4, instance_concurrency=24,
            max_new_tokens=256, engine="emulated", mode="dora", repartition_policy="consolidate")


def _cfg(s: int, rbs: int, **over: object) -> DoraConfig:
    return DoraConfig.from_dict({**BASE, "max_staleness": s, "rollout_batch_size": rbs, **over})


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize(("s", "rbs", "over"), [(1, 64, {}), (2, 96, {"instance_kv_tokens": 1500}),
                                                (2, 96, {"consolidate_level": False}),
                                                (2, 128, {"consolidate_unpack_due": True, "instance_kv_tokens": 900}),
                                (2, 96, {"consolidate_kv_admission": True, "instance_kv_tokens": 900}),
                                (2, 96, {"consolidate_pack_at_cap": False, "instance_kv_tokens": 1500})])
def test_invariants_hold_under_consolidation(s: int, rbs: int, over: dict[str, object], seed: int) -> None:
    params = EmulatedParams(time_scale=0.0, seed=seed, cap_fraction=0.05 + 0.05 * seed, kv_capacity_tokens=3000,
                            kv_move_s_per_token=1e-6)
    r = simulate(_cfg(s, rbs, **over), params, train_s_per_token=1e-4 * (1 + seed))
    assert r.steps == BASE["steps"] and set(r.batch_sizes) == {BASE["train_batch_size"]}  # TBS exact
    assert r.refused == 0 and max(r.staleness) <= s  # nothing over-stale, nothing dropped (C2, C3)
    assert r.mixed_version_trajectories == 0  # C1: moved work resumes under its own version
    assert r.dispatched == BASE["steps"] * BASE["train_batch_size"]


def test_consolidation_moves_work_with_its_kv_and_keeps_c1() -> None:
    moved = kv_s = 0.0
    for seed in range(3):
        params = EmulatedParams(time_scale=0.0, seed=seed, cap_fraction=0.1, kv_capacity_tokens=3000,
                                kv_move_s_per_token=1e-6)
        r = simulate(_cfg(2, 96, instance_kv_tokens=1500, repartition_s=0.05), params, train_s_per_token=2e-4)
        assert r.mixed_version_trajectories == 0 and r.refused == 0
        moved, kv_s = moved + r.migrations, kv_s + r.lost.kv_move_s
    assert moved > 0 and kv_s > 0, "nothing was moved: the test checks no move"


def test_stragglers_are_packed_as_if_each_runs_to_the_cap() -> None:
    m = LengthMoments()
    assert straggler_slots(1_000_000, m, 30_000, 256) == 33  # no prompt seen yet: the cap alone
    for _ in range(4):
        m.add(200, 1000)
    assert straggler_slots(1_830_000, m, 30_000, 256) == 60  # 1.83M / (200 + 30k)
    assert straggler_slots(1_830_000, m, 30_000, 40) == 40  # never more than the slots
    assert straggler_slots(10_000, m, 30_000, 256) == 1  # never 0
    assert straggler_slots(0, m, 30_000, 256) == 256  # KV size unknown: the slots


@pytest.mark.parametrize("at_cap", [True, False])
def test_an_old_version_keeps_the_instances_its_stragglers_need_at_the_cap(at_cap: bool) -> None:
    """64 of version 0's 96 requests still decode when version 1 arrives. Counted at the cap (2,000 KV tokens over
    10 + 100 tokens: 18 a instance) they keep 4 of the 6 instances they hold; counted at the busy context
    (10 + 20 / 2 = 20 tokens: 100 of KV room, so the engine's 24) 3 would do, and they are packed onto 3."""
    cfg = _cfg(2, 96, num_instances=6, instance_kv_tokens=2_000, max_new_tokens=100, consolidate_level=False,
               consolidate_pack_at_cap=at_cap)
    s: DoraScheduler[str] = dora_scheduler(cfg)
    for g in range(40):
        s.handle(PromptQueued(f"g{g}", "p"))
    s.handle(VersionSeen(0, 0.0))
    tids = [d.trajectory_id for d in s.decide().dispatches]
    assert len(tids) == 96 and s.state.instance_version.count(0) == 6
    for t in tids[:MIN_SAMPLES]:
        s.handle(Completed(t, 10, 20))
    s.handle(VersionSeen(1, 1.0))
    assert s.in_flight(0) == 64
    assert s.state.instance_version.count(0) == (4 if at_cap else 3)


def test_the_spread_weights_in_flight_work_by_the_square_of_the_steps_left() -> None:
    assert urgency({3: 64, 4: 32}, {3: 2, 4: 3}) == {3: 16.0, 4: 32 / 9}
    assert urgency({3: 64, 4: 32}, {3: 2, 4: 3}, by_deadline=False) == {3: 64, 4: 32}
    assert urgency({3: 10, 4: 0}, {3: 0, 4: 1}) == {3: 10.0}  # a due version counts 1 step; no work: left out


@pytest.mark.parametrize(("by_deadline", "held"), [(True, (8, 2)), (False, (6, 4))])
def test_while_levelling_the_version_due_soonest_gets_the_larger_share(by_deadline: bool,
                                                                      held: tuple[int, int]) -> None:
    """Version 0 (64 in flight, due in 2 steps) and version 1 (32, due in 3) share 10 instances while the newest can
    take nothing (RBS full): by deadline 16 : 32/9, so 8 and 2 (one each, then the rest in proportion); by count
    64 : 32, so 6 and 4."""
    s: DoraScheduler[str] = dora_scheduler(_cfg(2, 96, num_instances=10, consolidate_level_by_deadline=by_deadline))
    for g in range(60):
        s.handle(PromptQueued(f"g{g}", "p"))
    s.handle(VersionSeen(0, 0.0))
    tids = [d.trajectory_id for d in s.decide().dispatches]
    assert len(tids) == 96
    for t in tids[:32]:  # 8 whole groups: batch 0 is planned
        s.handle(Completed(t))
        s.handle(Scored(t))
    assert [step for step, _ in s.decide().plans] == [0]
    s.handle(VersionSeen(1, 1.0))
    assert len(s.decide().dispatches) == 32 and s.unconsumed() == 96  # RBS full: the newest can take nothing
    s.repartition()
    assert (s.state.instance_version.count(0), s.state.instance_version.count(1)) == held
