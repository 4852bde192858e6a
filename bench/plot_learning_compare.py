"""Plot a ``bench/real_modes.py`` result as issue 29's learning comparison: per mode and seed, the batch reward
per step and against RL wall time, the mixed-version (C1-breaking) trajectories per step and the staleness.

Usage: ``python bench/plot_learning_compare.py bench/results/real-modes-<stamp>.json`` (writes ``-learning.png``
next to it and prints a per-mode summary: last-5-step reward, RL wall, mixed-version trajectories, max staleness).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per mode, means over its seeds: reward of the last 5 steps, RL wall, mixed-version trajectories, staleness."""
    out: dict[str, dict[str, float]] = {}
    for mode in sorted({r["mode"] for r in runs}):
        mine = [r for r in runs if r["mode"] == mode]
        out[mode] = {
            "last5_reward": statistics.fmean(statistics.fmean(r["reward_per_step"][-5:]) for r in mine),
            "rl_wall_s": statistics.fmean(r["rl_wall_s"] for r in mine),
            "mixed_version_per_run": statistics.fmean(sum(x or 0 for x in r["mixed_version_per_step"]) for r in mine),
            "max_staleness": max(max((x or 0) for x in r["staleness_max_per_step"]) for r in mine),
            "seeds": len(mine)}
    return out


def main(path: str) -> int:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    result = json.loads(Path(path).read_text())
    runs = result["runs"]
    colors = {"dora": "tab:red", "partial_bounded": "tab:orange", "partial": "tab:gray", "sync": "tab:blue"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for r in runs:
        c, style = colors.get(r["mode"], "k"), "-" if r["seed"] == runs[0]["seed"] else "--"
        label = f"{r['mode']} seed {r['seed']}"
        axes[0].plot(range(len(r["reward_per_step"])), r["reward_per_step"], style, color=c, label=label)
        axes[1].plot(r["t_rl_s"], r["reward_per_step"], style, color=c, label=label)
        axes[2].plot(range(len(r["mixed_version_per_step"])), [x or 0 for x in r["mixed_version_per_step"]], style,
                     color=c, label=label)
    axes[0].set(xlabel="RL step", ylabel="batch reward", title="reward per step")
    axes[1].set(xlabel="RL wall time (s, from version 0)", ylabel="batch reward", title="reward per wall-second")
    axes[2].set(xlabel="RL step", ylabel="trajectories", title="mixed-version trajectories per batch (C1 breaks)")
    axes[0].legend(fontsize=6)
    fig.suptitle(f"dora-rl run (tiny model, CPU), {result['steps']} steps, commit {str(result.get('commit', ''))[:7]}")
    fig.tight_layout()
    out = Path(path).with_name(Path(path).stem + "-learning.png")
    fig.savefig(out, dpi=110)
    print(json.dumps({"summary": summary(runs), "plot": str(out)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
