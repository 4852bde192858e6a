"""The instance-side rule (which version to hold, which requests start) as pure code."""

from __future__ import annotations

from dora_rl.core.instance_policy import next_version, startable


def test_never_switches_while_running() -> None:
    assert next_version(held=3, pending_versions=[1, 2], running=1) == 3


def test_keeps_the_held_version_while_it_has_work_else_takes_the_oldest() -> None:
    assert next_version(held=3, pending_versions=[2, 3, 4], running=0) == 3
    assert next_version(held=3, pending_versions=[5, 2, 4], running=0) == 2
    assert next_version(held=-1, pending_versions=[1], running=0) == 1
    assert next_version(held=3, pending_versions=[], running=0) is None


def test_starts_the_held_version_in_arrival_order_up_to_the_free_slots() -> None:
    queued = [("a", 1), ("b", 2), ("c", 1), ("d", 1)]
    version = lambda q: q[1]  # noqa: E731
    assert startable(1, queued, version, running=0, capacity=2) == [("a", 1), ("c", 1)]
    assert startable(1, queued, version, running=1, capacity=2) == [("a", 1)]
    assert startable(1, queued, version, running=2, capacity=2) == []
    assert startable(2, queued, version, running=0, capacity=8) == [("b", 2)]
