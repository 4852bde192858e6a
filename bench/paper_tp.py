"""Is the paper-setup headline fair in its tensor parallelism? Each mode's chosen setting at TP 4 and TP 8.

``bench/simulate.py --paper`` gives every mode its best split, RBS, ``max_num_seqs`` and (DORA) re-partition
policy, but runs every rollout instance at the DAPO recipe's ``gen_tp = 4``. A sync user whose step waits for
the longest response could pick a larger TP instead: each instance then decodes a sequence faster (its weights
and KV reads spread over more GPUs) and holds more KV per GPU (the weights take a smaller share of each GPU).
This bench re-runs each mode's chosen setting of a committed ``paper-sim`` result (``--from``), same seeds,
same fitted ``train_mfu``, at every TP of ``--tps``, and reports each mode at its best TP next to its TP-4
figure, DORA's ratios against each baseline at its best, and the bubble-free bound over both TPs.

The one cost a datasheet does not give is what the all-reduces cost at TP 8 instead of 4
(``hardware_costs.step_overhead_s``: the frozen TP-4 overhead plus the change of a ring all-reduce, 2 per layer,
``2 (TP - 1)`` hops of ``hop_latency_s`` and ``2 (TP - 1) / TP`` of the message over NVLink). It is swept
(``--hops``, microseconds), not fitted. The frozen 3 ms at TP 4 bounds it: a ring at TP 4 costs the same 3 ms at
256 sequences with hops of about 0.6 us, so larger hop latencies would also make every TP-4 figure optimistic.

The TP-4 runs must equal the committed result's per-seed runs (same code, same seeds): the bench checks that
first, so it also re-measures the headline at the current commit.

Usage: ``python bench/paper_tp.py [--from bench/results/paper-sim-….json] [--gpus 64 128] [--hops 0 0.5 2 5]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import paper
from provenance import provenance, write_result

RESULTS = Path(__file__).resolve().parent / "results"
HEADLINE = RESULTS / "paper-sim-20261125-012446.json"
"""The committed ``bench/simulate.py --paper --fit`` result whose chosen settings this bench re-runs."""


def chosen_settings(result: dict[str, Any], gpus: int) -> dict[str, paper.Setting]:
    """Each mode's chosen setting at ``gpus`` in a ``paper-sim`` result."""
    names = {f.name for f in fields(paper.Setting)}
    return {m: paper.Setting(**{k: v for k, v in d.items() if k in names})
            for m, d in result["results"][str(gpus)]["chosen"].items()}


def at_tp(st: paper.Setting, tp: int, hop_us: float) -> paper.Setting:
    return replace(st, tp=tp, hop_latency_s=hop_us * 1e-6)  # the hop changes nothing at TP 4


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {"step_time_s": paper.mean_spread(runs, "step_time_s"), "throughput": paper.mean_spread(runs, "throughput"),
            "gpu_time_share": paper.mean_shares(runs), "runs": runs}


