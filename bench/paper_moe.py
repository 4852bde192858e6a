"""Beyond the paper, the MoE-imbalance axis: the paper's 64-H800 setup with rollout instances of unequal speed.

In an expert-parallel MoE instance a step waits for its most loaded expert's GPU, so instances run at different
speeds. The emulated model's ``instance_speed_sigma`` (``dora_rl/core/emulation.py``, "instance imbalance")
makes instance ``i`` compute ``f_i = exp(sigma z_i + sigma^2 / 2)`` times as slowly, ``z_i ~ N(0, 1)``: its
speed ``1 / f_i`` is log-normal with mean 1, so the fleet computes as much as the dense one in expectation
and the bubble-free bound (:func:`paper.bound`, formula in ``bench/paper.py``) is the dense bound. The
realized mean speed of each run's instances is recorded (``instance_speeds``): with 10 instances it is not
exactly 1, and neither is the ratio of the fastest to the slowest (``speed_ratio``, recorded too). The spread
is an assumption, not a calibration (no MoE model runs here): ``--sigmas`` sweeps it.

Layouts, ``train_mfu`` and the workload are ``bench/paper_scale.py``'s at 64 GPUs (sync colocated; one-step
off-policy, partial rollout and DORA S=2 ``drain`` on 40 rollout + 24 trainer GPUs, RBS 2x TBS, 256
sequences), the same for every sigma; each figure is the mean and spread over ``--seeds``.

Usage: ``python bench/paper_moe.py [--sigmas 0 0.15 0.3] [--seeds 0 1 2] [--steps 12] [--workers 2]``
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
import paper_scale
from provenance import provenance, write_result

from dora_rl.core.emulation import instance_factor

GPUS = 64


def settings() -> list[paper.Setting]:
    """paper_scale's 64-GPU layouts, DORA under the default policy (``drain``) only."""
    return [s for s in paper_scale.layouts(GPUS) if not (s.mode == "dora" and s.repartition == "migrate")]


def speeds(setting: paper.Setting, w: paper.Workload, eff: paper.Efficiencies, seed: int) -> dict[str, float]:
    """The realized speeds (``1 / f_i``) of the setting's rollout instances: their mean and fastest / slowest."""
    p = w.params(eff, seed)
    v = [1.0 / instance_factor(i, p) for i in range(setting.rollout_gpus // paper.TP)]
    return {"mean_speed": statistics.fmean(v), "speed_ratio": max(v) / min(v)}


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5))
    for mode in dict.fromkeys(r["mode"] for r in out["rows"]):
        rows = [r for r in out["rows"] if r["mode"] == mode]
        ax.errorbar([r["sigma"] for r in rows], [r["fraction_of_bound"] for r in rows], marker="o", label=mode,
                    yerr=[[r["fraction_of_bound"] - r["fraction_of_bound_min"] for r in rows],
                          [r["fraction_of_bound_max"] - r["fraction_of_bound"] for r in rows]], capsize=3)
        bx.plot([r["sigma"] for r in rows], [r["step_vs_sync"] for r in rows], marker="o", label=mode)
    ax.set_title("fraction of the bubble-free bound (mean, min-max over seeds)")
    bx.set_title("step time: sync / mode (same sigma)")
    for a in (ax, bx):
        a.set_xlabel("instance speed spread sigma (0 = dense)")
        a.legend(fontsize=8)
    fig.suptitle("SIMULATED: the paper's 64-H800 setup with unequal instance speeds (MoE-imbalance variant)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sigmas", type=float, nargs="+", default=[0.0, 0.15, 0.3])
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    eff = replace(paper.Efficiencies(), train_mfu=paper_scale.TRAIN_MFU)
    sts = settings()
    base = replace(paper.Workload(), tbs=paper_scale.PER_GPU_TBS * GPUS, steps=a.steps, warmup=a.steps // 2)
    jobs = [(st, replace(base, instance_speed_sigma=sd), eff, seed)
            for sd in a.sigmas for st in sts for seed in a.seeds]
    runs = paper.run_many(jobs, a.workers)
    bound = paper.bound(GPUS, base, eff)
    out: dict[str, Any] = {**provenance(), "engine": "simulated (hardware_costs: H800, Qwen2.5-32B)", "args": vars(a),
                           "gpus": GPUS, "train_mfu": paper_scale.TRAIN_MFU, "bound": bound, "rows": []}
    n = len(a.seeds)
    for i, sd in enumerate(a.sigmas):
        block = runs[i * len(sts) * n:(i + 1) * len(sts) * n]
        sync_step = statistics.fmean(r["step_time_s"] for r in block[:n])
        for j, st in enumerate(sts):
            rs = block[j * n:(j + 1) * n]
            frac = [r["throughput"] / bound["tokens_per_s"] for r in rs]
            row = {"sigma": sd, **paper_scale.summarize(GPUS, st, rs, bound, sync_step),
                   "fraction_of_bound_min": min(frac), "fraction_of_bound_max": max(frac),
                   "instance_speeds": [speeds(st, replace(base, instance_speed_sigma=sd), eff, seed)
                                       for seed in a.seeds]}
            out["rows"].append(row)
            cause, share = next(iter(row["held_back_by"].items()))
            print(f"sigma {sd:4.2f} {st.name:52s} step {row['step_time_s']:7.1f}s  vs sync {row['step_vs_sync']:5.2f}x"
                  f"  {row['fraction_of_bound']:.2f} of the bound  most lost: {cause} {share:.0%}", flush=True)
    out["sim_seconds"] = time.perf_counter() - t0
    path = write_result("paper-moe", out, a.out)
    plot(out, path.with_suffix(".png"))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
