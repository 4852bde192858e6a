"""bench/modes: the four scheduling modes side by side, through the real pipeline, on one workload.

Every mode runs the real system — a real Kafka broker, the real orchestrator, scorer, Faust
assembler and trainer (the tiny model, trained on the generated tokens) — with the **emulated**
rollout engine (calibrated decode timing, long-tailed lengths; see
``dora_rl.producers.rollout.emulated``), so the figures are labelled ``emulated``. Same
workload, same seed, same machine, one invocation.

Figures per mode (from the run's own topics):

- ``throughput_tokens_per_s`` = trained response tokens / RL wall time (version 0 -> last update);
- ``step_time_s`` = RL wall time / steps;
- ``rollout_only_share`` = trainer waiting time / RL wall time (the part of a step where only
  rollout runs: the bubble DORA removes);
- ``trainer_idle_ratio`` = the trainer's waiting / (waiting + updating);
- ``rollout_idle_ratio`` = 1 - (sum of instances' decoding time) / (instances x RL wall time);
- ``max_staleness_seen`` and the staleness histogram (from the audit of the batches);
- ``orchestration_overhead`` = the orchestrator's scheduling time / RL wall time.

Usage: ``python bench/modes.py [--steps 10] [--modes sync,one_step_off,partial,dora] [--staleness 2]``.
Writes ``bench/results/modes-<timestamp>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"

WORKLOAD: dict[str, Any] = {
    "train_batch_size": 64, "group_size": 8, "num_instances": 2, "instance_concurrency": 64,
    "max_new_tokens": 256, "engine": "emulated", "sft_steps": 0, "weight_transport": "tcp", "seed": 7,
    "ppo_epochs": 1, "minibatches": 1,
    "emulated": {"vocab": 59, "eos_id": 2, "base_step_s": 0.02, "prefill_s_per_token": 2e-5},
}


def mode_config(mode: str, steps: int, staleness: int) -> dict[str, Any]:
    """The config of one mode on the shared workload (RBS: what each mode keeps in flight)."""
    tbs = WORKLOAD["train_batch_size"]
    rbs = {"sync": tbs, "one_step_off": 2 * tbs, "partial": 2 * tbs, "dora": (staleness + 1) * tbs}[mode]
    return {**WORKLOAD, "mode": mode, "steps": steps, "rollout_batch_size": rbs,
            "max_staleness": staleness if mode == "dora" else 0}


def collect(bootstrap: str, run_id: str, summary: dict[str, Any]) -> dict[str, Any]:
    """Figures of one finished run, read back from its topics."""
    from dora_rl.consumers.audit import audit_run
    from dora_rl.infra import topics
    from dora_rl.infra.kafka_io import read_all
    from dora_rl.infra.runs import get_run
    from dora_rl.schemas.records import InstanceStatus, Metric

    info = get_run(bootstrap, run_id)

    def start(topic: str) -> dict[int, int]:
        return {o.partition: o.offset for o in info.start_offsets if o.topic == topic}

    wait = train = sched = 0.0
    for msg in read_all(bootstrap, topics.METRICS, start(topics.METRICS)):
        m = Metric.decode(msg.value(), msg.headers())
        if m.run_id != run_id:
            continue
        if m.component == "trainer" and m.name == "wait_s" and (m.step or 0) > 0:
            wait += m.value  # step 0's wait includes start-up; every mode pays it alike
        elif m.component == "trainer" and m.name == "train_s":
            train += m.value
        elif m.component == "orchestrator" and m.name == "scheduling_s":
            sched = max(sched, m.value)
    busy: dict[str, float] = {}
    for msg in read_all(bootstrap, topics.INSTANCES, start(topics.INSTANCES)):
        st = InstanceStatus.decode(msg.value(), msg.headers())
        if st.run_id == run_id:
            busy[st.instance_id] = max(busy.get(st.instance_id, 0.0), st.busy_s)
    report = audit_run(bootstrap, run_id)
    rl_wall = float(summary["rl_wall_s"])
    steps = int(summary["steps"])
    n_inst = int(summary["config"]["num_instances"])
    return {
        "run_id": run_id, "engine": "emulated", "audit_ok": report.ok, "audit": report.to_dict(),
        "steps": steps, "rl_wall_s": rl_wall, "trained_tokens": summary["trained_tokens"],
        "throughput_tokens_per_s": summary["throughput_tokens_per_s"], "step_time_s": rl_wall / max(1, steps),
        "rollout_only_share": wait / rl_wall, "trainer_idle_ratio": wait / max(1e-9, wait + train),
        "rollout_idle_ratio": max(0.0, 1 - sum(busy.values()) / (n_inst * rl_wall)),
        "max_staleness_seen": report.max_staleness_seen, "staleness_histogram": report.staleness_histogram,
        "orchestration_overhead": sched / rl_wall, "c1_breaks": report.c1_breaks_expected,
        "config": summary["config"],
    }


def plot(result: dict[str, Any], path: Path) -> None:
    """Six panels: throughput, step time, rollout-only share, idle ratios, staleness, dora ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(result["modes"])
    data = result["modes"]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    panels = [("throughput_tokens_per_s", "trained tokens / s"), ("step_time_s", "mean step time (s)"),
              ("rollout_only_share", "rollout-only share of the step")]
    for ax, (key, title) in zip(axes[0], panels, strict=True):
        ax.bar(modes, [data[m][key] for m in modes], color="tab:blue")
        ax.set_title(title)
    ax = axes[1][0]
    xs = range(len(modes))
    ax.bar([x - 0.2 for x in xs], [data[m]["rollout_idle_ratio"] for m in modes], 0.4, label="rollout instances")
    ax.bar([x + 0.2 for x in xs], [data[m]["trainer_idle_ratio"] for m in modes], 0.4, label="trainer")
    ax.set_xticks(list(xs), modes)
    ax.set_title("idle ratio")
    ax.legend()
    ax = axes[1][1]
    width = 0.8 / max(1, len(modes))
    for i, m in enumerate(modes):
        hist = {int(k): v for k, v in data[m]["staleness_histogram"].items()}
        ks = sorted(hist)
        ax.bar([k + i * width for k in ks], [hist[k] for k in ks], width, label=m)
    ax.set_title("staleness of trained trajectories")
    ax.set_xlabel("staleness (versions)")
    ax.legend()
    ax = axes[1][2]
    ratios = result.get("ratios", {})
    ax.bar(list(ratios), list(ratios.values()), color="tab:green")
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_title("dora throughput / baseline")
    for a in axes.flat:
        a.tick_params(axis="x", labelrotation=15)
    fig.suptitle(f"bench/modes (EMULATED engine, {result['steps']} steps, S={result['staleness']}) — "
                 f"orchestration overhead (dora): {data.get('dora', {}).get('orchestration_overhead', 0):.2%}")
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--staleness", type=int, default=2)
    ap.add_argument("--modes", default="sync,one_step_off,partial,dora")
    ap.add_argument("--bootstrap-servers", default=None, help="use this cluster instead of a fresh local broker")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

    from dora_rl.config import DoraConfig
    from dora_rl.infra.broker import LocalBroker
    from dora_rl.infra.logs import setup_logging
    from dora_rl.launcher import prepare_topics, run

    setup_logging("WARNING")
    broker = None
    bootstrap = args.bootstrap_servers
    if not bootstrap:
        broker = LocalBroker(Path(tempfile.mkdtemp(prefix="bench-modes-")) / "broker", port=0)
        broker.start()
        bootstrap = broker.bootstrap_servers
    from provenance import provenance

    result: dict[str, Any] = {**provenance(), "engine": "emulated", "steps": args.steps, "staleness": args.staleness,
                              "workload": WORKLOAD, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "modes": {}}
    try:
        prepare_topics(bootstrap, 4)
        for mode in args.modes.split(","):
            cfg = DoraConfig.from_dict(mode_config(mode, args.steps, args.staleness))
            print(f"== {mode} (emulated engine) ...", file=sys.stderr, flush=True)
            summary = run(cfg, bootstrap, quiet=True)
            figures = collect(bootstrap, summary["run_id"], summary)
            result["modes"][mode] = figures
            print(f"   {mode:13s} {figures['throughput_tokens_per_s']:8.0f} tok/s  step {figures['step_time_s']:.2f}s  "
                  f"rollout-only {figures['rollout_only_share']:.0%}  "
                  f"rollout idle {figures['rollout_idle_ratio']:.0%}  "
                  f"trainer idle {figures['trainer_idle_ratio']:.0%}  max staleness {figures['max_staleness_seen']}  "
                  f"audit {'PASS' if figures['audit_ok'] else 'FAIL'}", file=sys.stderr, flush=True)
    finally:
        if broker is not None:
            broker.stop()
    modes = result["modes"]
    if "dora" in modes:
        result["ratios"] = {f"dora/{m}": modes["dora"]["throughput_tokens_per_s"] / modes[m]["throughput_tokens_per_s"]
                            for m in modes if m != "dora"}
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    out = Path(args.out) if args.out else RESULTS / f"modes-{stamp}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    plot(result, out.with_suffix(".png"))
    print(json.dumps({"ratios": result.get("ratios", {}),
                      "orchestration_overhead_dora": modes.get("dora", {}).get("orchestration_overhead")}, indent=2))
    print(f"wrote {out} and {out.with_suffix('.png')}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
