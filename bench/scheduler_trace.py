"""bench/scheduler_trace: the diagnostic behind decision 0064, two ways to look at ``bench/scheduler.py``'s
reported settings (DORA ``consolidate``, 5/8 of the GPUs generating, TP 8, RBS 3x; the bounded partial, RBS 2x).

A diagnostic, not a figure: nothing is written to ``bench/results``.

* ``--compare``: trained tokens/s per seed, DORA with every rule, with each named rule switched off
  (``--ablate``), and the bounded partial, on ``--seeds``;
* ``--trace T0 T1``: the scheduler's state every ``--every`` simulated seconds in ``[T0, T1]`` of one DORA run:
  the latest version, each instance's version and load, in-flight work per version, whether the newest
  version may take work, and the unconsumed count. It is how the due version's empty instances and the
  empty levelled instance of decision 0064 were found (128 GPUs, seed 0, t = 3,000-3,730 s).

The trace wraps the scheduler the simulator builds (``streams.simulator.make_scheduler``) and reads it after
each tick; nothing in the run's behaviour changes.

Usage::

    python bench/scheduler_trace.py --gpus 128 --compare --seeds 0 1 2 --ablate unpack_due
    python bench/scheduler_trace.py --gpus 128 --trace 3000 3730 --every 15
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from paper import Efficiencies, Setting, Workload, run, run_many
from scheduler import HOP_US, MFU

from dora_rl.streams import simulator
from dora_rl.streams.dora_rules import newest_can_take


def reported(gpus: int) -> dict[str, Setting]:
    """DORA ``consolidate`` and the bounded partial at the layout ``bench/scheduler.py`` reported."""
    r = 5 * gpus // 8
    dora = Setting("dora", 2, 3.0, r, gpus - r, max_num_seqs=256, repartition="consolidate", tp=8,
                   hop_latency_s=HOP_US * 1e-6)
    partial = Setting("partial_bounded", 2, 2.0, r, gpus - r, max_num_seqs=256, tp=8, hop_latency_s=HOP_US * 1e-6)
    return {"dora": dora, "partial": partial}


def compare(gpus: int, seeds: list[int], ablate: list[str]) -> None:
    base = reported(gpus)
    chosen = {"dora": base["dora"], **{f"dora {a} off": replace(base["dora"], ablate=a) for a in ablate},
              "partial": base["partial"]}
    eff = replace(Efficiencies(), train_mfu=MFU)
    runs = run_many([(st, Workload(), eff, s) for st in chosen.values() for s in seeds], workers=2)
    for k, label in enumerate(chosen):
        thr = [r["throughput"] for r in runs[k * len(seeds):(k + 1) * len(seeds)]]
        print(f"{label:28s} {gpus} GPUs seeds {seeds}: {[round(t) for t in thr]} mean {statistics.fmean(thr):.0f}")


def trace(gpus: int, seed: int, t0: float, t1: float, every: float) -> None:
    build = simulator.make_scheduler
    last = [-1.0]

    def make(config: Any) -> Any:
        sched = build(config)
        tick = sched.tick

        def traced_tick(now: float) -> None:
            tick(now)
            if t0 <= now <= t1 and now - last[0] >= every:
                last[0] = now
                print(describe(sched, now), flush=True)

        sched.tick = traced_tick
        return sched

    simulator.make_scheduler = make
    try:
        run(reported(gpus)["dora"], Workload(), replace(Efficiencies(), train_mfu=MFU), seed)
    finally:
        simulator.make_scheduler = build


def describe(sched: Any, now: float) -> str:
    st, c = sched.state, sched.state.counts
    iv = list(st.instance_version)
    return (f"t={now:.0f} latest={st.latest} versions={iv} loads={[c.load.get(i, 0) for i in range(len(iv))]} "
            f"in_flight={dict(sorted(c.in_flight.items()))} newest_can_take={newest_can_take(sched)} "
            f"unconsumed={sched.unconsumed()}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="decision 0064's diagnostic (module docstring)")
    ap.add_argument("--gpus", type=int, default=128, choices=(64, 128))
    ap.add_argument("--compare", action="store_true")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--ablate", nargs="*", default=["unpack_due"], help="rules switched off in turn (bench/paper.py)")
    ap.add_argument("--trace", type=float, nargs=2, metavar=("T0", "T1"))
    ap.add_argument("--every", type=float, default=15.0)
    args = ap.parse_args(argv)
    if args.compare:
        compare(args.gpus, args.seeds, args.ablate)
    if args.trace:
        trace(args.gpus, args.seeds[0], args.trace[0], args.trace[1], args.every)
    if not (args.compare or args.trace):
        ap.error("give --compare or --trace")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
