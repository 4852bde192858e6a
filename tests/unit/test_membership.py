"""Elastic rollout instances: the liveness rule, and the DORA rules re-dispatching a lost instance's work."""

from __future__ import annotations

from dora_rl.config import DoraConfig
from dora_rl.streams.dora_policy import DoraScheduler
from dora_rl.streams.dora_rules import dora_scheduler
from dora_rl.streams.dora_state import LOST
from dora_rl.streams.membership import Membership
from dora_rl.streams.scheduling_events import Heartbeat, PromptQueued, Tick, VersionSeen


def test_membership_joins_loses_once_and_rejoins() -> None:
    m = Membership(configured=2, timeout_s=10.0)
    assert m.live() == [0, 1] and m.expire(100.0) == [], "never heard: assumed live, never lost"
    assert m.hear(0, 1.0) is False and m.hear(1, 1.0) is False, "configured instances do not 'join'"
    assert m.hear(5, 2.0) is True and m.size() == 6 and m.live() == [0, 1, 5]
    m.hear(0, 9.0)
    assert m.expire(11.5) == [1] and m.expire(12.5) == [5] and m.expire(30.0) == [0]
    assert m.expire(40.0) == [] and m.live() == [], "every instance lost; indices 2-4 were never known"
    assert m.hear(1, 41.0) is True and 1 in m.live(), "a lost instance heard again joins again"
    restored = Membership(2, 10.0)
    restored.load(m.dump())
    assert restored.lost == m.lost and restored.last_heard == m.last_heard
    assert restored.expire(52.0) == [1], "the restored timers run on"


def _cfg(**kw: object) -> DoraConfig:
    base = {"mode": "dora", "max_staleness": 1, "steps": 4, "train_batch_size": 8, "group_size": 4,
            "rollout_batch_size": 16, "num_instances": 2, "instance_concurrency": 16, "engine": "emulated",
            "instance_timeout_s": 10.0}
    return DoraConfig.from_dict({**base, **kw})


def test_a_lost_instance_work_is_generated_again_on_the_same_version_and_a_newcomer_gets_work() -> None:
    s: DoraScheduler[str] = dora_scheduler(_cfg())
    for i in range(4):
        s.handle(PromptQueued(f"g{i}", f"prompt {i}"))
    s.handle(Heartbeat(0, 0.0))
    s.handle(Heartbeat(1, 0.0))
    s.handle(VersionSeen(0, 0.0))
    first = s.decide().dispatches
    on_1 = {d.trajectory_id for d in first if d.instance == 1}
    assert on_1, "both instances get work"
    s.handle(Heartbeat(0, 9.0))
    s.handle(Tick(12.0))  # instance 1 silent for 12 s > 10 s: lost
    assert s.state.instance_version[1] == LOST and s.redispatched == len(on_1)
    again = s.decide().resumes
    assert {m.trajectory_id for m, _ in again} == on_1 and all(t == 0 for _, t in again)
    assert all(m.partial is None and m.version == 0 for m, _ in again), "from scratch, same version (C1)"
    s.handle(Heartbeat(2, 13.0))  # a newcomer with a new index
    assert s.live_instances() == [0, 2] and s.state.instance_version[2] == 0, "it gets a version at once"
    more = [d for d in s.decide().dispatches if d.instance == 2]
    assert more or not s._prompts, "the newcomer gets new work while prompts remain"


def test_a_graceful_leave_moves_the_work_at_once_and_the_index_can_come_back() -> None:
    s: DoraScheduler[str] = dora_scheduler(_cfg())
    for i in range(4):
        s.handle(PromptQueued(f"g{i}", f"prompt {i}"))
    s.handle(Heartbeat(0, 0.0))
    s.handle(Heartbeat(1, 0.0))
    s.handle(VersionSeen(0, 0.0))
    on_1 = {d.trajectory_id for d in s.decide().dispatches if d.instance == 1}
    assert on_1
    s.handle(Heartbeat(1, 1.0, leaving=True))  # SIGTERM: no waiting for the 10 s timeout
    assert s.state.instance_version[1] == LOST and s.redispatched == len(on_1)
    assert {m.trajectory_id for m, _ in s.decide().resumes} == on_1
    s.handle(Heartbeat(1, 1.5, leaving=True))
    assert s.redispatched == len(on_1), "a repeated STOPPED moves nothing twice"
    s.handle(Heartbeat(0, 29.0))
    s.handle(Tick(30.0))
    assert s.redispatched == len(on_1), "a left instance is not lost a second time by the timer"
    s.handle(Heartbeat(1, 31.0))
    assert 1 in s.live_instances(), "heard again (restarted): it rejoins"


def test_membership_leave_is_immediate_and_reported_once() -> None:
    m = Membership(configured=2, timeout_s=10.0)
    m.hear(0, 0.0)
    assert m.leave(0, 1.0) is True and m.leave(0, 2.0) is False
    assert m.live() == [1] and m.expire(100.0) == [], "left: never expired again"
    assert m.hear(0, 101.0) is True and m.live() == [0, 1]
