"""bench/real_modes: `dora-rl run` on the default real workload, sync vs dora, time to a common reward.

Every run is the real system end to end, started as ``dora-rl run`` (a subprocess: its own roles,
the torch engine, the tiny model, the ``reverse`` task, SFT warm-up then GRPO — the defaults of
``DoraConfig``), against one fresh local broker shared by the runs of this invocation (or
``--bootstrap-servers``). For each seed it runs every mode, one after another (modes interleaved, so
a drift of the machine's speed hits them alike).

Settings (fair baselines, issue 13): each mode first runs every candidate of ``SWEEP`` for
``--sweep-steps`` steps on the first seed; the one with the shortest RL wall per step is then run on
every seed for ``--steps`` steps. Candidates: sync with 1 or 2 rollout instances (on 2 cores a second
instance lets the generation phase use both); dora with S = 1 or 2, RBS = 1x to 3x TBS, 1 or 2
instances. ``--no-sweep`` runs the defaults: sync RBS = TBS and dora ``--staleness`` S with
RBS = (S + 1) x TBS, one instance each. The sweep's runs are in the result (``sweep``).

Figures per run, from its own ``dora.metrics``: each RL step's reward (the trainer's ``reward_mean``
of the step's batch, 0-1) and the wall time at which the step's update was announced, counted from
the launch of ``dora-rl run`` (``t_launch_s``: warm-up included, what a user waits) and from version
0's announcement (``t_rl_s``). The rolling-5 reward of step k is the mean reward of steps k-4..k
(defined from the fifth step on). A run reaches a threshold at the first step whose rolling-5 reward
is >= it; its time to the threshold is that step's time.

CPU (the machine's ceiling): while a run goes, a sampler reads the machine's busy core-seconds
(``psutil.cpu_times``: all but idle and iowait) and each process of the run's tree (labelled by its role,
a helper process by the role it descends from) every 0.5 s; over the RL window (version 0 -> last step)
``busy_core_s`` and ``utilization = busy_core_s / (cpus x RL wall)``. No schedule can finish the same work
faster than ``work / cpus``, so on this machine
  ceiling = (sync's RL wall per step) / (min over modes of busy core-s per step / cpus)
bounds dora's step-time speedup over sync (time to a reward can only add the shared warm-up and any lag in
reward per step). Run on a quiet machine: the busy count is the whole machine's.

Thresholds: ``--threshold`` (repeatable), else the *common level* — the highest rolling-5 reward every
run reaches (the minimum over runs of each run's best rolling-5) — and 0.33 (issue 13's figure) when
every run reaches it. Per mode: the mean time to each threshold over the seeds (None if a run never
reaches it); ``speedup`` = mean time of sync / mean time of dora (> 1: dora is faster).

Usage: ``python bench/real_modes.py [--steps 30] [--seeds 0,1] [--sweep-steps 10 | --no-sweep [--staleness 1]]
[--set '{"k": v}']``
(``--set``: DoraConfig fields for every run, e.g. a smaller workload for a smoke run). Needs a quiet
machine: every run is timed. Writes ``bench/results/real-modes-<UTC timestamp>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import bisect
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil

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


SWEEP: dict[str, list[dict[str, Any]]] = {
    "sync": [{"staleness": 0, "rbs_factor": 1.0, "num_instances": 1},
             {"staleness": 0, "rbs_factor": 1.0, "num_instances": 2}],
    "dora": [{"staleness": 1, "rbs_factor": 1.0, "num_instances": 1},
             {"staleness": 1, "rbs_factor": 2.0, "num_instances": 1},
             {"staleness": 2, "rbs_factor": 2.0, "num_instances": 1},
             {"staleness": 2, "rbs_factor": 3.0, "num_instances": 1},
             {"staleness": 1, "rbs_factor": 2.0, "num_instances": 2}],
}
"""Each mode's candidate settings (module docstring)."""


def setting_name(mode: str, st: dict[str, Any]) -> str:
    return f"{mode} S={st['staleness']} RBS={st['rbs_factor']:g}xTBS instances={st['num_instances']}"


