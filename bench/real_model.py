"""A real model trained through Kafka, measured: ``dora-rl run`` on an example config, then the audit.

Runs the whole system (embedded broker, every role as its own process) on ``--config`` (default
``examples/configs/smollm2-gym.toml``: SmolLM2-135M-Instruct, DORA S = 1, a reasoning-gym task) and
writes ``bench/results/real-model-<UTC>.json`` with the commit, the run's summary (held-out pass@1 at
version 0 and at the end with the paired 95% bootstrap interval of the difference, training wall time
with the evaluation timed apart) and the audit's verdict; the run's plot is copied next to it.

Usage::

    .venv/bin/python bench/real_model.py [--config F] [--steps N]
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import REPO, provenance, write_result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(REPO / "examples" / "configs" / "smollm2-gym.toml"))
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from dora_rl.config import DoraConfig
    from dora_rl.consumers.audit import audit_run
    from dora_rl.launcher import ensure_broker, run

    prov = provenance()
    config = DoraConfig.load(args.config, steps=args.steps)
    bootstrap = ensure_broker(None)
    t0 = time.monotonic()
    summary = run(config, bootstrap)
    report = audit_run(bootstrap, summary["run_id"])
    out = {**prov, "command": " ".join(sys.argv), "config_file": args.config, "wall_s": time.monotonic() - t0,
           "summary": summary, "audit_ok": report.ok, "audit": report.to_dict()}
    path = write_result("real-model", out, args.out)
    plot = Path(summary["logs"]).parent / "summary.png"
    if plot.exists():
        shutil.copy(plot, path.with_suffix(".png"))
    delta = summary.get("eval_delta", {})
    print(f"wrote {path}: steps {summary['steps']}, train {summary.get('train_wall_s_excl_eval')} s (eval apart), "
          f"pass@1 {[e['pass_at_1'] for e in summary.get('eval', [])]}, diff {delta.get('pass_at_1_diff')} "
          f"CI95 {delta.get('ci95')}, audit {'PASS' if report.ok else 'FAIL'}")
    return 0 if report.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
