"""Partial rollout held to DORA's bound, on the paper's setup at 64 GPUs and TP 4 (simulated): a first probe.

The headline (``bench/simulate.py --paper``) compared DORA at S = 2 with a partial rollout whose staleness was
unbounded. This probe sweeps the bounded ``partial`` (decision 0047) at DORA's S = 2 over as many settings as
DORA's sweep has (split 32 / 40 / 48 rollout GPUs x RBS 1.5 / 2 / 3 / 4 x TBS x ``max_num_seqs`` 128 / 256: 24,
as DORA's 3 x 2 x 2 x 2 policies), picks its best on seed 0 as the headline picked everyone's, then runs it,
DORA's and the unbounded partial's chosen settings (read from the committed headline) on seeds 0-2 in this
invocation, with ``train_mfu`` 0.40 (the TP-4 headline's fit). It is a probe, not issue 29's measurement
(seeds 3-5 reported, TP 8, 128 GPUs, the paired bootstrap come with it).

Usage::

    python bench/partial_bounded.py        # ~3 min on 2 cores -> bench/results/partial-bounded-<time>.json + .png
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from paper import Efficiencies, Setting, Workload, bound, run_many
from provenance import provenance, write_result

HEADLINE = Path(__file__).resolve().parent / "results" / "paper-sim-20261125-012446.json"
GPUS, S, MFU, SEEDS = 64, 2, 0.40, [0, 1, 2]


def bounded_sweep() -> list[Setting]:
    return [Setting("partial_bounded", S, f, r, GPUS - r, max_num_seqs=n)
            for r in (GPUS // 2, 5 * GPUS // 8, 3 * GPUS // 4) for f in (1.5, 2.0, 3.0, 4.0) for n in (128, 256)]


def headline_choice(label: str) -> Setting:
    """The setting the committed headline chose for ``label`` at 64 GPUs."""
    return Setting(**json.loads(HEADLINE.read_text())["results"][str(GPUS)]["chosen"][label])


def main() -> int:
    t0 = time.time()
    w, eff = Workload(), replace(Efficiencies(), train_mfu=MFU)
    sweep = bounded_sweep()
    on_seed0 = run_many([(st, w, eff, 0) for st in sweep], workers=2)
    tried = {st.name: r["throughput"] for st, r in zip(sweep, on_seed0, strict=True)}
    best = max(sweep, key=lambda st: tried[st.name])
    finalists = {"dora": headline_choice("dora"), "partial_unbounded": headline_choice("partial"), "partial": best}
    jobs = [(st, w, eff, seed) for st in finalists.values() for seed in SEEDS]
    runs = run_many(jobs, workers=2)
    out: dict[str, Any] = {**provenance(), "engine": "simulated (hardware_costs: H800, Qwen2.5-32B)", "gpus": GPUS,
                           "staleness": S, "train_mfu": MFU, "seeds": SEEDS, "sweep_seed0": tried, "modes": {}}
    for k, (label, st) in enumerate(finalists.items()):
        mine = runs[k * len(SEEDS):(k + 1) * len(SEEDS)]
        out["modes"][label] = {"setting": st.name, "throughput": [r["throughput"] for r in mine],
                               "throughput_mean": statistics.fmean(r["throughput"] for r in mine),
                               "max_staleness": max(r["max_staleness"] for r in mine),
                               "c1_breaks": sum(r["c1_breaks"] for r in mine),
                               "gpu_time_share": {k: statistics.fmean(r["gpu_time_share"][k] for r in mine)
                                                  for k in mine[0]["gpu_time_share"]}}
    thr = {k: v["throughput_mean"] for k, v in out["modes"].items()}
    out["bound"] = bound(GPUS, w, eff)
    out["ratios"] = {"dora_vs_partial": thr["dora"] / thr["partial"],
                     "dora_vs_partial_unbounded": thr["dora"] / thr["partial_unbounded"],
                     "partial_vs_partial_unbounded": thr["partial"] / thr["partial_unbounded"]}
    out["sim_seconds"] = round(time.time() - t0, 1)
    path = write_result("partial-bounded", out)
    plot(out, path.with_suffix(".png"))
    print(json.dumps({"modes": {k: (v["setting"], round(v["throughput_mean"])) for k, v in out["modes"].items()},
                      "ratios": out["ratios"], "file": str(path)}, indent=1))
    return 0


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = list(out["modes"])
    for i, k in enumerate(labels):
        ys = out["modes"][k]["throughput"]
        ax.bar(i, statistics.fmean(ys), color=("tab:blue", "tab:gray", "tab:orange")[i])
        ax.scatter([i] * len(ys), ys, color="black", s=10, zorder=3)
    ax.set_xticks(range(len(labels)), [f"{k}\n{out['modes'][k]['setting']}" for k in labels], fontsize=6)
    ax.set(ylabel="trained tokens / s", title=f"64 H800, TP 4, S = {out['staleness']} (seeds 0-2; commit "
                                              f"{str(out.get('commit', ''))[:7]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