def default_setting(mode: str, staleness: int) -> dict[str, Any]:
    """``--no-sweep``: sync RBS = TBS; dora and both partial rollouts (``partial_bounded`` held to S,
    ``partial`` unbounded) with RBS = (S + 1) x TBS; one instance."""
    if mode in ("dora", "partial_bounded", "partial"):
        return {"staleness": staleness, "rbs_factor": float(staleness + 1), "num_instances": 1}
    return {"staleness": 0, "rbs_factor": 1.0, "num_instances": 1}


def run_config(mode: str, seed: int, setting: dict[str, Any], steps: int, overrides: dict[str, Any]) -> dict[str, Any]:
    """The DoraConfig fields of one run (defaults, ``--set`` overrides, then the mode's setting)."""
    from dora_rl.config import DoraConfig

    tbs = int(overrides.get("train_batch_size", DoraConfig().train_batch_size))
    group = int(overrides.get("group_size", DoraConfig().group_size))
    rbs = int(setting["rbs_factor"] * tbs) // group * group
    from provenance import config_mode

    return {**overrides, "seed": seed, "mode": config_mode(mode), "steps": steps, "max_staleness": setting["staleness"],
            "rollout_batch_size": rbs, "num_instances": setting["num_instances"]}


PER_STEP = ("staleness_max", "mixed_version")
"""Trainer metrics kept per step besides the reward (the staleness and C1 breaks of each batch)."""


def step_times(bootstrap: str, run_id: str,
               extra: dict[str, dict[int, float]] | None = None) -> tuple[dict[int, float], dict[int, int], int | None]:
    """``({step: reward}, {step: ts_ms of its update}, ts_ms of version 0)`` from the run's metrics; the
    ``PER_STEP`` metrics go into ``extra`` (``{name: {step: value}}``) when given."""
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.runs import get_run, read_run
    from dora_rl.schemas.records import Metric

    info = get_run(bootstrap, run_id)
    rewards: dict[int, float] = {}
    ts: dict[int, int] = {}
    v0: int | None = None
    for msg in read_run(bootstrap, info, topics.METRICS):
        m = Metric.decode(msg.value(), msg.headers())
        if m.run_id != run_id or m.component != "trainer":
            continue
        if m.name == "reward_mean" and m.step is not None:
            rewards[int(m.step)], ts[int(m.step)] = m.value, m.ts_ms  # a restarted trainer's repeat: the last
        elif extra is not None and m.name in PER_STEP and m.step is not None:
            extra.setdefault(m.name, {})[int(m.step)] = m.value
        elif m.name == "version_published" and m.version == 0 and v0 is None:
            v0 = m.ts_ms
    return rewards, ts, v0


