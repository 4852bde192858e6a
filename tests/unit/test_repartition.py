"""Rule 5 (re-partition) as pure functions (``streams/repartition.py``) and the ``drain`` policy of the
DORA scheduler: a moved instance keeps its version while it decodes, gets no new work, switches once
empty, cancels nothing — and its draining survives a snapshot and restore."""

from __future__ import annotations

from dora_rl.config import DoraConfig
from dora_rl.streams.dora_policy import DoraScheduler
from dora_rl.streams.dora_state import LOST
from dora_rl.streams.repartition import assign, drain_moves, drained, quotas
from dora_rl.streams.scheduler_state import dump_state, load_state


def test_quotas_cover_every_version_with_work_and_sum_to_n() -> None:
    q = quotas({0: 2.0, 1: 0.0, 2: 30.0}, 5)
    assert q == {0: 1, 2: 4} and sum(q.values()) == 5
    assert quotas({0: 1.0, 1: 1.0, 2: 1.0}, 2) == {0: 1, 1: 1, 2: 0}  # oldest first while instances last
    assert quotas({0: 0.0}, 3) == {}


def test_assign_keeps_instances_on_their_version() -> None:
    new = assign([0, 0, 1, LOST, -1], [0, 1, 2, 4], {0: 1, 1: 1, 2: 2}, latest=2, lost=LOST)
    assert new == [0, 2, 1, LOST, 2]


def test_drain_holds_only_loaded_movers() -> None:
    current, new = [0, 0, 1], [0, 2, 2]
    draining = drain_moves(current, new, [0, 1, 2], {1: 3, 2: 0})
    assert draining == {1: 2} and new == [0, 0, 2]  # instance 2 is empty: it moves at once
    assert drained(draining, {1: 1}, {0, 2}, 2) == {}
    assert drained(draining, {1: 0}, {0, 2}, 2) == {1: 2}
    assert drained(draining, {}, {0, 3}, 3) == {1: 3}  # its target died meanwhile: the newest


def _cfg(policy: str) -> DoraConfig:
    return DoraConfig.from_dict({"mode": "dora", "max_staleness": 1, "steps": 6, "train_batch_size": 4,
                                "group_size": 2, "rollout_batch_size": 12, "num_instances": 2,
                                "instance_concurrency": 4, "engine": "emulated", "repartition_policy": policy})


def _sched(policy: str) -> DoraScheduler[str]:
    s: DoraScheduler[str] = DoraScheduler(_cfg(policy))
    for g in range(4):  # 8 trajectories of version 0 fill both instances; 4 more fit the RBS later
        s.add_prompt(f"g{g}", f"prompt {g}")
    s.on_heartbeat(0, 0.0)
    s.on_heartbeat(1, 0.0)
    s.on_version(0, 0.0)
    first = s.dispatch()
    assert {d.instance for d in first} == {0, 1} and {d.version for d in first} == {0}
    return s


def test_drain_cancels_nothing_and_switches_when_empty() -> None:
    migrate = _sched("migrate")
    for g in range(4, 12):
        migrate.add_prompt(f"g{g}", f"prompt {g}")
    migrate.on_version(1, 1.0)
    assert migrate.take_cancels(), "migrate: the moved instance's work is cancelled at once"

    s = _sched("drain")
    for g in range(4, 12):
        s.add_prompt(f"g{g}", f"prompt {g}")
    s.on_version(1, 1.0)
    assert s.take_cancels() == []
    assert len(s.state.draining) == 1
    (mover, target), = s.state.draining.items()
    assert target == 1 and s.state.instance_version[mover] == 0  # held on its version while it decodes
    assert all(d.instance != mover for d in s.dispatch())  # no new work while draining
    restored: DoraScheduler[str] = DoraScheduler(_cfg("drain"))  # a restarted orchestrator, from the snapshot
    load_state(restored, dump_state(s, lambda p: p), lambda p: p)
    for sched in (s, restored):
        assert sched.state.draining == {mover: 1}
        for tid in list(sched.state.counts.placed.get(mover, ())):
            sched.on_completed(tid)
        sched.tick(1.5)
        assert sched.state.draining == {} and sched.state.instance_version[mover] == 1
        sent = sched.dispatch()
        assert sent and all(d.version == 1 for d in sent if d.instance == mover)
        assert any(d.instance == mover for d in sent)
    assert s.state.instance_version == restored.state.instance_version
