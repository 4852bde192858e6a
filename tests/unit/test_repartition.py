"""Rule 5 (re-partition) as pure functions (``streams/repartition.py``) and the ``drain`` policy of the
DORA scheduler: a moved instance keeps its version while it decodes, gets no new work, switches once
empty, cancels nothing — and its draining survives a snapshot and restore."""

from __future__ import annotations

import random

import pytest

from dora_rl.config import DoraConfig
from dora_rl.streams.dora_policy import DoraScheduler
from dora_rl.streams.dora_rules import dora_scheduler
from dora_rl.streams.dora_state import LOST
from dora_rl.streams.repartition import assign, drain_moves, drained, least_loaded_freed, quotas
from dora_rl.streams.scheduler_state import dump_state, load_state
from dora_rl.streams.scheduling_events import Completed, Dispatch, Heartbeat, PromptQueued, Tick, VersionSeen


def test_quotas_cover_every_version_with_work_and_sum_to_n() -> None:
    q = quotas({0: 2.0, 1: 0.0, 2: 30.0}, 5)
    assert q == {0: 1, 2: 4} and sum(q.values()) == 5
    assert quotas({0: 1.0, 1: 1.0, 2: 1.0}, 2) == {0: 1, 1: 1, 2: 0}  # oldest first while instances last
    assert quotas({0: 0.0}, 3) == {}


