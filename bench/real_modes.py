"""bench/real_modes: `dora-rl run` on the default real workload, sync vs dora, time to a common reward.

Every run is the real system end to end, started as ``dora-rl run`` (a subprocess: its own roles,
the torch engine, the tiny model, the ``reverse`` task, SFT warm-up then GRPO — the defaults of
``DoraConfig``), against one fresh local broker shared by the runs of this invocation (or
``--bootstrap-servers``). For each seed it runs every mode, one after another (modes interleaved, so
a drift of the machine's speed hits them alike): ``sync`` (RBS = TBS) and ``dora`` with
``--staleness`` S (RBS = (S + 1) x TBS, as bench/modes.py and bench/results/run30-dora-S1-*).

Figures per run, from its own ``dora.metrics``: each RL step's reward (the trainer's ``reward_mean``
of the step's batch, 0-1) and the wall time at which the step's update was announced, counted from
the launch of ``dora-rl run`` (``t_launch_s``: warm-up included, what a user waits) and from version
0's announcement (``t_rl_s``). The rolling-5 reward of step k is the mean reward of steps k-4..k
(defined from the fifth step on). A run reaches a threshold at the first step whose rolling-5 reward
is >= it; its time to the threshold is that step's time.

Thresholds: ``--threshold`` (repeatable), else the *common level* — the highest rolling-5 reward every
run reaches (the minimum over runs of each run's best rolling-5) — and 0.33 (issue 13's figure) when
every run reaches it. Per mode: the mean time to each threshold over the seeds (None if a run never
reaches it); ``speedup`` = mean time of sync / mean time of dora (> 1: dora is faster).

Usage: ``python bench/real_modes.py [--steps 30] [--seeds 0,1] [--staleness 1] [--set '{"k": v}']``
(``--set``: DoraConfig fields for every run, e.g. a smaller workload for a smoke run). Needs a quiet
machine: every run is timed. Writes ``bench/results/real-modes-<UTC timestamp>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
ISSUE_THRESHOLD = 0.33


def rolling5(rewards: list[float]) -> list[float | None]:
    """Rolling-5 mean reward per step (None for the first four steps)."""
    return [sum(rewards[k - 4:k + 1]) / 5 if k >= 4 else None for k in range(len(rewards))]


def time_to(run: dict[str, Any], threshold: float, key: str = "t_launch_s") -> float | None:
    """The run's time (``key``) at the first step whose rolling-5 reward reaches ``threshold``."""
    for r, t in zip(run["rolling5"], run[key], strict=True):
        if r is not None and t is not None and r >= threshold:
            return float(t)
    return None


