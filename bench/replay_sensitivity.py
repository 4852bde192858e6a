"""How much a ``bench/modes`` run's replay moves under timing changes smaller than the pipeline's own (decision 0079).

The simulator replays a real run on a virtual clock with fixed costs. A real run's timings differ from those by
tens of milliseconds: the orchestrator's tick (``PUNCTUATE_S``), a version switch (modelled ``load_s``, ~0.25 s
real with the fetch), the trainer's fixed cost per step. For each reported run of a committed ``bench/modes``
result, this replays it on the same workload under every combination of::

    tick_s in TICKS,  switch_s in SWITCHES,  train_s_fixed in FIXED

and reports, per mode and seed, the real throughput, the replay at the recorded costs and the spread (min,
median, max) of the perturbed replays. A mode whose replays spread widely has a schedule that timing alone
decides: its per-run agreement with the real run is bounded by that spread, whatever the simulator's fidelity.

Usage::

    python bench/replay_sensitivity.py              # ~4 min on 2 cores -> bench/results/replay-sensitivity-<time>.json
    python bench/replay_sensitivity.py --modes-result modes-20261129-103757.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from c1_ceiling import MODES
from provenance import provenance, write_result

RESULTS = Path(__file__).resolve().parent / "results"
TICKS = (0.04, 0.05, 0.06)
SWITCHES = (0.1, 0.25)
FIXED = (0.45, 0.5, 0.55)


def replay(config: dict[str, Any], run: dict[str, Any], tick_s: float, switch_s: float, fixed_s: float) -> float:
    """Steady trained tokens/s of ``run`` replayed with these three costs (everything else as recorded)."""
    from modes import simulate_same

    sim = simulate_same(config, run["mean_prompt_tokens"], run["run_id"], tick_s=tick_s, switch_s=switch_s,
                        train_s_fixed=fixed_s)
    return float(sim["throughput_tokens_per_s"])


def sensitivity(name: str) -> dict[str, Any]:
    from modes import mode_config

    result = json.loads((RESULTS / name).read_text())
    out: dict[str, Any] = {}
    for mode, best in result["best"].items():
        rows = []
        for run in best["runs"]:
            cfg = mode_config(mode, result["steps"], best["setting"], run["seed"])
            vals = [replay(cfg, run, t, s, f) for t, s, f in itertools.product(TICKS, SWITCHES, FIXED)]
            row = {"seed": run["seed"], "real": run["throughput_tokens_per_s"],
                   "replay_recorded": run["simulated"]["throughput_tokens_per_s"], "perturbed": vals,
                   "min": min(vals), "median": statistics.median(vals), "max": max(vals),
                   "spread": (max(vals) - min(vals)) / statistics.median(vals)}
            rows.append(row)
            print(f"{mode:16s} seed {run['seed']}: real {row['real']:6.0f}  replay {row['replay_recorded']:6.0f}  "
                  f"perturbed {row['min']:6.0f} .. {row['median']:6.0f} .. {row['max']:6.0f} "
                  f"(spread {row['spread']:.0%})", flush=True)
        out[mode] = {"setting": best["setting"], "runs": rows,
                     "median_of_medians": statistics.median(r["median"] for r in rows)}
    return out


def plot(out: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (mode, m) in enumerate(out["modes"].items()):
        for j, r in enumerate(m["runs"]):
            x = j * 3 + i
            ax.plot([x] * len(r["perturbed"]), r["perturbed"], "_", color=("#1f77b4", "#888")[i % 2], ms=12)
            ax.plot(x, r["real"], "r*", ms=9, label="real run" if i == j == 0 else None)
        ax.plot([], [], "_", color=("#1f77b4", "#888")[i % 2], label=f"{mode}: replays, perturbed")
    ax.set_xticks([j * 3 + 0.5 for j in range(len(next(iter(out["modes"].values()))["runs"]))],
                  [f"seed {r['seed']}" for r in next(iter(out["modes"].values()))["runs"]])
    ax.set_ylabel("trained tokens/s (steady)")
    ax.set_title(f"replays of {out['from']} under small timing changes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes-result", default=MODES, help="a bench/results/modes-*.json (default: the current one)")
    args = ap.parse_args()
    out = {**provenance(), "from": args.modes_result, "ticks_s": TICKS, "switches_s": SWITCHES,
           "train_s_fixed": FIXED, "modes": sensitivity(args.modes_result)}
    path = write_result("replay-sensitivity", out)
    plot(out, path.with_suffix(".png"))
    print(path)


if __name__ == "__main__":
    main()
