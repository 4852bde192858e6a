"""What keeping C1 can be worth against partial rollout held to the same bound (issue 29, decision 0073).

Partial rollout held to S may do everything a scheduler keeping C1 does, and also continue a trajectory under
newer weights. Its one cost that a C1 scheduler avoids is the re-prefill of a trajectory that changes version (its
KV was computed by other weights). So partial rollout with that cost taken away (``kv_across_versions``: a version
change is charged as a KV move, as DORA's same-version moves are) is the **ceiling** of any C1 scheduler under the
same dispatch, feasibility and planning rules: DORA with a perfect re-partition, and DORA with a second resident
version at no memory or step-time cost.

For each scale, on the reported seeds (3-5 of ``bench/scheduler.py``'s protocol, or ``--report-seeds``), the
settings its committed results chose on seeds 0-2 (``CHOSEN``): DORA, the bounded partial, and the bounded partial
at the ceiling. Reported: DORA / partial, ceiling / partial, DORA / ceiling, each with the paired 95% interval over
the seeds. The same for ``bench/modes``' 2-instance workload, simulated on a committed result's reported runs
(``modes_ceiling``).

Usage::

    python bench/c1_ceiling.py          # ~80 s on 2 cores -> bench/results/c1-ceiling-<time>.json + .png
    python bench/c1_ceiling.py --report-seeds 6 7 8 9 10 11 --modes-result modes-20261128-154409.json
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

from paper import Efficiencies, Setting, Workload, run_many
from provenance import provenance, write_result
from scheduler import HOP_US, MFU, REPORT, S, paired_ratio_interval

RESULTS = Path(__file__).resolve().parent / "results"
CHOSEN = {
    64: ("scheduler-20261129-002523.json",
         Setting("dora", S, 2.0, 40, 24, max_num_seqs=256, repartition="consolidate", tp=8,
                 hop_latency_s=HOP_US * 1e-6),
         Setting("partial_bounded", S, 2.0, 40, 24, max_num_seqs=256, tp=8, hop_latency_s=HOP_US * 1e-6)),
    128: ("scheduler-20261128-221053.json",
          Setting("dora", S, 3.0, 80, 48, max_num_seqs=256, repartition="consolidate", tp=8,
                  hop_latency_s=HOP_US * 1e-6),
          Setting("partial_bounded", S, 2.0, 80, 48, max_num_seqs=256, tp=8, hop_latency_s=HOP_US * 1e-6)),
}
"""Per GPU count: the committed result whose chosen settings these are, DORA's choice, the bounded partial's."""
MODES = "modes-20261201-231543.json"
"""The current ``bench/modes`` result (``bench/README.md``)."""


def check_chosen(gpus: int) -> None:
    """The settings here are the ones the committed result chose (its ``modes``' setting names)."""
    name, dora, partial = CHOSEN[gpus]
    modes = json.loads((RESULTS / name).read_text())["modes"]
    for label, st in (("dora", dora), ("partial", partial)):
        if modes[label]["setting"] != st.name:
            raise SystemExit(f"{name} chose {modes[label]['setting']!r} for {label}, not {st.name!r}")


def measure(gpus: int, w: Workload, eff: Efficiencies, seeds: tuple[int, ...]) -> dict[str, Any]:
    _, dora, partial = CHOSEN[gpus]
    settings = {"dora": dora, "partial": partial, "ceiling": replace(partial, kv_across_versions=True)}
    runs = run_many([(st, w, eff, s) for st in settings.values() for s in seeds], workers=2)
    out: dict[str, Any] = {"modes": {}}
    for k, (label, st) in enumerate(settings.items()):
        mine = runs[k * len(seeds):(k + 1) * len(seeds)]
        out["modes"][label] = {"setting": st.name, "throughput": [r["throughput"] for r in mine],
                               "throughput_mean": statistics.fmean(r["throughput"] for r in mine),
                               "re_prefill_share": statistics.fmean(r["gpu_time_share"]["re_prefill"] for r in mine),
                               "kv_move_share": statistics.fmean(r["gpu_time_share"]["kv_move"] for r in mine),
                               "c1_breaks": sum(r["c1_breaks"] for r in mine),
                               "max_staleness": max(r["max_staleness"] for r in mine)}
    out["ratios"] = ratios({k: v["throughput"] for k, v in out["modes"].items()})
    return out


def ratios(thr: dict[str, list[float]]) -> dict[str, dict[str, Any]]:
    """DORA / partial, ceiling / partial, DORA / ceiling: the ratio of means and its paired interval over seeds."""
    return {f"{a}_vs_{b}": {"mean": statistics.fmean(thr[a]) / statistics.fmean(thr[b]),
                            "interval": paired_ratio_interval(thr[a], thr[b])}
            for a, b in (("dora", "partial"), ("ceiling", "partial"), ("dora", "ceiling"))}


def modes_ceiling(name: str) -> dict[str, Any]:
    """``bench/modes``' workload (2 instances): its reported runs simulated again, the bounded partial's also at
    the ceiling (on its own runs' ids, so the same request lengths); DORA / ceiling paired by seed as
    ``bench/modes`` pairs DORA and partial."""
    from modes import mode_config, simulate_same

    result = json.loads((RESULTS / name).read_text())
    best, steps = result["best"], result["steps"]
    sims: dict[str, list[float]] = {"dora": [], "partial": [], "ceiling": []}
    for label, mode, ceiling in (("dora", "dora", False), ("partial", "partial_bounded", False),
                                 ("ceiling", "partial_bounded", True)):
        for r in best[mode]["runs"]:
            cfg = mode_config(mode, steps, best[mode]["setting"], r["seed"])
            sim = simulate_same(cfg, r["mean_prompt_tokens"], r["run_id"], kv_across_versions=ceiling)
            sims[label].append(sim["throughput_tokens_per_s"])
    recorded = {label: [r["simulated"]["throughput_tokens_per_s"] for r in best[mode]["runs"]]
                for label, mode in (("dora", "dora"), ("partial", "partial_bounded"))}
    return {"from": name, "seeds": [r["seed"] for r in best["dora"]["runs"]], "simulated": sims,
            "recorded_simulated": recorded, "ratios": ratios(sims)}


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labels = ("partial", "dora", "ceiling")
    for i, gpus in enumerate(out["gpus"]):
        modes = out["results"][str(gpus)]["modes"]
        base = modes["partial"]["throughput_mean"]
        for j, label in enumerate(labels):
            vals = [t / base for t in modes[label]["throughput"]]
            x = i * 4 + j
            ax.bar(x, statistics.fmean(vals), color=("#888", "#1f77b4", "#2ca02c")[j],
                   label=label if i == 0 else None)
            ax.plot([x] * len(vals), vals, "k.", ms=4)
    ax.set_xticks([i * 4 + 1 for i in range(len(out["gpus"]))], [f"{g} GPUs" for g in out["gpus"]])
    ax.set_ylim(0.9, 1.06)
    ax.axhline(1.0, color="k", lw=0.5)
    seeds = out["report_seeds"]
    ax.set_ylabel(f"trained tokens/s / bounded partial (seeds {seeds[0]}-{seeds[-1]})")
    ax.set_title("C1's ceiling: partial held to S = 2 without its re-prefill")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="the ceiling of a C1 scheduler against partial rollout (module docstring)")
    ap.add_argument("--gpus", type=int, nargs="+", default=[64, 128], choices=sorted(CHOSEN))
    ap.add_argument("--modes-result", default=MODES, help="bench/modes result whose reported runs to simulate")
    ap.add_argument("--report-seeds", type=int, nargs="+", default=list(REPORT),
                    help="seeds to report (settings stay those chosen on seeds 0-2); default 3 4 5")
    args = ap.parse_args(argv)
    seeds = tuple(args.report_seeds)
    t0 = time.time()
    w, eff = Workload(), replace(Efficiencies(), train_mfu=MFU)
    out: dict[str, Any] = {**provenance(), "engine": "simulated (hardware_costs: H800, Qwen2.5-32B)",
                           "staleness": S, "train_mfu": MFU, "report_seeds": seeds, "gpus": args.gpus, "results": {}}
    for gpus in args.gpus:
        check_chosen(gpus)
        out["results"][str(gpus)] = {"chosen_by": CHOSEN[gpus][0], **measure(gpus, w, eff, seeds)}
        r = out["results"][str(gpus)]["ratios"]
        print(f"{gpus} GPUs: " + ", ".join(f"{k} {v['mean']:.3f} [{v['interval'][0]:.3f}, {v['interval'][1]:.3f}]"
                                           for k, v in r.items()), flush=True)
    out["bench_modes"] = modes_ceiling(args.modes_result)
    r = out["bench_modes"]["ratios"]
    print("bench/modes (simulated): " + ", ".join(f"{k} {v['mean']:.3f} [{v['interval'][0]:.3f}, "
                                                  f"{v['interval'][1]:.3f}]" for k, v in r.items()), flush=True)
    out["wall_seconds"] = round(time.time() - t0)
    path = write_result("c1-ceiling", out)
    plot(out, path.with_suffix(".png"))
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