def run_config(mode: str, seed: int, staleness: int, steps: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """The DoraConfig fields of one run (defaults, ``--set`` overrides, then the mode's own)."""
    from dora_rl.config import DoraConfig

    tbs = int(overrides.get("train_batch_size", DoraConfig().train_batch_size))
    cfg = {**overrides, "seed": seed, "mode": mode, "steps": steps}
    if mode == "dora":
        cfg.update(max_staleness=staleness, rollout_batch_size=(staleness + 1) * tbs)
    else:
        cfg.update(max_staleness=0, rollout_batch_size=tbs)
    return cfg


def step_times(bootstrap: str, run_id: str) -> tuple[dict[int, float], dict[int, int], int | None]:
    """``({step: reward}, {step: ts_ms of its update}, ts_ms of version 0)`` from the run's metrics."""
    from dora_rl.infra import topics
    from dora_rl.infra.kafka_io import read_all
    from dora_rl.infra.runs import get_run
    from dora_rl.schemas.records import Metric

    info = get_run(bootstrap, run_id)
    start = {o.partition: o.offset for o in info.start_offsets if o.topic == topics.METRICS}
    rewards: dict[int, float] = {}
    ts: dict[int, int] = {}
    v0: int | None = None
    for msg in read_all(bootstrap, topics.METRICS, start):
        m = Metric.decode(msg.value(), msg.headers())
        if m.run_id != run_id or m.component != "trainer":
            continue
        if m.name == "reward_mean" and m.step is not None:
            rewards[int(m.step)], ts[int(m.step)] = m.value, m.ts_ms  # a restarted trainer's repeat: the last
        elif m.name == "version_published" and m.version == 0 and v0 is None:
            v0 = m.ts_ms
    return rewards, ts, v0


def one_run(bootstrap: str, mode: str, seed: int, args: argparse.Namespace, overrides: dict[str, Any],
            workdir: Path) -> dict[str, Any]:
    """Launch ``dora-rl run`` once and collect its figures."""
    cfg = run_config(mode, seed, args.staleness, args.steps, overrides)
    cfg_path = workdir / f"{mode}-s{seed}.json"
    cfg_path.write_text(json.dumps(cfg))
    summary_path = workdir / f"{mode}-s{seed}-summary.json"
    cmd = [sys.executable, "-m", "dora_rl.cli", "--log-level", "WARNING", "run", "--bootstrap-servers", bootstrap,
           "--config", str(cfg_path), "--json", str(summary_path), "--quiet"]
    print(f"== {mode} seed {seed}: {' '.join(cmd[2:])}  config {json.dumps(cfg)}", file=sys.stderr, flush=True)
    t_launch = time.time()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    wall = time.time() - t_launch
    if proc.returncode != 0 or not summary_path.exists():
        print(proc.stdout[-4000:], file=sys.stderr)
        raise RuntimeError(f"dora-rl run ({mode}, seed {seed}) failed with exit code {proc.returncode}")
    summary = json.loads(summary_path.read_text())
    rewards, ts, v0 = step_times(bootstrap, summary["run_id"])
    steps = sorted(rewards)
    reward_list = [rewards[k] for k in steps]
    from dora_rl.consumers.audit import audit_run

    report = audit_run(bootstrap, summary["run_id"])
    run = {
        "mode": mode, "seed": seed, "run_id": summary["run_id"], "config": cfg, "wall_s": wall,
        "warmup_s": summary["warmup_s"], "rl_wall_s": summary["rl_wall_s"],
        "throughput_tokens_per_s": summary["throughput_tokens_per_s"],
        "max_staleness_seen": summary["max_staleness_seen"], "audit_ok": report.ok,
        "reward_per_step": reward_list, "rolling5": rolling5(reward_list),
        "t_launch_s": [ts[k] / 1000 - t_launch for k in steps],
        "t_rl_s": [(ts[k] - v0) / 1000 if v0 is not None else None for k in steps],
    }
    best = max((r for r in run["rolling5"] if r is not None), default=None)
    print(f"   {mode:5s} seed {seed}: wall {wall:6.1f}s  warm-up {run['warmup_s']:5.1f}s  RL {run['rl_wall_s']:6.1f}s"
          f"  {run['throughput_tokens_per_s']:7.0f} tok/s  best rolling-5 {best}  audit "
          f"{'PASS' if report.ok else 'FAIL'}", file=sys.stderr, flush=True)
    return run


def _mean(xs: list[float | None]) -> float | None:
    """Mean of ``xs``; None if empty or any is None (a run that never reached the threshold)."""
    vals = [x for x in xs if x is not None]
    return sum(vals) / len(vals) if vals and len(vals) == len(xs) else None


def summarize(runs: list[dict[str, Any]], thresholds: list[float]) -> dict[str, Any]:
    """Per threshold and mode: times per seed and their mean; the sync/dora speedup."""
    out: dict[str, Any] = {}
    modes = sorted({r["mode"] for r in runs})
    for th in thresholds:
        row: dict[str, Any] = {}
        for m in modes:
            mine = [r for r in runs if r["mode"] == m]
            t_launch = [time_to(r, th) for r in mine]
            t_rl = [time_to(r, th, "t_rl_s") for r in mine]
            row[m] = {"seeds": [r["seed"] for r in mine], "t_launch_s": t_launch, "t_rl_s": t_rl,
                      "mean_t_launch_s": _mean(t_launch), "mean_t_rl_s": _mean(t_rl)}
        for key in ("t_launch_s", "t_rl_s"):
            s, d = row.get("sync", {}).get(f"mean_{key}"), row.get("dora", {}).get(f"mean_{key}")
            row[f"speedup_{key}"] = s / d if s and d else None
        out[f"{th:.4f}"] = row
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Rolling-5 reward against wall time per run; mean time to each threshold per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    colors = {"sync": "tab:blue", "dora": "tab:red"}
    for r in result["runs"]:
        pts = [(t, v) for t, v in zip(r["t_launch_s"], r["rolling5"], strict=True) if v is not None]
        if pts:
            ax.plot(*zip(*pts, strict=True), color=colors.get(r["mode"], "grey"), marker=".",
                    label=f"{r['mode']} seed {r['seed']}", alpha=0.5 + 0.5 / (1 + r["seed"]))
    for th in result["thresholds"]:
        ax.axhline(th, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("wall time since `dora-rl run` started (s)")
    ax.set_ylabel("rolling-5 reward")
    ax.legend(fontsize=8)
    ax.set_title("rolling-5 reward (mean of 5 steps' batch rewards)")
    ths = list(result["time_to_threshold"])
    modes = sorted({r["mode"] for r in result["runs"]})
    width = 0.8 / max(1, len(modes))
    for j, m in enumerate(modes):
        vals = [result["time_to_threshold"][t][m]["mean_t_launch_s"] or 0.0 for t in ths]
        bx.bar([i + j * width for i in range(len(ths))], vals, width, label=m, color=colors.get(m, "grey"))
    labels = [f"{float(t):.3f}\nx{result['time_to_threshold'][t]['speedup_t_launch_s'] or 0:.2f}" for t in ths]
    bx.set_xticks([i + width * (len(modes) - 1) / 2 for i in range(len(ths))], labels)
    bx.set_xlabel("threshold (rolling-5 reward) and speedup sync/dora")
    bx.set_ylabel("mean time to threshold (s, from launch)")
    bx.legend()
    fig.suptitle(f"bench/real_modes: `dora-rl run` (torch engine, real workload), {result['steps']} steps, "
                 f"seeds {result['seeds']}, dora S={result['staleness']}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", default="0,1", help="comma-separated config seeds (every mode runs each)")
    ap.add_argument("--modes", default="sync,dora")
    ap.add_argument("--staleness", type=int, default=1, help="dora's max_staleness S")
    ap.add_argument("--threshold", type=float, action="append", default=None,
                    help="rolling-5 reward threshold (repeatable; default: the common level, and 0.33 if reached)")
    ap.add_argument("--set", default="{}", help="JSON object of DoraConfig fields for every run")
    ap.add_argument("--bootstrap-servers", default=None, help="use this cluster instead of a fresh local broker")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    overrides = json.loads(args.set)
    seeds = [int(s) for s in args.seeds.split(",")]
    modes = args.modes.split(",")
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from provenance import provenance

    from dora_rl.infra.broker import LocalBroker
    from dora_rl.infra.logs import setup_logging
    from dora_rl.launcher import prepare_topics

    setup_logging("WARNING")
    workdir = Path(tempfile.mkdtemp(prefix="bench-real-modes-"))
    broker = None
    bootstrap = args.bootstrap_servers
    if not bootstrap:
        broker = LocalBroker(workdir / "broker", port=0)
        broker.start()
        bootstrap = broker.bootstrap_servers
    result: dict[str, Any] = {
        **provenance(), "engine": "torch", "workload": "dora-rl run defaults (DoraConfig) + --set",
        "set": overrides, "steps": args.steps, "seeds": seeds, "modes": modes, "staleness": args.staleness,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
        "load_avg_at_start": os.getloadavg(), "runs": []}
    try:
        prepare_topics(bootstrap, 4)
        for seed in seeds:
            for mode in modes:
                result["runs"].append(one_run(bootstrap, mode, seed, args, overrides, workdir))
    finally:
        if broker is not None:
            broker.stop()
    runs = result["runs"]
    bests = [max((r for r in run["rolling5"] if r is not None), default=float("-inf")) for run in runs]
    common = min(bests) if bests else float("-inf")
    if args.threshold:
        thresholds = sorted(args.threshold)
    else:
        thresholds = [common] if common > float("-inf") else []
        if common >= ISSUE_THRESHOLD and abs(common - ISSUE_THRESHOLD) > 1e-9:
            thresholds.insert(0, ISSUE_THRESHOLD)
    result["common_level"] = common if common > float("-inf") else None
    result["thresholds"] = thresholds
    result["time_to_threshold"] = summarize(runs, thresholds)
    result["load_avg_at_end"] = os.getloadavg()
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = Path(args.out) if args.out else RESULTS / f"real-modes-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    for th, row in result["time_to_threshold"].items():
        means = "  ".join(f"{m} {row[m]['mean_t_launch_s']}" for m in modes if m in row)
        print(f"rolling-5 >= {th}: mean time from launch  {means}  speedup sync/dora "
              f"{row['speedup_t_launch_s']}  (from version 0: {row['speedup_t_rl_s']})")
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
