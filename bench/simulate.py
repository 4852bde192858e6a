"""bench/simulate: the scheduling modes at scale, on the discrete-event simulator (virtual clock).

The simulator (``dora_rl.streams.simulator``) runs the same scheduler, planner and assembler code as
the real processes; instances follow the emulated engine's calibrated decode model and long-tailed
lengths, the trainer a linear cost per token. Results are labelled ``simulated``.

Defaults approximate the paper's setting in shape, not in absolute speed: many instances, a 4096-
token cap with a long tail, training about as long as a typical rollout phase. The sweep varies S.

Usage: ``python bench/simulate.py [--instances 64] [--steps 40] [--tbs 512]``; writes
``bench/results/simulate-<timestamp>.json`` and ``.png``.

``python bench/simulate.py --paper [--fit]`` runs the paper's setup instead (``bench/paper.py``: Qwen2.5-32B,
DAPO-Math-like lengths, H800, K = 3): every mode's sweep on one seed, its best setting on every seed
(default 3), at 64 and 128 GPUs; with ``--fit``, ``train_mfu`` (the one fitted parameter) is chosen first on
the 64-GPU ratios, then frozen, so the 128-GPU ratios are predictions. Each of the paper's ratios is
reported next to ours with its per-seed spread and whether it is within 15%; writes
``bench/results/paper-sim-<timestamp>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--instances", type=int, default=64)
    ap.add_argument("--capacity", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--tbs", type=int, default=512)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=4096)
    ap.add_argument("--train-s-per-token", type=float, default=1e-4)
    ap.add_argument("--out", default=None)
    ap.add_argument("--paper", action="store_true", help="the paper's setup (see the module docstring)")
    ap.add_argument("--fit", action="store_true", help="--paper: fit train_mfu on the 64-GPU ratios first")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="--paper: seeds of the best settings")
    ap.add_argument("--gpus", type=int, nargs="+", default=[64, 128], help="--paper: cluster sizes")
    ap.add_argument("--workers", type=int, default=2, help="--paper: simulations run in parallel")
    ap.add_argument("--train-mfu", type=float, default=None, help="--paper without --fit: the trainer's MFU")
    ap.add_argument("--tps", type=int, nargs="+", default=[4], help="--paper: rollout TPs swept (report 0041)")
    ap.add_argument("--hop-us", type=float, default=0.5, help="--paper: all-reduce hop latency at a TP other than 4")
    args = ap.parse_args(argv)
    if args.paper:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from paper_report import drive

        return drive(args)

    from dora_rl.config import DoraConfig
    from dora_rl.core.emulation import EmulatedParams
    from dora_rl.streams.simulator import simulate

    params = EmulatedParams(time_scale=0.0, base_step_s=0.03, seed=11)
    base = {"steps": args.steps, "train_batch_size": args.tbs, "group_size": args.group,
            "num_instances": args.instances, "instance_concurrency": args.capacity,
            "max_new_tokens": args.max_new_tokens, "engine": "emulated", "num_partitions": 16}
    runs = [("sync", 0, args.tbs), ("one_step_off", 1, 2 * args.tbs), ("partial", 0, 2 * args.tbs)]
    runs += [("dora", s, (s + 1) * args.tbs) for s in (1, 2, 3)]
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from provenance import config_mode, provenance, write_result

    out: dict[str, Any] = {**provenance(), "engine": "simulated (emulated decode model)", "args": vars(args),
                           "params": params.__dict__, "modes": {}}
    for mode, s, rbs in runs:
        cfg = DoraConfig.from_dict({**base, "mode": config_mode(mode), "max_staleness": s, "rollout_batch_size": rbs,
                                    "num_partitions": max(16, args.instances),
                                    "max_instances": max(16, args.instances)})
        t0 = time.perf_counter()
        r = simulate(cfg, params, train_s_per_token=args.train_s_per_token, train_s_fixed=1.0)
        name = mode if mode != "dora" else f"dora_S{s}"
        slots = args.instances * args.capacity
        out["modes"][name] = {
            "throughput_tokens_per_s": r.throughput, "step_time_s": r.wall_s / max(1, r.steps), "steps": r.steps,
            "trainer_idle_ratio": 1 - r.trainer_busy_s / r.wall_s, "rollout_busy_ratio": r.instance_busy_s /
            (args.instances * r.wall_s), "max_staleness_seen": max(r.staleness), "refused": r.refused,
            "c1_breaks": r.mixed_version_trajectories, "migrations": r.migrations, "slots": slots,
            "sim_seconds": time.perf_counter() - t0}
        m = out["modes"][name]
        print(f"{name:13s} {m['throughput_tokens_per_s']:9.0f} tok/s  step {m['step_time_s']:6.1f}s  trainer idle "
              f"{m['trainer_idle_ratio']:.0%}  max staleness {m['max_staleness_seen']}  refused {m['refused']}  "
              f"C1 breaks {m['c1_breaks']}  ({m['sim_seconds']:.1f}s to simulate)", flush=True)
    modes = out["modes"]
    out["ratios"] = {f"{d}/{b}": modes[d]["throughput_tokens_per_s"] / modes[b]["throughput_tokens_per_s"]
                     for d in modes if d.startswith("dora") for b in ("sync", "one_step_off", "partial")}
    path = write_result("simulate", out, args.out)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    names = list(modes)
    axes[0].bar(names, [modes[n]["throughput_tokens_per_s"] for n in names])
    axes[0].set_title("trained tokens / simulated s")
    axes[1].bar(names, [modes[n]["trainer_idle_ratio"] for n in names])
    axes[1].set_title("trainer idle ratio")
    for a in axes:
        a.tick_params(axis="x", labelrotation=20)
    fig.suptitle(f"SIMULATED: {args.instances} instances x {args.capacity} slots, TBS {args.tbs}, "
                 f"cap {args.max_new_tokens} tokens")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=90)
    print(json.dumps(out["ratios"], indent=2))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
