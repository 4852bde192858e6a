"""The counted and memoised forms of the planning rules give the answers of the plain forms (report 0027).

`plan_batch` with in-flight deadlines as counts equals it with a list; the planner's refusal memo never
hides a plan that became possible; the resume queue keeps FIFO order per version and its count; the
assembler's over-stale memo still refuses a group once the step moves past its deadline; the paper
report's verdicts follow the 15% rule.
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass
from pathlib import Path

from dora_rl.streams.batching import BatchAssembler
from dora_rl.streams.dora_state import ResumeQueue
from dora_rl.streams.planning import GroupView, Planner, plan_batch
from dora_rl.streams.scheduling_events import Migration


def test_plan_batch_with_counts_equals_with_a_list() -> None:
    rng = random.Random(7)
    for _ in range(500):
        step = rng.randrange(0, 4)
        complete = [GroupView(f"g{i}", rng.randrange(step, step + 4), tuple(f"g{i}/{j}" for j in range(2)), i)
                    for i in range(rng.randrange(0, 8))]
        in_flight = [rng.randrange(step, step + 4) for _ in range(rng.randrange(0, 10))]
        counts: dict[int, int] = {}
        for d in in_flight:
            counts[d] = counts.get(d, 0) + 1
        assert plan_batch(complete, in_flight, step, 4, 10) == plan_batch(complete, counts, step, 4, 10)


def test_refusal_memo_does_not_hide_a_plan_that_became_possible() -> None:
    p = Planner(train_batch_size=2, group_size=2, max_staleness=1, steps=3)
    for g, v in (("x", 0), ("y", 0), ("c", 1)):  # x, y due by step 1; c by step 2 (feasible: 4 <= 4, 6 <= 6)
        for i in range(2):
            p.add(f"{g}/{i}", g, v)
    p.complete("c/0")
    p.complete("c/1")  # only c is complete: batch 0 from c would leave x and y (4, due at 1) for one step
    assert p.plans() == []  # refused by the EDF check (not by a trajectory due now)
    assert p.plans() == []  # memoised: nothing changed
    p.complete("x/0")
    assert p.plans() == []
    p.complete("x/1")  # x complete: batch 0 = x leaves y (due 1) and c (due 2) feasible
    assert p.plans() == [(0, ["x/0", "x/1"])]


def test_resume_queue_fifo_per_version_and_count() -> None:
    q = ResumeQueue()
    for tid, v in (("x", 2), ("y", 1), ("z", 2), ("w", 1)):
        q.append((Migration(tid, v, None), v))
    assert len(q) == 4 and q.versions() == [1, 2]
    assert [m.trajectory_id for m, _ in q] == ["y", "w", "x", "z"]  # oldest version first, FIFO within
    head = q.head(2)
    assert head is not None and head[0].trajectory_id == "x"
    assert q.pop(2)[0].trajectory_id == "x" and len(q) == 3
    q.discard({"w", "z"})
    assert len(q) == 1 and [m.trajectory_id for m, _ in q] == ["y"] and q.versions() == [1]
    again = ResumeQueue(list(q))  # what a snapshot restores
    assert [m.trajectory_id for m, _ in again] == ["y"] and len(again) == 1


@dataclass(frozen=True)
class _T:
    trajectory_id: str
    group_id: str
    policy_version: int


def test_over_stale_memo_refuses_once_the_step_passes_the_deadline() -> None:
    asm = BatchAssembler(train_batch_size=2, group_size=2, max_staleness=0, require_plans=False)
    for tid in ("old/0", "old/1"):
        asm.add(_T(tid, "old", 0))
    assert asm.refuse_over_stale() == []  # step 0, version 0: fine
    assert asm.refuse_over_stale() == []  # memoised
    asm.next_step = 1  # the step moved on (as after a cut)
    assert sorted(t.trajectory_id for t in asm.refuse_over_stale()) == ["old/0", "old/1"]
    for tid in ("new/0", "new/1"):
        asm.add(_T(tid, "new", 0))  # a newly complete group, over-stale at step 1
    assert sorted(t.trajectory_id for t in asm.refuse_over_stale()) == ["new/0", "new/1"]


def test_incremental_over_stale_check_refuses_what_a_full_scan_refuses_in_the_same_order() -> None:
    """Random adds, plans, cuts and step moves: each call refuses exactly the complete groups over-stale
    at that moment (a scan of every complete group, the rule as stated), in completion order."""
    rng = random.Random(7)
    for trial in range(200):
        s, g = rng.randint(0, 2), rng.choice((2, 3))
        asm = BatchAssembler(train_batch_size=g * 2, group_size=g, max_staleness=s, require_plans=True)
        for i in range(120):
            op = rng.random()
            if op < 0.7:  # a trajectory of a random group and a version near the step
                gid = f"t{trial}g{rng.randint(0, 30)}"
                v = max(0, asm.next_step - rng.randint(0, s + 2))
                t = _T(f"{gid}/{i}", gid, v)
                asm.add(t)
            elif op < 0.85:
                asm.next_step += 1
            else:  # a cut of part of a complete group (min version can only rise)
                for grp in [x for x in asm._complete.values() if len(x.members) > 1][:1]:
                    tid = next(iter(grp.members))
                    grp.members.pop(tid)
                    grp.cached_min = None
            expect = [t.trajectory_id for grp in asm._complete.values()
                      if asm.next_step > asm.bound.deadline(min(int(m.policy_version) for m in grp.members.values()))
                      for t in grp.members.values()]
            assert [t.trajectory_id for t in asm.refuse_over_stale()] == expect, (trial, i)


def test_paper_report_verdicts_follow_the_15_percent_rule() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
    import paper_report

    res = {"ratios": {"rollout_phase": 8.2 * 1.14, "step_time": 1.56 * 0.84, "throughput": 1.65},
           "ratio_spread": {k: {"min": 1.0, "max": 2.0} for k in ("rollout_phase", "step_time", "throughput")}}
    rows = {r["ratio"]: r for r in paper_report.table({64: res}, fitted=True)}
    assert rows["rollout_phase"]["within_15pct"] and not rows["step_time"]["within_15pct"]
    assert rows["throughput"]["relative_error"] == 0.0 and rows["throughput"]["kind"] == "fitted"