def _members(current: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for i, v in enumerate(current):
        out.setdefault(v, []).append(i)
    return out


def _assign_by_scan(current: list[int], quota: dict[int, int], latest: int) -> list[int]:
    """Rule 5's assignment written as a scan of every instance (the specification ``assign`` must match)."""
    left = dict(quota)
    new = [v if v == LOST else -1 for v in current]
    live = [i for i, v in enumerate(current) if v != LOST]
    for i in live:
        if left.get(current[i], 0) > 0:
            new[i] = current[i]
            left[current[i]] -= 1
    free = [i for i in live if new[i] < 0]
    for v in sorted(left, reverse=True):
        while left[v] > 0 and free:
            new[free.pop(0)] = v
            left[v] -= 1
    for i in free:
        new[i] = latest
    return new


def test_assign_keeps_instances_on_their_version() -> None:
    moves = assign(_members([0, 0, 1, LOST, -1]), {0: 1, 1: 1, 2: 2}, latest=2, lost=LOST)
    assert moves == {1: 2, 4: 2}  # instance 0 keeps 0, 2 keeps 1, the lost one is left alone


def test_assign_moves_only_free_instances_and_matches_a_full_scan() -> None:
    rng = random.Random(7)
    for _ in range(2000):
        n = rng.randint(1, 24)
        latest = rng.randint(0, 4)
        current = [rng.choice([-1, LOST, *range(latest + 1)]) for _ in range(n)]
        live = sum(v != LOST for v in current)
        pending = {v: float(rng.choice([0, 0, 1, 5, 40])) for v in range(max(0, latest - 2), latest + 1)}
        quota = quotas(pending, live)
        if not quota:
            continue
        moves = assign(_members(current), quota, latest, LOST)
        expected = _assign_by_scan(current, quota, latest)
        after = [moves.get(i, v) for i, v in enumerate(current)]
        assert after == expected, (current, quota)
        assert list(moves) == sorted(moves) and all(current[i] != LOST for i in moves)


def test_drain_holds_only_loaded_movers() -> None:
    current, moves = [0, 0, 1], {1: 2, 2: 2}
    draining = drain_moves(current, moves, {1: 3, 2: 0})
    assert draining == {1: 2} and moves == {2: 2}  # instance 2 is empty: it moves at once
    assert drained(draining, draining, {1: 1}, {0, 2}, 2) == {}
    assert drained(draining, draining, {1: 0}, {0, 2}, 2) == {1: 2}
    assert drained(draining, [1, 5], {}, {0, 3}, 3) == {1: 3}  # its target died meanwhile: the newest
    assert drained(draining, [5], {}, {0, 2}, 2) == {}  # only the candidates are looked at


def test_counts_keep_members_and_emptied_in_step() -> None:
    s = _sched("drain")
    c = s.state.counts
    iv = s.state.instance_version
    for v in set(iv):
        assert c.members[v] == [i for i, x in enumerate(iv) if x == v]
    s.state.hold(0, 3)
    assert c.members[3] == [0]
    c.emptied = set()
    for tid in list(c.placed.get(1, ())):
        s.handle(Completed(tid))
    assert c.emptied == {1}


def _cfg(policy: str) -> DoraConfig:
    return DoraConfig.from_dict({"mode": "dora", "max_staleness": 1, "steps": 6, "train_batch_size": 4,
                                "group_size": 2, "rollout_batch_size": 12, "num_instances": 2,
                                "instance_concurrency": 4, "engine": "emulated", "repartition_policy": policy})


def _started(s: DoraScheduler[str], groups: int) -> list[Dispatch[str]]:
    """Queue ``groups`` prompts, hear both instances, publish version 0: the first dispatches (on both)."""
    for g in range(groups):
        s.handle(PromptQueued(f"g{g}", f"prompt {g}"))
    for i in (0, 1):
        s.handle(Heartbeat(i, 0.0))
    s.handle(VersionSeen(0, 0.0))
    first = list(s.decide().dispatches)
    assert {d.instance for d in first} == {0, 1} and {d.version for d in first} == {0}
    return first


def _sched(policy: str) -> DoraScheduler[str]:
    s: DoraScheduler[str] = dora_scheduler(_cfg(policy))
    _started(s, 4)  # 8 trajectories of version 0 fill both instances; 4 more fit the RBS later
    return s


def test_drain_cancels_nothing_and_switches_when_empty() -> None:
    migrate = _sched("migrate")
    for g in range(4, 12):
        migrate.handle(PromptQueued(f"g{g}", f"prompt {g}"))
    migrate.handle(VersionSeen(1, 1.0))
    assert migrate.decide().cancels, "migrate: the moved instance's work is cancelled at once"

    s = _sched("drain")
    for g in range(4, 12):
        s.handle(PromptQueued(f"g{g}", f"prompt {g}"))
    s.handle(VersionSeen(1, 1.0))
    assert s.decide().cancels == ()
    assert len(s.state.draining) == 1
    (mover, target), = s.state.draining.items()
    assert target == 1 and s.state.instance_version[mover] == 0  # held on its version while it decodes
    assert all(d.instance != mover for d in s.decide().dispatches)  # no new work while draining
    restored: DoraScheduler[str] = dora_scheduler(_cfg("drain"))  # a restarted orchestrator, from the snapshot
    load_state(restored, dump_state(s, lambda p: p), lambda p: p)
    for sched in (s, restored):
        assert sched.state.draining == {mover: 1}
        for tid in list(sched.state.counts.placed.get(mover, ())):
            sched.handle(Completed(tid))
        sched.handle(Tick(1.5))
        assert sched.state.draining == {} and sched.state.instance_version[mover] == 1
        sent = sched.decide().dispatches
        assert sent and all(d.version == 1 for d in sent if d.instance == mover)
        assert any(d.instance == mover for d in sent)
    assert s.state.instance_version == restored.state.instance_version


def test_a_repeated_repartition_still_moves_a_draining_instance_that_emptied() -> None:
    s = _sched("drain")
    for g in range(4, 12):
        s.handle(PromptQueued(f"g{g}", f"prompt {g}"))
    s.handle(VersionSeen(1, 1.0))
    (mover, _), = s.state.draining.items()
    for tid in list(s.state.counts.placed.get(mover, ())):
        s.handle(Completed(tid))
    s.repartition()  # called directly (no tick switched it): same quotas, same holders as it left them
    assert s.unchanged_repartitions == 0 and s.state.draining == {} and s.state.instance_version[mover] == 1
    s.repartition()
    assert s.unchanged_repartitions == 1, "nothing changed since: this one decides nothing"


def test_least_loaded_freed_orders_only_the_versions_that_shrink() -> None:
    members = {0: [0, 1, 2], 1: [3, 4]}
    load = {0: 0, 1: 5, 2: 2, 3: 0, 4: 9}
    ordered = least_loaded_freed(members, {0: 1, 1: 2}, load)
    assert ordered == {0: [1, 2, 0], 1: [3, 4]}  # version 1 keeps both: its order is untouched
    assert assign(ordered, {0: 1, 1: 4}, 1, LOST) == {0: 1, 2: 1}  # the busiest holder of 0 keeps it
    assert assign(members, {0: 1, 1: 4}, 1, LOST) == {1: 1, 2: 1}  # by index, the busiest one would move


def _one_busy_one_empty(free_least_loaded: bool, on_idle: bool = True) -> DoraScheduler[str]:
    """Both instances hold version 0; instance 0 has finished its work, instance 1 still decodes two; then
    version 1 is published with prompts waiting."""
    s: DoraScheduler[str] = dora_scheduler(DoraConfig.from_dict({
        "mode": "dora", "steps": 3, "train_batch_size": 4, "max_staleness": 1, "group_size": 2,
        "rollout_batch_size": 12, "num_instances": 2, "instance_concurrency": 4, "engine": "emulated",
        "repartition_policy": "drain", "repartition_free_least_loaded": free_least_loaded,
        "repartition_on_idle": on_idle, "repartition_s": 5.0}))
    for d in _started(s, 3):
        if d.instance == 0:
            s.handle(Completed(f"{d.group_id}/{d.sample_index}"))
    for g in range(3, 9):
        s.handle(PromptQueued(f"g{g}", f"prompt {g}"))
    s.handle(VersionSeen(1, 1.0))
    return s


def test_drain_frees_the_empty_instance_not_the_busy_one() -> None:
    """Version 0 keeps one instance for its work in flight: the busy one keeps it, the empty one takes version 1
    at once, and version 1's work goes there now (no instance drains, none sits idle on version 0)."""
    s = _one_busy_one_empty(True)
    assert s.state.instance_version == [1, 0] and s.state.draining == {}
    sent = s.decide().dispatches
    assert sent and {(d.instance, d.version) for d in sent} == {(0, 1)}
    old = _one_busy_one_empty(False)  # the ablation: the lowest index keeps version 0
    assert old.state.instance_version == [0, 0] and old.state.draining == {1: 1}
    assert all(d.version == 0 for d in old.decide().dispatches)


@pytest.mark.parametrize("on_idle", [True, False])
def test_an_instance_idle_on_a_finished_version_is_moved_at_the_next_tick(on_idle: bool) -> None:
    """Instance 0 keeps version 0 (lowest index) while instance 1 drains towards version 1; once instance 1
    empties, version 0 has no work anywhere and instance 0 is an orphan. With the trigger it takes the newest
    version at the next tick; without it, only at the timed re-partition ``repartition_s`` later."""
    s = _one_busy_one_empty(False, on_idle)
    for tid in list(s.state.counts.placed.get(1, ())):
        s.handle(Completed(tid))
    s.handle(Tick(1.1))
    assert s.state.instance_version[1] == 1
    assert s.state.instance_version[0] == (1 if on_idle else 0)
    s.handle(Tick(5.0))
    assert s.state.instance_version[0] == (1 if on_idle else 0)
    s.handle(Tick(6.1))  # repartition_s after the version was seen
    assert s.state.instance_version == [1, 1]
