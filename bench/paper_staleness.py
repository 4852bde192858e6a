"""Beyond the paper, one axis: DORA's staleness bound ``S = 1..4`` on the paper's 64-GPU setup.

Each ``S`` runs DORA at the layout the full sweep chose at 64 H800 (``bench/simulate.py --paper --fit``,
``bench/results/paper-sim-20261124-065017.json``: 40 rollout + 24 trainer GPUs, RBS 2xTBS, 256 sequences,
``drain``, ``train_mfu`` 0.40) under both re-partition policies, and sync (colocated, 256 sequences) once as
the reference, on the same seeds; step time, throughput, fraction of the bubble-free bound
(:func:`paper.bound`) and DORA's GPU-time shares are written to
``bench/results/paper-staleness-<UTC>.json``. Not a re-sweep per ``S``: the layout is held fixed so
that only the bound moves.

Usage::

    .venv/bin/python bench/paper_staleness.py [--seeds 0 1] [--workers 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paper
from provenance import provenance, write_result

GPUS, ROLLOUT, RBS, SEQS, TRAIN_MFU = 64, 40, 2.0, 256, 0.40


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    prov = provenance()
    w, eff = paper.Workload(), replace(paper.Efficiencies(), train_mfu=TRAIN_MFU)
    sync = paper.Setting("sync", 0, 1.0, GPUS, GPUS, colocated=True, max_num_seqs=SEQS)
    settings = [sync] + [paper.Setting("dora", s, RBS, ROLLOUT, GPUS - ROLLOUT, max_num_seqs=SEQS, repartition=pol)
                         for s in (1, 2, 3, 4) for pol in ("migrate", "drain")]
    runs = paper.run_many([(st, w, eff, seed) for st in settings for seed in a.seeds], a.workers)
    bound = paper.bound(GPUS, w, eff)
    out: dict[str, Any] = {**prov, "engine": "simulated (hardware_costs: H800, Qwen2.5-32B)", "gpus": GPUS,
                           "train_mfu": TRAIN_MFU, "seeds": a.seeds, "bound": bound, "settings": {}}
    n = len(a.seeds)
    sync_step = statistics.fmean(r["step_time_s"] for r in runs[:n])
    for i, st in enumerate(settings):
        mine = runs[i * n:(i + 1) * n]
        thr = statistics.fmean(r["throughput"] for r in mine)
        step = statistics.fmean(r["step_time_s"] for r in mine)
        shares = paper.mean_shares(mine)
        out["settings"][st.name] = {"staleness": st.staleness, "repartition": st.repartition,
                                    "step_time_s": step, "throughput": thr, "vs_sync": sync_step / step,
                                    "fraction_of_bound": thr / bound["tokens_per_s"],
                                    "max_staleness_seen": max(r["max_staleness"] for r in mine),
                                    "refused": sum(r["refused"] for r in mine), "gpu_time_share": shares,
                                    "runs": mine}
        print(f"{st.name:55s} step {step:7.1f}s  vs sync {sync_step / step:5.2f}x  "
              f"bound {thr / bound['tokens_per_s']:.2f}  intra-bubble {shares['intra_instance_bubble']:.2f}  "
              f"trainer wait {shares['trainer_wait']:.2f}")
    path = write_result("paper-staleness", out, a.out)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