class CpuSampler(threading.Thread):
    """Samples ``(time, machine busy core-s, {role: core-s})`` every ``period`` s for one process tree."""

    def __init__(self, root_pid: int, period: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.root_pid, self.period = root_pid, period
        self.samples: list[tuple[float, float, dict[str, float]]] = []
        self._per_pid: dict[int, tuple[str, float]] = {}  # the last reading of every process seen (dead ones kept)
        self._halt = threading.Event()

    @staticmethod
    def _label(p: psutil.Process) -> str:
        """The role of ``p``: the word after ``dora_rl`` in its own or its nearest ancestor's command line."""
        q: psutil.Process | None = p
        while q is not None:
            cmd = q.cmdline()
            if "dora_rl" in cmd and cmd.index("dora_rl") + 1 < len(cmd):
                role = cmd[cmd.index("dora_rl") + 1]
                return f"{role}-{cmd[cmd.index('--index') + 1]}" if "--index" in cmd else role
            if "dora_rl.cli" in cmd:
                return "launcher"
            q = q.parent()
        return "other"

    def _read(self) -> None:
        try:
            root = psutil.Process(self.root_pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            procs = []
        for p in procs:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    label = self._per_pid[p.pid][0] if p.pid in self._per_pid else self._label(p)
                    self._per_pid[p.pid] = (label, t.user + t.system)
            except psutil.Error:
                continue
        roles: dict[str, float] = {}
        for label, cpu in self._per_pid.values():
            roles[label] = roles.get(label, 0.0) + cpu
        m = psutil.cpu_times()
        self.samples.append((time.time(), sum(m) - m.idle - getattr(m, "iowait", 0.0), roles))

    def run(self) -> None:
        while not self._halt.is_set():
            self._read()
            self._halt.wait(self.period)

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """Busy core-s of the machine and per role between wall times ``t0`` and ``t1`` (linear in between)."""
        ts = [s[0] for s in self.samples]

        def at(t: float, get: Any) -> float:
            i = min(max(bisect.bisect_left(ts, t), 1), len(ts) - 1)
            (ta, a), (tb, b) = (ts[i - 1], get(self.samples[i - 1])), (ts[i], get(self.samples[i]))
            return a if tb == ta else a + (b - a) * (min(max(t, ta), tb) - ta) / (tb - ta)

        roles = sorted({r for s in self.samples for r in s[2]})
        return {"busy_core_s": at(t1, lambda s: s[1]) - at(t0, lambda s: s[1]),
                "per_role_core_s": {r: at(t1, lambda s, r=r: s[2].get(r, 0.0)) - at(t0, lambda s, r=r: s[2].get(r, 0.0))
                                    for r in roles}}


def one_run(bootstrap: str, mode: str, seed: int, setting: dict[str, Any], n_steps: int,
            overrides: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """Launch ``dora-rl run`` once and collect its figures."""
    cfg = run_config(mode, seed, setting, n_steps, overrides)
    tag = f"{mode}-s{seed}-{len(list(workdir.glob('*.json')))}"
    cfg_path = workdir / f"{tag}.json"
    cfg_path.write_text(json.dumps(cfg))
    summary_path = workdir / f"{tag}-summary.json"
    cmd = [sys.executable, "-m", "dora_rl.cli", "--log-level", "WARNING", "run", "--bootstrap-servers", bootstrap,
           "--config", str(cfg_path), "--json", str(summary_path), "--quiet"]
    print(f"== {mode} seed {seed}: {' '.join(cmd[2:])}  config {json.dumps(cfg)}", file=sys.stderr, flush=True)
    t_launch = time.time()
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        sampler = CpuSampler(proc.pid)
        sampler.start()
        out_text, _ = proc.communicate()
        sampler.stop()
    wall = time.time() - t_launch
    if proc.returncode != 0 or not summary_path.exists():
        print(out_text[-4000:], file=sys.stderr)
        raise RuntimeError(f"dora-rl run ({mode}, seed {seed}) failed with exit code {proc.returncode}")
    summary = json.loads(summary_path.read_text())
    extra: dict[str, dict[int, float]] = {}
    rewards, ts, v0 = step_times(bootstrap, summary["run_id"], extra)
    steps = sorted(rewards)
    reward_list = [rewards[k] for k in steps]
    from dora_rl.consumers.audit import audit_run

    report = audit_run(bootstrap, summary["run_id"])
    run = {
        "mode": mode, "seed": seed, "setting": setting_name(mode, setting), "run_id": summary["run_id"],
        "config": cfg, "wall_s": wall,
        "warmup_s": summary["warmup_s"], "rl_wall_s": summary["rl_wall_s"],
        "throughput_tokens_per_s": summary["throughput_tokens_per_s"],
        "max_staleness_seen": summary["max_staleness_seen"], "audit_ok": report.ok,
        "reward_per_step": reward_list, "rolling5": rolling5(reward_list),
        "t_launch_s": [ts[k] / 1000 - t_launch for k in steps],
        "t_rl_s": [(ts[k] - v0) / 1000 if v0 is not None else None for k in steps],
        **{f"{name}_per_step": [extra.get(name, {}).get(k) for k in steps] for name in PER_STEP},
    }
    if v0 is not None and steps:
        t0, t1 = v0 / 1000, ts[steps[-1]] / 1000
        cpu = sampler.window(t0, t1)
        ncpu = psutil.cpu_count() or 1
        run["cpu"] = {**cpu, "rl_window_s": t1 - t0, "cpus": ncpu,
                      "utilization": cpu["busy_core_s"] / (ncpu * (t1 - t0)),
                      "busy_core_s_per_step": cpu["busy_core_s"] / len(steps),
                      "wall_s_per_step": (t1 - t0) / len(steps)}
    best = max((r for r in run["rolling5"] if r is not None), default=None)
    print(f"   {setting_name(mode, setting)} seed {seed}: wall {wall:6.1f}s  warm-up {run['warmup_s']:5.1f}s"
          f"  RL {run['rl_wall_s']:6.1f}s"
          f"  {run['throughput_tokens_per_s']:7.0f} tok/s  best rolling-5 {best}  audit "
          f"{'PASS' if report.ok else 'FAIL'}  CPU utilization "
          f"{run.get('cpu', {}).get('utilization', float('nan')):.2f}", file=sys.stderr, flush=True)
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


def cpu_ceiling(runs: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The machine's bound on dora's step-time speedup over sync (formula in the module docstring)."""
    per_mode: dict[str, dict[str, float]] = {}
    for m in sorted({r["mode"] for r in runs}):
        cpus = [r["cpu"] for r in runs if r["mode"] == m and "cpu" in r]
        if not cpus:
            return None
        per_mode[m] = {key: sum(c[key] for c in cpus) / len(cpus)
                       for key in ("utilization", "busy_core_s_per_step", "wall_s_per_step")}
    if "sync" not in per_mode:
        return None
    work = min(v["busy_core_s_per_step"] for v in per_mode.values())
    ncpu = runs[0]["cpu"]["cpus"]
    out: dict[str, Any] = {"per_mode": per_mode, "min_busy_core_s_per_step": work,
                           "ceiling_step_speedup": per_mode["sync"]["wall_s_per_step"] / (work / ncpu)}
    if "dora" in per_mode:
        out["measured_step_speedup"] = per_mode["sync"]["wall_s_per_step"] / per_mode["dora"]["wall_s_per_step"]
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    """Rolling-5 reward against wall time per run; mean time to each threshold per mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 5))
    colors = {"sync": "tab:blue", "dora": "tab:red", "partial_bounded": "tab:orange", "partial": "tab:gray"}
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
                 f"seeds {result['seeds']}\n{'; '.join(result['chosen'].values())}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", default="0,1", help="comma-separated config seeds (every mode runs each)")
    ap.add_argument("--modes", default="sync,dora")
    ap.add_argument("--staleness", type=int, default=1, help="--no-sweep: dora's max_staleness S")
    ap.add_argument("--sweep-steps", type=int, default=10, help="steps of each sweep run (on the first seed)")
    ap.add_argument("--no-sweep", action="store_true", help="run the default settings without a sweep")
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

    from dora_rl.infra.broker.server import LocalBroker
    from dora_rl.infra.observability.logs import setup_logging
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
        "sweep_steps": None if args.no_sweep else args.sweep_steps, "sweep": [], "chosen": {},
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cpus": os.cpu_count(),
        "load_avg_at_start": os.getloadavg(), "runs": []}
    try:
        prepare_topics(bootstrap, 4)
        chosen = {m: default_setting(m, args.staleness) for m in modes}
        if not args.no_sweep:
            for mode in modes:
                tried = []
                for st in SWEEP[mode]:
                    r = one_run(bootstrap, mode, seeds[0], st, args.sweep_steps, overrides, workdir)
                    result["sweep"].append(r)
                    tried.append((r["cpu"]["wall_s_per_step"] if "cpu" in r else float("inf"), st))
                chosen[mode] = min(tried, key=lambda x: x[0])[1]
        result["chosen"] = {m: setting_name(m, st) for m, st in chosen.items()}
        for seed in seeds:
            for mode in modes:
                result["runs"].append(one_run(bootstrap, mode, seed, chosen[mode], args.steps, overrides, workdir))
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
    result["cpu_ceiling"] = cpu_ceiling(runs)
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
    if result["cpu_ceiling"]:
        c = result["cpu_ceiling"]
        print(f"CPU: utilization {json.dumps({m: round(v['utilization'], 3) for m, v in c['per_mode'].items()})}; "
              f"ceiling on the step-time speedup on {runs[0]['cpu']['cpus']} cores {c['ceiling_step_speedup']:.2f}x, "
              f"measured {c.get('measured_step_speedup')}")
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
