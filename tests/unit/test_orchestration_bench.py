"""bench/orchestration at a tiny scale: it times the real rules, and every dispatched request is accounted for."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

from orchestration import PARTS, _check, run_scale


def test_tiny_scale_times_every_step_and_loses_nothing() -> None:
    r = run_scale(8, 8, steps=3, warmup=2, step_time_s=20.0, heartbeat_s=2.0, group_size=4, seed=1)
    assert len(r["steps"]) == 3
    for st in r["steps"]:
        assert st["wall_ms"] > 0 and st["sched_ms"] > 0 and st["polls"] > 0
        assert st["wall_ms"] >= st["sched_ms"] and st["wall_ms"] >= max(st[p] for p in PARTS)
        assert st["unconsumed_peak"] > 0
    assert all(sum(st[p] for st in r["steps"]) > 0 for p in ("events", "heartbeats", "tick", "decide", "consumed"))
    assert r["dispatched"] > 0 and r["batched"] >= 5 * r["tbs"], "a batch per step, warm-up included"
    assert r["batched"] + r["unplanned"] == r["dispatched"]
    assert r["duplicates"] == 0 and r["bad_batches"] == 0 and r["unaccounted"] == 0
    assert 0 <= r["staleness_range"][0] <= r["staleness_range"][1] <= r["max_staleness"]
    assert r["accounted"]


def test_the_check_catches_a_lost_or_twice_batched_request() -> None:
    trajs = {"g0/0": SimpleNamespace(done=False), "g0/1": SimpleNamespace(done=True)}
    sched = SimpleNamespace(_resume=[], state=SimpleNamespace(migrating={}, trajs=trajs),
                            planner=SimpleNamespace(version_of={"g0/0": 1, "g0/1": 1}))
    version_of = {"g0/0": 1, "g0/1": 1, "g1/0": 0, "g1/1": 0}
    heap = [(5.0, 1, "g0/0")]
    ok = _check(sched, version_of, {1: ["g1/0", "g1/1"]}, 2, 2, heap, {"g0/0": 1})
    assert ok["accounted"] and ok["unaccounted"] == 0
    lost = _check(sched, version_of, {1: ["g1/0", "g1/1"]}, 2, 2, heap, {"g0/0": 2})  # stopped decoding
    assert not lost["accounted"] and lost["unaccounted"] == 1
    twice = _check(sched, version_of, {1: ["g1/0", "g1/1"], 2: ["g1/0", "g1/1"]}, 2, 2, heap, {"g0/0": 1})
    assert not twice["accounted"] and twice["duplicates"] == 2
    stale = _check(sched, version_of, {3: ["g1/0", "g1/1"]}, 2, 2, heap, {"g0/0": 1})
    assert not stale["accounted"], "staleness 3 > S = 2"
