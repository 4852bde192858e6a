"""Beyond the paper, the scale axis: the paper's setup at 64 to 2,048+ H800, load per GPU held fixed.

Weak scaling: at ``N`` GPUs the batch is ``TBS = 128 N`` trajectories (the paper's 8,192 at 64 GPUs), the
layouts are the 64-GPU sweep's choices (``bench/simulate.py --paper --fit``,
``bench/results/paper-sim-20261124-094430.json``) scaled in proportion — sync colocated on all ``N`` GPUs;
one-step off-policy, partial rollout and DORA (S = 2, RBS 2x TBS) on ``5N/8`` rollout + ``3N/8`` trainer
GPUs, 256 sequences — and ``train_mfu`` stays the fitted 0.40. DORA runs under both re-partition policies
(``migrate`` and ``drain``, decision 0029), since which one wins changes with scale. Not a re-sweep per
size: every cluster size gets the same per-GPU shape, so what moves is what scale itself changes (more
instances per version, more cap-length responses per batch).

Per run: step time and throughput over the steady steps (:func:`paper.figures`), the fraction of the
bubble-free bound at that size (:func:`paper.bound`, formula in ``bench/paper.py``) and what holds each
mode back (:func:`paper.held_back_by`). Simulation cost grows linearly with the trajectories simulated
(since decision 0035; a DORA run at 512 GPUs, 6 steps: 0.38 s per 1,000 with a second simulation running
beside it on 2 cores), so the default is one seed and 8 steps (4 steady) per run; ``--seeds`` adds more.

Usage::

    .venv/bin/python bench/paper_scale.py [--gpus 64 512 1024 2048] [--seeds 0] [--workers 2]
        [--steps 8] [--policies migrate drain consolidate]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paper
from provenance import provenance, write_result

TRAIN_MFU = 0.40
"""Fitted on the 64-GPU rows (``paper-sim-20261124-094430.json``), frozen."""

PER_GPU_TBS = 128
"""Trajectories per step per GPU: the paper's 512 prompts x 16 samples on 64 GPUs."""


RBS_OF_POLICY = {"migrate": 2.0, "drain": 2.0, "consolidate": 3.0}
"""DORA's RBS (x TBS) per re-partition policy: its 64-GPU choice (``consolidate``: ``bench/scheduler.py``,
``scheduler-20261127-001554.json``; the others: the headline)."""


def layouts(gpus: int, policies: tuple[str, ...] = ("migrate", "drain")) -> list[paper.Setting]:
    """Each mode's 64-GPU choice, scaled to ``gpus`` (module docstring); DORA under each of ``policies``; with
    ``consolidate`` among them, also partial rollout held to DORA's S at its 64-GPU choice (RBS 1.5x)."""
    r = 5 * gpus // 8
    bounded = ([paper.Setting("partial_bounded", 2, 1.5, r, gpus - r, max_num_seqs=256)]
               if "consolidate" in policies else [])
    return [paper.Setting("sync", 0, 1.0, gpus, gpus, colocated=True, max_num_seqs=256),
            paper.Setting("one_step_off", 1, 2.0, r, gpus - r, max_num_seqs=256),
            paper.Setting("partial", 0, 2.0, r, gpus - r, max_num_seqs=256), *bounded,
            *(paper.Setting("dora", 2, RBS_OF_POLICY[p], r, gpus - r, max_num_seqs=256, repartition=p)
              for p in policies)]


def summarize(gpus: int, st: paper.Setting, runs: list[dict[str, Any]], bound: dict[str, Any],
              sync_step: float) -> dict[str, Any]:
    """Mean and spread over seeds of one setting at one size, against sync and the bound."""
    thr = paper.mean_spread(runs, "throughput")
    step = statistics.fmean(r["step_time_s"] for r in runs)
    shares = paper.mean_shares(runs)
    return {"gpus": gpus, "setting": st.name, "mode": st.mode, "repartition": st.repartition,
            "step_time_s": step, "throughput": thr,
            "step_vs_sync": sync_step / step, "fraction_of_bound": thr["mean"] / bound["tokens_per_s"],
            "gpu_time_share": shares, "held_back_by": paper.held_back_by(shares),
            "max_staleness": max(r["max_staleness"] for r in runs), "c1_breaks": sum(r["c1_breaks"] for r in runs),
            "runs": runs}


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def label(row: dict[str, Any]) -> str:
        return f"dora {row['repartition']}" if row["mode"] == "dora" else str(row["mode"])

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5))
    for name in dict.fromkeys(label(row) for row in out["rows"]):
        rows = [row for row in out["rows"] if label(row) == name]
        ax.plot([r["gpus"] for r in rows], [r["fraction_of_bound"] for r in rows], marker="o", label=name)
        bx.plot([r["gpus"] for r in rows], [r["step_time_s"] for r in rows], marker="o", label=name)
    for a, title in ((ax, "fraction of the bubble-free bound"), (bx, "step time (simulated s)")):
        a.set_xscale("log", base=2)
        a.set_xlabel("H800 GPUs (TBS = 128 per GPU)")
        a.set_title(title)
        a.legend(fontsize=8)
    fig.suptitle("SIMULATED: the paper's setup at scale (Qwen2.5-32B, DAPO-Math-like lengths, 64-GPU layouts scaled)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, nargs="+", default=[64, 512, 1024, 2048])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--policies", nargs="+", choices=("migrate", "drain", "consolidate"),
                    default=["migrate", "drain"],
                    help="DORA's re-partition policies (migrate collapses from 512 GPUs on: report 0032)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    prov = provenance()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target = a.out or str(Path(__file__).resolve().parent / "results" / f"paper-scale-{stamp}.json")
    eff = replace(paper.Efficiencies(), train_mfu=TRAIN_MFU)
    out: dict[str, Any] = {**prov, "engine": "simulated (hardware_costs: H800, Qwen2.5-32B)", "args": vars(a),
                           "train_mfu": TRAIN_MFU, "per_gpu_tbs": PER_GPU_TBS, "rows": [], "bounds": {},
                           "sim_seconds": {}}
    path = Path(target)
    for gpus in a.gpus:
        t0 = time.perf_counter()
        w = replace(paper.Workload(), tbs=PER_GPU_TBS * gpus, steps=a.steps, warmup=a.steps // 2)
        sts = layouts(gpus, tuple(a.policies))
        runs = paper.run_many([(st, w, eff, seed) for st in sts for seed in a.seeds], a.workers)
        bound = paper.bound(gpus, w, eff)
        out["bounds"][str(gpus)] = bound
        n = len(a.seeds)
        sync_step = statistics.fmean(r["step_time_s"] for r in runs[:n])
        for i, st in enumerate(sts):
            row = summarize(gpus, st, runs[i * n:(i + 1) * n], bound, sync_step)
            out["rows"].append(row)
            cause, share = next(iter(row["held_back_by"].items()))
            print(f"{gpus:5d} GPUs {st.name:52s} step {row['step_time_s']:7.1f}s  vs sync {row['step_vs_sync']:5.2f}x"
                  f"  {row['fraction_of_bound']:.2f} of the bound  most lost: {cause} {share:.0%}", flush=True)
        out["sim_seconds"][str(gpus)] = time.perf_counter() - t0
        path = write_result("paper-scale", out, target)  # after every size: a long run keeps what it measured
    plot(out, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
