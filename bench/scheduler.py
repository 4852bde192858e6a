"""Issue 29's scheduler measurement at 64 (or 128) GPUs, TP 4 (or 4 and 8; the simulated paper setup): DORA's
re-partition policies against partial rollout held to the same bound, chosen on seeds 0-2, reported on seeds
3-5, with an ablation of each ``consolidate`` rule.

Sweeps of equal size (24 settings each, every one on seeds 0-2; the best mean is chosen):

* DORA, S = 2: policy ``drain`` / ``consolidate`` x split 32 / 40 / 48 rollout GPUs x RBS 2 / 3 x TBS x
  ``max_num_seqs`` 128 / 256;
* partial held to S = 2 (``partial``, decision 0047): split x RBS 1.5 / 2 / 3 / 4 x TBS x ``max_num_seqs``;
* the paper's colocated, Kimi-style partial held to S = 2 (``colocated``: all GPUs generate, then all train, generation
  paused meanwhile; unfinished trajectories resume under the new weights): RBS 1 / 1.25 / 1.5 / 2 / 3 / 4 x TBS x
  ``max_num_seqs`` 64 / 128 / 192 / 256.

The unbounded partial runs at the committed headline's choice, reported with its staleness; the colocated
choice also runs with its KV cache kept through training (``keeps_kv``, an upper bound: the sweep's colocated
frees it, as verl and Kimi do). Then the chosen
settings run on seeds 3-5, and DORA's ``consolidate`` choice with each rule switched in turn: KV moves off (the
engine re-prefills), KV-aware packing off (``instance_kv_tokens = 0``: packing counts the engine's slots),
levelling off, the due version not packed (freeing its empty instances, as before decision 0074), KV-capped
admission on (off by default, decision 0048), and old versions packed at the average busy context rather than at
the cap (decision 0074).
Beside the bound (the best layout, colocated here) each result records the chosen DORA and bounded partial settings'
own split's bound and the best disaggregated one (``layout_bounds``, decision 0081).
The DORA / partial ratio's interval is a paired bootstrap over the reported seeds (ratio of means,
seeds resampled together). ``train_mfu`` 0.40 (the TP-4 headline's fit), cost parameters as frozen in
``dora_rl/core/hardware_costs.py`` plus the KV move's cost (bytes over the network).

Usage::

    python bench/scheduler.py [--gpus 128] [--tps 4 8]   # ~13 min (64, TP 4) on 2 cores
    # -> bench/results/scheduler-<time>.json + .png
"""

from __future__ import annotations

import json
import random
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
S, MFU = 2, 0.40
CHOOSE, REPORT = [0, 1, 2], [3, 4, 5]
COLOCATED_RBS = (1.0, 1.25, 1.5, 2.0, 3.0, 4.0)
"""The colocated partial's over-provisioning sweep (with 4 ``max_num_seqs``: 24 settings a TP, as the others)."""
ABLATIONS = ("kv_moves_off", "kv_slots_off", "levelling_off", "level_by_count", "unpack_due",
             "kv_admission_on", "pack_avg")


HOP_US = 0.5
"""The all-reduce hop latency at TP 8 (report 0041: the most the frozen TP-4 overhead allows)."""


def hop_s(tp: int) -> float:
    """The all-reduce hop latency the sweeps give TP ``tp`` (none at the recipe's TP 4)."""
    return 0.0 if tp == 4 else HOP_US * 1e-6


