"""Beyond the paper, one axis: DORA's staleness bound ``S = 1..4`` on the paper's 64-GPU setup.

Each ``S`` runs DORA at the layout the full sweep chose at 64 H800 (``bench/simulate.py --paper --fit``,
``bench/results/paper-sim-20261124-065017.json``: 40 rollout + 24 trainer GPUs, RBS 2xTBS, 256 sequences,
``drain``, ``train_mfu`` 0.40), and sync (colocated, 256 sequences) as the reference, on the same seeds.
Per ``S``, ``drain`` (the default policy) also gets its own best over-provisioning: RBS in
:data:`RBS_SWEEP` x TBS is swept on the first seed, and the best by throughput runs on every seed (a larger
``S`` is only worth something if more requests are in flight to use it); ``migrate`` runs at the fixed RBS
2x TBS. Step time, throughput (mean [min-max] over the seeds), fraction of the bubble-free bound
(:func:`paper.bound`) and the GPU-time shares are written to ``bench/results/paper-staleness-<UTC>.json``.
The layout (split, ``max_num_seqs``) is held fixed so that only staleness and over-provisioning move.

Usage::

    .venv/bin/python bench/paper_staleness.py [--seeds 0 1 2] [--workers 2]
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paper
from provenance import provenance, write_result

GPUS, ROLLOUT, RBS, SEQS, TRAIN_MFU = 64, 40, 2.0, 256, 0.40
RBS_SWEEP = (1.5, 2.0, 3.0, 4.0)
"""Over-provisioning candidates for ``drain`` at each ``S`` (x TBS)."""


def _summary(st: paper.Setting, mine: list[dict[str, Any]], sync_step: float, bound: float) -> dict[str, Any]:
    """One setting over the seeds: means with their per-seed spread."""
    step = paper.mean_spread(mine, "step_time_s")
    thr = paper.mean_spread(mine, "throughput")
    return {"staleness": st.staleness, "repartition": st.repartition, "rbs_factor": st.rbs_factor,
            "step_time_s": step, "throughput": thr,
            "vs_sync": {"mean": sync_step / step["mean"], "min": sync_step / step["max"],
                        "max": sync_step / step["min"]},
            "fraction_of_bound": thr["mean"] / bound,
            "max_staleness_seen": max(r["max_staleness"] for r in mine),
            "refused": sum(r["refused"] for r in mine), "gpu_time_share": paper.mean_shares(mine), "runs": mine}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    prov = provenance()
    w, eff = paper.Workload(), replace(paper.Efficiencies(), train_mfu=TRAIN_MFU)
    bound = paper.bound(GPUS, w, eff)

    def dora(s: int, rbs: float, pol: str) -> paper.Setting:
        return paper.Setting("dora", s, rbs, ROLLOUT, GPUS - ROLLOUT, max_num_seqs=SEQS, repartition=pol)

    # the sweep: drain at every S and RBS, on the first seed
    grid = [dora(s, f, "drain") for s in (1, 2, 3, 4) for f in RBS_SWEEP]
    swept = paper.run_many([(st, w, eff, a.seeds[0]) for st in grid], a.workers)
    sweep = {st.name: {"step_time_s": r["step_time_s"], "throughput": r["throughput"], "seed": a.seeds[0]}
             for st, r in zip(grid, swept, strict=True)}
    best = {s: max((st for st in grid if st.staleness == s), key=lambda st: sweep[st.name]["throughput"])
            for s in (1, 2, 3, 4)}
    for st in grid:
        print(f"  sweep {st.name:50s} step {sweep[st.name]['step_time_s']:7.1f}s"
              f"{'  <- best' if best[st.staleness] == st else ''}")
    sync = paper.Setting("sync", 0, 1.0, GPUS, GPUS, colocated=True, max_num_seqs=SEQS)
    settings = [sync, *(best[s] for s in (1, 2, 3, 4)), *(dora(s, RBS, "migrate") for s in (1, 2, 3, 4))]
    fixed = [dora(s, RBS, "drain") for s in (1, 2, 3, 4) if best[s].rbs_factor != RBS]
    settings += fixed  # drain at the fixed RBS too, where it was not the best: the before/after of the sweep
    runs = paper.run_many([(st, w, eff, seed) for st in settings for seed in a.seeds], a.workers)
    n = len(a.seeds)
    sync_step = paper.mean_spread(runs[:n], "step_time_s")["mean"]
    out: dict[str, Any] = {**prov, "engine": "simulated (hardware_costs: H800, Qwen2.5-32B)", "gpus": GPUS,
                           "train_mfu": TRAIN_MFU, "seeds": a.seeds, "rbs_sweep": list(RBS_SWEEP), "sweep": sweep,
                           "best_rbs": {str(s): best[s].rbs_factor for s in best}, "bound": bound, "settings": {}}
    for i, st in enumerate(settings):
        row = _summary(st, runs[i * n:(i + 1) * n], sync_step, bound["tokens_per_s"])
        out["settings"][st.name] = row
        print(f"{st.name:50s} step {row['step_time_s']['mean']:7.1f}s  vs sync {row['vs_sync']['mean']:5.2f}x "
              f"[{row['vs_sync']['min']:.2f}-{row['vs_sync']['max']:.2f}]  bound {row['fraction_of_bound']:.2f}  "
              f"intra-bubble {row['gpu_time_share']['intra_instance_bubble']:.2f}  "
              f"trainer wait {row['gpu_time_share']['trainer_wait']:.2f}")
    path = write_result("paper-staleness", out, a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
