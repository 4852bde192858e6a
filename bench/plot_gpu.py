"""Plot of ``bench/gpu_check.py`` results: engine step time by batch size, the update's tokens/s at
today's and the device's settings, and the RL loop's reward per step (bf16 and its fp32 twin).

Usage::

    python bench/plot_gpu.py RESULT.json [MORE.json ...] --out PLOT.png

Each panel takes the last file that has its section.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt


def _section(results: list[dict[str, Any]], name: str) -> tuple[dict[str, Any], str] | None:
    for r in reversed(results):
        if name in r["sections"] and "error" not in r["sections"][name]:
            return r["sections"][name], r["commit"][:7]
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("results", nargs="+", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args(argv)
    results = [json.loads(p.read_text()) for p in args.results]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    eng = _section(results, "engine")
    if eng is not None:
        body, c = eng
        for key, rows in body.items():
            if not isinstance(rows, list) or key.startswith("profile"):
                continue
            for variant, style in (("engine", "-"), ("hf_generate", ":")):
                axes[0].plot([r["batch"] for r in rows], [r[variant]["step_ms"] for r in rows], style, marker="o",
                             label=f"{key} {variant}")
        axes[0].set(xscale="log", xlabel="batch (requests)", ylabel="ms per decode step", title=f"decode (commit {c})")
        axes[0].legend(fontsize=6)
    upd = _section(results, "update")
    if upd is not None:
        body, c = upd
        sizes = [k for k in body if k.startswith("trajectories_")]
        for i, k in enumerate(sizes):
            for j, name in enumerate(("today", "device")):
                axes[1].bar(i * 3 + j, body[k][name]["tokens_per_s"], label=name if i == 0 else None,
                            color=("tab:gray", "tab:blue")[j])
            axes[1].text(i * 3 + 0.5, body[k]["device"]["tokens_per_s"], f"{body[k]['speedup']:.1f}x", ha="center")
        axes[1].set_xticks([i * 3 + 0.5 for i in range(len(sizes))], [k.replace("trajectories_", "") + " traj."
                                                                        for k in sizes])
        axes[1].set(ylabel="tokens / s", title=f"update, 135M shape, bf16 (commit {c})")
        axes[1].legend()
    rl = _section(results, "rl_loop")
    if rl is not None:
        body, c = rl
        for dtype in ("bf16", "fp32"):
            axes[2].plot(range(1, len(body[dtype]["rewards"]) + 1), body[dtype]["rewards"], marker=".",
                         label=f"{dtype}: first5 {body[dtype]['first5']:.3f} -> last5 {body[dtype]['last5']:.3f}")
        axes[2].set(xlabel="RL step", ylabel="mean reward", title=f"RL loop, tiny model (commit {c})")
        axes[2].legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