def sweeps(gpus: int, tps: tuple[int, ...] = (4,)) -> dict[str, list[Setting]]:
    """Each mode's settings, at every TP of ``tps`` (the same count per mode)."""
    splits = (gpus // 2, 5 * gpus // 8, 3 * gpus // 4)
    hop = {tp: hop_s(tp) for tp in tps}
    dora = [Setting("dora", S, f, r, gpus - r, max_num_seqs=n, repartition=pol, tp=tp, hop_latency_s=hop[tp])
            for tp in tps for pol in ("drain", "consolidate") for r in splits if r % tp == 0
            for f in (2.0, 3.0) for n in (128, 256)]
    partial = [Setting("partial_bounded", S, f, r, gpus - r, max_num_seqs=n, tp=tp, hop_latency_s=hop[tp])
               for tp in tps for r in splits if r % tp == 0 for f in (1.5, 2.0, 3.0, 4.0) for n in (128, 256)]
    colocated = [Setting("partial_bounded", S, f, gpus, gpus, colocated=True, max_num_seqs=n, tp=tp,
                         hop_latency_s=hop[tp])
                 for tp in tps for f in COLOCATED_RBS for n in (64, 128, 192, 256)]
    return {"dora": dora, "partial": partial, "colocated": colocated}


def unbounded_choice(gpus: int) -> Setting:
    return Setting(**json.loads(HEADLINE.read_text())["results"][str(gpus)]["chosen"]["partial"])


def paired_ratio_interval(a: list[float], b: list[float], resamples: int = 10_000) -> tuple[float, float]:
    """95% interval of ``mean(a) / mean(b)`` over seeds resampled in pairs."""
    rng, n, ratios = random.Random(0), len(a), []
    for _ in range(resamples):
        idx = [rng.randrange(n) for _ in range(n)]
        ratios.append(sum(a[i] for i in idx) / sum(b[i] for i in idx))
    ratios.sort()
    return ratios[int(0.025 * resamples)], ratios[int(0.975 * resamples) - 1]


def summary(runs: list[dict[str, Any]], setting: Setting) -> dict[str, Any]:
    return {"setting": setting.name, "throughput": [r["throughput"] for r in runs],
            "throughput_mean": statistics.fmean(r["throughput"] for r in runs),
            "max_staleness": max(r["max_staleness"] for r in runs), "c1_breaks": sum(r["c1_breaks"] for r in runs),
            "gpu_time_share": {k: statistics.fmean(r["gpu_time_share"][k] for r in runs)
                               for k in runs[0]["gpu_time_share"]},
            "intra_bubble_by_state": {k: statistics.fmean(r["intra_bubble_by_state"].get(k, 0.0) for r in runs)
                                      for k in sorted({k for r in runs for k in r["intra_bubble_by_state"]})}}


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="issue 29's scheduler measurement (module docstring)")
    ap.add_argument("--gpus", type=int, default=64, choices=(64, 128))
    ap.add_argument("--tps", type=int, nargs="+", default=[4], choices=(4, 8), help="rollout TPs swept")
    args = ap.parse_args(argv)
    gpus, tps = args.gpus, tuple(args.tps)
    t0 = time.time()
    w, eff = Workload(), replace(Efficiencies(), train_mfu=MFU)
    grids = sweeps(gpus, tps)
    out: dict[str, Any] = {**provenance(), "engine": "simulated (hardware_costs: H800, Qwen2.5-32B)", "gpus": gpus,
                           "tps": list(tps), "staleness": S, "train_mfu": MFU, "choose_seeds": CHOOSE,
                           "report_seeds": REPORT, "sweep": {}, "modes": {}, "ablation": {}}
    chosen: dict[str, Setting] = {}
    for label, grid in grids.items():
        runs = run_many([(st, w, eff, s) for st in grid for s in CHOOSE], workers=2)
        means = {st.name: statistics.fmean(r["throughput"] for r in runs[i * len(CHOOSE):(i + 1) * len(CHOOSE)])
                 for i, st in enumerate(grid)}
        out["sweep"][label] = means
        chosen[label] = max(grid, key=lambda st: means[st.name])
        print(f"{label}: chose {chosen[label].name} ({means[chosen[label].name]:.0f} tok/s on seeds 0-2)", flush=True)
        save_partial(out)
    chosen["partial_unbounded"] = unbounded_choice(gpus)
    best_consolidate = max((st for st in grids["dora"] if st.repartition == "consolidate"),
                           key=lambda st: out["sweep"]["dora"][st.name])
    chosen["dora_consolidate"] = best_consolidate
    chosen["colocated_kv_kept"] = replace(chosen["colocated"], keeps_kv=True)
    jobs = [(st, w, eff, s) for st in chosen.values() for s in REPORT]
    runs = run_many(jobs, workers=2)
    for k, (label, st) in enumerate(chosen.items()):
        out["modes"][label] = summary(runs[k * len(REPORT):(k + 1) * len(REPORT)], st)
    out["ablation"] = ablation(best_consolidate, w, eff)
    thr = {k: v["throughput"] for k, v in out["modes"].items()}
    mean = {k: statistics.fmean(v) for k, v in thr.items()}
    out["bound"] = max((bound(gpus, w, eff, tp=tp, hop_latency_s=hop_s(tp)) for tp in tps),
                       key=lambda b: b["tokens_per_s"])  # the best over the TPs swept
    out["layout_bounds"] = layout_bounds(gpus, w, eff, chosen)
    out["ratios"] = {"dora_vs_partial": mean["dora"] / mean["partial"],
                     "dora_vs_partial_interval": paired_ratio_interval(thr["dora"], thr["partial"]),
                     "dora_vs_partial_unbounded": mean["dora"] / mean["partial_unbounded"],
                     "dora_fraction_of_bound": mean["dora"] / out["bound"]["tokens_per_s"],
                     "dora_vs_colocated": mean["dora"] / mean["colocated"],
                     "dora_vs_colocated_interval": paired_ratio_interval(thr["dora"], thr["colocated"]),
                     "dora_vs_colocated_kv_kept": mean["dora"] / mean["colocated_kv_kept"],
                     "colocated_fraction_of_bound": mean["colocated"] / out["bound"]["tokens_per_s"],
                     "dora_fraction_of_its_layout_bound": mean["dora"] / out["layout_bounds"]["dora"],
                     "partial_fraction_of_its_layout_bound": mean["partial"] / out["layout_bounds"]["partial"],
                     "consolidate_vs_partial": mean["dora_consolidate"] / mean["partial"],
                     "consolidate_vs_partial_interval": paired_ratio_interval(thr["dora_consolidate"],
                                                                              thr["partial"])}
    out["sim_seconds"] = round(time.time() - t0, 1)
    path = write_result("scheduler", out)
    plot(out, path.with_suffix(".png"))
    print(json.dumps({"modes": {k: (v["setting"], round(v["throughput_mean"])) for k, v in out["modes"].items()},
                      "ablation": {k: round(v["throughput_mean"]) for k, v in out["ablation"].items()},
                      "ratios": out["ratios"], "file": str(path)}, indent=1))
    return 0


