"""Staleness gate, batch assembly and wave dispatch as pure rules (no broker, no clock)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from dora_rl.config import DoraConfig
from dora_rl.streams.batching import BatchAssembler
from dora_rl.streams.scheduling import Scheduler
from dora_rl.streams.scheduling_events import Completed, PromptQueued, Scored, VersionSeen


@dataclass(frozen=True)
class T:
    trajectory_id: str
    group_id: str
    policy_version: int


def group(gid: str, versions: list[int]) -> list[T]:
    return [T(f"{gid}/{i}", gid, v) for i, v in enumerate(versions)]


def test_batches_hold_exactly_tbs_whole_groups_in_completion_order() -> None:
    asm = BatchAssembler(train_batch_size=4, group_size=2, max_staleness=1, require_plans=False)
    for t in group("a", [0, 0])[:1] + group("b", [0, 0]) + group("c", [0, 0]):
        asm.add(t)
    batch = asm.cut()
    assert batch is not None and batch.train_step == 0
    assert [t.group_id for t in batch.trajectories] == ["b", "b", "c", "c"]  # 'a' incomplete: waits
    assert asm.cut() is None
    asm.add(group("a", [0, 0])[1])
    assert asm.pending() == 2 and asm.cut() is None  # one complete group < TBS/G


def test_duplicates_are_ignored() -> None:
    asm = BatchAssembler(4, 2, 0, require_plans=False)
    g = group("a", [0, 0])
    assert asm.add(g[0]) and not asm.add(g[0])
    assert asm.duplicates == 1


def test_oldest_version_first_then_completion_order() -> None:
    asm = BatchAssembler(train_batch_size=2, group_size=2, max_staleness=2, next_step=2, require_plans=False)
    for t in group("new", [2, 2]) + group("old", [1, 0]) + group("mid", [1, 1]):
        asm.add(t)
    first = asm.cut()
    assert first is not None and {t.group_id for t in first.trajectories} == {"old"}
    assert sorted(first.staleness()) == [1, 2]
    second = asm.cut()
    assert second is not None and {t.group_id for t in second.trajectories} == {"mid"}


def test_staleness_gate_refuses_over_stale_groups_and_never_batches_them() -> None:
    asm = BatchAssembler(train_batch_size=2, group_size=2, max_staleness=1, next_step=3, require_plans=False)
    for t in group("stale", [1, 2]) + group("ok", [2, 3]):
        asm.add(t)
    refused = asm.refuse_over_stale()
    assert {t.group_id for t in refused} == {"stale"}
    batch = asm.cut()
    assert batch is not None and max(batch.staleness()) <= 1


def test_every_complete_group_lands_in_exactly_one_batch() -> None:
    asm = BatchAssembler(train_batch_size=8, group_size=4, max_staleness=0, require_plans=False)
    seen: list[str] = []
    for k in range(5):
        for g in range(2):
            for t in group(f"s{k}g{g}", [k] * 4):
                asm.add(t)
        batch = asm.cut()
        assert batch is not None and batch.train_step == k
        seen.extend(t.trajectory_id for t in batch.trajectories)
    assert len(seen) == len(set(seen)) == 40


def _wave_cfg(mode: str, tbs: int, g: int, steps: int, n: int) -> DoraConfig:
    return DoraConfig.from_dict({"mode": mode, "train_batch_size": tbs, "rollout_batch_size": tbs, "group_size": g,
                                 "steps": steps, "num_instances": n})


@pytest.mark.parametrize(("mode", "expected"), [("sync", [0, 1, 2]), ("one_step_off", [0, 0, 1])])
def test_wave_versions(mode: str, expected: list[int]) -> None:
    s: Scheduler[str] = Scheduler(_wave_cfg(mode, 4, 2, 3, 2))
    for i in range(10):
        s.handle(PromptQueued(f"p{i}", f"prompt{i}"))
    s.handle(VersionSeen(0, 0.0))
    first = s.decide().dispatches
    waves_now = 1 if mode == "sync" else 2
    assert len(first) == 4 * waves_now
    assert {d.version for d in first} == {0}
    assert s.decide().dispatches == ()  # waits for the next version
    s.handle(VersionSeen(1, 0.0))
    second = s.decide().dispatches
    s.handle(VersionSeen(2, 0.0))
    third = s.decide().dispatches
    versions = [d.version for d in first + second + third]
    waves = sorted({(d.wave, d.version) for d in first + second + third})
    assert [v for _, v in waves] == expected
    assert len(versions) == 12 and s.status().all_dispatched


def test_dispatch_spreads_load_and_keeps_groups_whole() -> None:
    s: Scheduler[str] = Scheduler(_wave_cfg("sync", 8, 4, 1, 2))
    s.handle(PromptQueued("a", "A"))
    s.handle(PromptQueued("b", "B"))
    s.handle(VersionSeen(0, 0.0))
    out = s.decide().dispatches
    assert s.load() == [4, 4]
    assert sorted(d.trajectory_id for d in out) == sorted(f"{g}/{i}" for g in "ab" for i in range(4))
    for d in out[:3]:
        s.handle(Completed(d.trajectory_id))
        s.handle(Scored(d.trajectory_id))
    assert sum(s.load()) == 5


def test_waits_for_enough_prompts() -> None:
    s: Scheduler[str] = Scheduler(_wave_cfg("sync", 8, 4, 1, 1))
    s.handle(PromptQueued("a", "A"))
    s.handle(VersionSeen(0, 0.0))
    assert s.decide().dispatches == ()
    s.handle(PromptQueued("b", "B"))
    assert len(s.decide().dispatches) == 8


def test_planned_cut_waits_for_every_planned_trajectory() -> None:
    asm = BatchAssembler(train_batch_size=4, group_size=2, max_staleness=1, next_step=1)
    for t in group("new1", [1, 1]) + group("old", [0, 0]):
        asm.add(t)
    assert asm.cut() is None  # no plan yet
    asm.on_plan(1, ["old/0", "old/1", "late/0", "late/1"])
    assert asm.waiting_for() == ["late/0", "late/1"]
    assert asm.cut() is None
    for t in group("late", [0, 0]):
        asm.add(t)
    batch = asm.cut()
    assert batch is not None and batch.train_step == 1
    assert [t.trajectory_id for t in batch.trajectories] == ["old/0", "old/1", "late/0", "late/1"]
    assert asm.violations(batch) == []
    assert asm.pending() == 2  # 'new1' stays for a later plan
