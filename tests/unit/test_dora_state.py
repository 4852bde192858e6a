"""The DORA scheduler's state changes only through its methods, and its counts stay what a recount gives."""

from __future__ import annotations

import dataclasses
import random

import pytest

from dora_rl.streams.dora_state import LOST, DoraState, TrajState


def _recounted(st: DoraState) -> DoraState:
    fresh = DoraState()
    fresh.restore(dict(st.trajs), list(st.instance_version))
    return fresh


def _same_counts(a: DoraState, b: DoraState) -> None:
    ca, cb = a.counts, b.counts
    assert ca.load == cb.load and ca.placed == cb.placed and ca.in_flight == cb.in_flight
    assert ca.members == cb.members and ca.idle == cb.idle
    assert sorted(ca.pos, key=ca.pos.__getitem__) == list(a.trajs) == sorted(cb.pos, key=cb.pos.__getitem__)


@pytest.mark.parametrize("seed", range(4))
def test_every_change_keeps_the_counts_a_recount_gives(seed: int) -> None:
    rng = random.Random(seed)
    st = DoraState(3)
    n = 0
    for _ in range(600):
        op = rng.randrange(9)
        tids = list(st.trajs)
        if op <= 1 or not tids:
            n += 1
            st.add(f"t{n}", TrajState(rng.randrange(4), rng.randrange(-1, len(st.instance_version)), f"g{n // 4}"))
        elif op == 2:
            st.remove(rng.choice(tids))
        elif op == 3:
            st.place(rng.choice(tids), rng.randrange(-1, len(st.instance_version)))
        elif op == 4:
            st.retag(rng.choice(tids), rng.randrange(4), rng.randrange(-1, len(st.instance_version)))
        elif op == 5:
            st.finish(rng.choice(tids))
        elif op == 6:
            st.hold(rng.randrange(len(st.instance_version)), rng.choice([-1, LOST, 0, 1, 2, 3]))
        elif op == 7:
            st.grow(len(st.instance_version) + rng.randrange(2))
        else:
            tid = rng.choice(tids)  # re-added: replaced where it stands
            st.add(tid, TrajState(rng.randrange(4), rng.randrange(-1, len(st.instance_version)), "g"))
        _same_counts(st, _recounted(st))


def test_its_views_cannot_be_changed_in_place() -> None:
    st = DoraState(2)
    st.add("a", TrajState(0, 1, "g"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        st.trajs["a"].instance = 0  # type: ignore[misc]
    with pytest.raises(TypeError):
        st.trajs["b"] = TrajState(0, 0, "g")  # type: ignore[index]
    st.drain({1: 2})
    assert st.draining == {1: 2} and st.counts.emptied is None
    st.stop_draining(1)
    assert st.draining == {}
