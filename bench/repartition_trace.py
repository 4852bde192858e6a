"""bench/repartition_trace: what DORA's re-partitions do, one simulated run of the paper's setup at a size.

A diagnostic, not a figure: it runs one setting of ``bench/paper_scale.py`` (DORA S = 2, RBS 2x TBS, 5/8 of
the GPUs generating, ``migrate`` or ``drain``) on the simulator and prints, for every re-partition that moved
work (and at least every 100 simulated seconds), the simulated time, the latest version, the trajectories the
re-partition cancelled, the instances per version after it, the in-flight trajectories per live version and
the length of the resume queue (cancelled trajectories waiting for a free slot on an instance of their own
version). It is how the ``migrate`` collapse at 512 GPUs was traced (decision 0033): after version 1, 56 of
80 instances are moved to the newest version at once, 19,268 trajectories of version 0 are cancelled and
17,814 of them are still waiting for a slot 20 s later, then one instance a re-partition swings back.

The trace comes from wrapping the scheduler the simulator builds (``streams.simulator.make_scheduler``):
each ``repartition`` call is recorded as it returns; nothing in the run's behaviour changes.

Usage: ``python bench/repartition_trace.py [--gpus 512] [--steps 8] [--policy migrate] [--seed 0]``
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paper
import paper_scale

from dora_rl.streams.dora_policy import DoraScheduler


@dataclass(frozen=True)
class Repartition:
    """One re-partition as the scheduler left it."""

    t: float
    """Simulated seconds (the time of the last tick before it)."""
    latest: int
    moved: int
    """Trajectories it cancelled (to resume elsewhere, ``migrate`` only)."""
    instances: dict[int, int]
    """Version -> instances holding it, after it."""
    in_flight: dict[int, int]
    """Live version -> trajectories still decoding (queued at instances and waiting to resume included)."""
    resume_queue: int


def traced(gpus: int, steps: int, policy: str, seed: int) -> tuple[dict[str, Any], list[Repartition]]:
    """Run the setting; returns its figures (``paper.run``) and every re-partition, in order."""
    import dora_rl.streams.simulator as simulator

    build = simulator.make_scheduler
    log: list[Repartition] = []

    def make(config: Any) -> Any:
        sched = build(config)
        assert isinstance(sched, DoraScheduler), "the trace is of DORA's scheduler"
        clock = [0.0]
        tick, repartition = sched.tick, sched.repartition

        def timed_tick(now: float) -> None:
            clock[0] = now
            tick(now)

        def recorded() -> Any:
            cancels = repartition()
            st = sched.state
            log.append(Repartition(clock[0], st.latest, sum(len(c.trajectory_ids) for c in cancels),
                                   dict(sorted(collections.Counter(st.instance_version).items())),
                                   {v: sched.in_flight(v) for v in sched.live_versions()}, len(sched._resume)))
            return cancels

        setattr(sched, "tick", timed_tick)  # noqa: B010 - instance attributes over the bound methods
        setattr(sched, "repartition", recorded)  # noqa: B010
        return sched

    simulator.make_scheduler = make
    try:
        eff = replace(paper.Efficiencies(), train_mfu=paper_scale.TRAIN_MFU)
        w = replace(paper.Workload(), tbs=paper_scale.PER_GPU_TBS * gpus, steps=steps, warmup=steps // 2)
        setting = next(s for s in paper_scale.layouts(gpus) if s.mode == "dora" and s.repartition == policy)
        return paper.run(setting, w, eff, seed), log
    finally:
        simulator.make_scheduler = build


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--policy", choices=("migrate", "drain"), default="migrate")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    fig, log = traced(a.gpus, a.steps, a.policy, a.seed)
    last: Repartition | None = None
    for r in log:
        if last is None or r.moved or r.latest != last.latest or r.t - last.t >= 100:
            print(f"t={r.t:8.1f}s V={r.latest} moved={r.moved:6d} instances={r.instances} "
                  f"in_flight={r.in_flight} resume_queue={r.resume_queue}")
            last = r
    print(f"{len(log)} re-partitions, {sum(1 for r in log if r.moved)} moved work, "
          f"{sum(r.moved for r in log)} trajectories cancelled in all; "
          f"step {fig['step_time_s']:.1f} s over the steady steps ({time.perf_counter() - t0:.0f} s wall)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