def layout_bounds(gpus: int, w: Workload, eff: Efficiencies, chosen: dict[str, Setting]) -> dict[str, Any]:
    """The bubble-free bound of each chosen disaggregated setting's own split and TP (what no scheduler at that
    split can pass), and the best disaggregated layout's bound over the TPs 4 and 8: the most any
    disaggregated mode could reach, whatever its scheduler."""
    per_tp = {tp: bound(gpus, w, eff, tp=tp, hop_latency_s=hop_s(tp))["layouts"] for tp in (4, 8)}
    out: dict[str, Any] = {label: per_tp[st.tp][f"{st.rollout_gpus}r+{gpus - st.rollout_gpus}t"]
                           for label, st in chosen.items() if label in ("dora", "partial")}
    out["best_disaggregated"] = max(v for layouts in per_tp.values() for k, v in layouts.items() if k != "colocated")
    return out


def save_partial(out: dict[str, Any]) -> None:
    """The sweeps so far, so a crash later in a long run loses none of them (overwritten at each sweep)."""
    import tempfile

    path = Path(tempfile.gettempdir()) / f"scheduler-{out['gpus']}-partial.json"
    path.write_text(json.dumps(out, indent=1))
    print(f"sweeps so far: {path}", flush=True)


def ablation(st: Setting, w: Workload, eff: Efficiencies) -> dict[str, Any]:
    """``st`` (a ``consolidate`` setting) on the reported seeds with each rule off in turn."""
    out: dict[str, Any] = {}
    for which in ABLATIONS:
        jobs = [(replace(st, ablate=which), w, eff, s) for s in REPORT]
        runs = run_many(jobs, workers=2)
        out[which] = summary(runs, jobs[0][0])
    return out


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = {**out["modes"], **{f"consolidate, {k}": v for k, v in out["ablation"].items()}}
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, (k, v) in enumerate(rows.items()):
        ax.bar(i, v["throughput_mean"], color="tab:blue" if k.startswith(("dora", "consolidate")) else "tab:gray")
        ax.scatter([i] * len(v["throughput"]), v["throughput"], color="black", s=10, zorder=3)
    ax.axhline(out["bound"]["tokens_per_s"], color="tab:red", ls="--", lw=1, label="bubble-free bound")
    ax.set_xticks(range(len(rows)), [f"{k}\n{v['setting']}" for k, v in rows.items()], fontsize=5, rotation=20,
                  ha="right")
    tps = "/".join(map(str, out.get("tps", [4])))
    title = (f"{out['gpus']} H800, TP {tps}, S = {out['staleness']}, seeds 3-5 (chosen on 0-2); "
             f"commit {str(out.get('commit', ''))[:7]}")
    ax.set(ylabel="trained tokens / s", title=title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
