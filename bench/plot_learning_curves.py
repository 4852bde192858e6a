"""Plot and summarise a folder of ``bench/learning_curve.py --json`` results.

Writes ``<folder>/summary.json`` (per file: prompts, group, minibatches, epochs, lr, seed, first5,
last5, gain, total_s) and ``<folder>/curves.png`` (reward per RL step, one line per file).

Usage::

    .venv/bin/python bench/plot_learning_curves.py bench/results/learning-curve-20261121
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    folder = Path(args[0])
    rows, curves = [], {}
    for path in sorted(folder.glob("*.json")):
        if path.name == "summary.json":
            continue
        data = json.loads(path.read_text())
        a = data["args"]
        for run in data["runs"]:
            rows.append({"file": path.name, "prompts": a["prompts"], "group": a["group"],
                         "minibatches": a["minibatches"], "epochs": a["epochs"], "lr": a["lr"],
                         "seed": run["seed"], "first5": round(run["first5"], 4), "last5": round(run["last5"], 4),
                         "gain": round(run["gain"], 4), "total_s": round(run["total_s"], 1)})
            curves[f"{path.stem}"] = [s["reward"] for s in run["steps"]]
    if not rows:
        print(f"no learning-curve JSON in {folder}", file=sys.stderr)
        return 1
    (folder / "summary.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(f"{r['file']:45s} first5 {r['first5']:.3f} last5 {r['last5']:.3f} gain {r['gain']:+.3f} "
              f"{r['total_s']:.0f}s")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for name, ys in curves.items():
        ax.plot(range(1, len(ys) + 1), ys, label=name, lw=2.0 if "-g8-" in name and "0.0003" in name else 0.8)
    ax.set_xlabel("RL step")
    ax.set_ylabel("mean reward of the step's batch")
    ax.set_title("learning_curve.py: SFT warm-up then GRPO (reverse task, tiny:1m, 1 thread)")
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(folder / "curves.png", dpi=110)
    return 0


if __name__ == "__main__":
    sys.exit(main())