def compare(rows: dict[str, dict[int, dict[str, Any]]], bound: float) -> dict[str, Any]:
    """Each mode at its best TP (by mean throughput); DORA's ratios against each baseline at its best."""
    best = {m: max(by_tp, key=lambda tp: by_tp[tp]["throughput"]["mean"]) for m, by_tp in rows.items()}
    thr = {m: rows[m][best[m]]["throughput"]["mean"] for m in rows}
    step = {m: rows[m][best[m]]["step_time_s"]["mean"] for m in rows}
    return {"best_tp": best, "step_time_s": step, "throughput": thr,
            "dora_step_vs_sync": step["sync"] / step["dora"], "dora_vs_sync": thr["dora"] / thr["sync"],
            "dora_vs_one_step_off": thr["dora"] / thr["one_step_off"], "dora_vs_partial": thr["dora"] / thr["partial"],
            "fraction_of_bound": {m: t / bound for m, t in thr.items()}, "bound_tokens_per_s": bound}


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(out["sizes"])
    fig, axes = plt.subplots(1, len(sizes), figsize=(6.5 * len(sizes), 4.5), squeeze=False)
    for ax, gpus in zip(axes[0], sizes, strict=True):
        size = out["sizes"][gpus]
        hops = list(size["by_hop"])
        modes = list(paper.MODES)
        width = 0.8 / (1 + len(hops))
        for j, label in enumerate(["TP 4", *(f"TP 8, hop {h} us" for h in hops)]):
            ys = [size["tp4"][m]["step_time_s"]["mean"] if j == 0 else size["by_hop"][hops[j - 1]]["rows"][m]["8"]
                  ["step_time_s"]["mean"] for m in modes]
            ax.bar([i + j * width for i in range(len(modes))], ys, width, label=label)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(modes))], modes)
        ax.set_ylabel("step time (simulated s)")
        ax.set_title(f"{gpus} H800: each mode's chosen setting")
        ax.legend(fontsize=8)
    fig.suptitle("SIMULATED: the paper's setup, rollout instances of 4 or 8 GPUs (bench/paper_tp.py)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--from", dest="source", default=str(HEADLINE), help="a paper-sim result (chosen settings)")
    ap.add_argument("--gpus", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--tps", type=int, nargs="+", default=[8], help="TPs besides the recipe's 4")
    ap.add_argument("--hops", type=float, nargs="+", default=[0.0, 0.5, 2.0, 5.0], help="all-reduce hop latency, us")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    src = json.loads(Path(a.source).read_text())
    seeds = list(src["results"][str(a.gpus[0])]["seeds"])
    eff = replace(paper.Efficiencies(), **src["efficiencies"])  # the source's frozen (fitted) efficiencies
    mfu = eff.train_mfu
    w = replace(paper.Workload(), **{k: v for k, v in src["workload"].items() if k in {f.name for f in
                                                                                     fields(paper.Workload)}})
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    target = Path(a.out or RESULTS / f"paper-tp-{stamp}.json")
    out: dict[str, Any] = {**provenance(), "engine": "simulated (hardware_costs: H800, Qwen2.5-32B)",
                           "args": vars(a), "source": Path(a.source).name, "train_mfu": mfu, "seeds": seeds,
                           "sizes": {}, "sim_seconds": {}}
    for gpus in a.gpus:
        t0 = time.perf_counter()
        chosen = chosen_settings(src, gpus)
        configs = [(m, tp, hop) for m in paper.MODES for tp, hop in
                   [(paper.TP, 0.0), *((tp, h) for tp in a.tps for h in a.hops)]]
        runs = paper.run_many([(at_tp(chosen[m], tp, hop), w, eff, s) for m, tp, hop in configs for s in seeds],
                              a.workers)
        n = len(seeds)
        got = {c: runs[i * n:(i + 1) * n] for i, c in enumerate(configs)}
        committed = src["results"][str(gpus)]["modes"]
        reproduced = {m: [r["step_time_s"] for r in got[(m, paper.TP, 0.0)]]
                      == [r["step_time_s"] for r in committed[m]["runs"]] for m in paper.MODES}
        size: dict[str, Any] = {"chosen": {m: st.name for m, st in chosen.items()}, "tp4_reproduces_source": reproduced,
                                "tp4": {m: summarize(got[(m, paper.TP, 0.0)]) for m in paper.MODES}, "by_hop": {}}
        b4 = paper.bound(gpus, w, eff)["tokens_per_s"]
        size["tp4_compare"] = compare({m: {paper.TP: size["tp4"][m]} for m in paper.MODES}, b4)
        print(f"{gpus} GPUs, TP 4 (the headline's): reproduces {Path(a.source).name}: {reproduced}; "
              f"dora vs sync {size['tp4_compare']['dora_vs_sync']:.2f}x", flush=True)
        for hop in a.hops:
            rows = {m: {paper.TP: size["tp4"][m], **{tp: summarize(got[(m, tp, hop)]) for tp in a.tps}}
                    for m in paper.MODES}
            bound = max(paper.bound(gpus, w, eff, tp=tp, hop_latency_s=hop * 1e-6)["tokens_per_s"]
                        for tp in [paper.TP, *a.tps])
            cmp = compare(rows, bound)
            size["by_hop"][str(hop)] = {"rows": {m: {str(tp): r for tp, r in by.items()} for m, by in rows.items()},
                                        "compare": cmp}
            steps = ", ".join(f"{m} {rows[m][tp]['step_time_s']['mean']:.0f}s"
                              for m in paper.MODES for tp in a.tps)
            print(f"  hop {hop:g} us: at TP {a.tps}: {steps}; best TP {cmp['best_tp']}; dora vs sync "
                  f"{cmp['dora_vs_sync']:.2f}x, vs one_step_off {cmp['dora_vs_one_step_off']:.2f}x, vs partial "
                  f"{cmp['dora_vs_partial']:.2f}x; dora {cmp['fraction_of_bound']['dora']:.2f} of the bound",
                  flush=True)
        out["sizes"][str(gpus)] = size
        out["sim_seconds"][str(gpus)] = time.perf_counter() - t0
        write_result("paper-tp", out, str(target))  # after every size: a long run keeps what it measured
    plot(out, target.with_suffix(".png"))
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
