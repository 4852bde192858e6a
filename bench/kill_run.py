"""bench/kill_run: one real ``dora-rl run`` with named roles signalled (SIGKILL unless named) at given training
steps, then the audit.

For the real-model check of the crash-proof issue: the default tiny-model workload (or any config),
``--kill trainer@10 --kill orchestrator@18`` kills each role once when that many steps are trained;
``--kill scorer-0@4:TERM`` sends SIGTERM instead (``TERM``, ``INT``, ``HUP``: a stop that is not a kill, after
which the role hands its work back and the supervisor restarts it). Writes the run's summary, the signals sent,
the audit verdict and the versions' checksums (to show no reset) to ``bench/results/killrun-<timestamp>.json``.

Usage: ``python bench/kill_run.py --steps 30 --mode dora --max-staleness 1 --config F --kill trainer@10``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"


def parse_kill(spec: str) -> tuple[str, int, signal.Signals]:
    """``ROLE@STEP[:SIGNAL]`` -> (role, step, signal); SIGKILL when no signal is named."""
    role, _, rest = spec.partition("@")
    at, _, name = rest.partition(":")
    if not role or not at.isdigit():
        raise SystemExit(f"--kill {spec!r}: expected ROLE@STEP[:SIGNAL], e.g. trainer@10:TERM")
    return role, int(at), signal.Signals[f"SIG{name.upper()}"] if name else signal.SIGKILL


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from chaos import RunWatch
    from provenance import provenance

    from dora_rl.consumers.audit import audit_run
    from dora_rl.infra.broker.dist import dora_home
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.runs import get_run, read_run
    from dora_rl.launcher import ensure_broker
    from dora_rl.schemas.records import PolicyVersion

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kill", action="append", default=[], help="ROLE@STEP[:SIGNAL], e.g. trainer@10, dataset@3:TERM")
    ap.add_argument("--bootstrap-servers", default=None)
    args, run_args = ap.parse_known_args()
    measured_on = provenance()
    bootstrap = ensure_broker(args.bootstrap_servers)
    runs = dora_home() / "runs"
    known = {d.name for d in runs.iterdir()} if runs.exists() else set()
    out = Path(f"/tmp/killrun-{os.getpid()}.json")
    proc = subprocess.Popen([sys.executable, "-m", "dora_rl", "run", "--bootstrap-servers", bootstrap, "--quiet",
                             "--json", str(out), *run_args])
    while not (runs.exists() and [d for d in runs.iterdir() if d.name not in known and (d / "pids.json").exists()]):
        time.sleep(0.5)
    rdir = next(d for d in runs.iterdir() if d.name not in known and (d / "pids.json").exists())
    watch = RunWatch(bootstrap, rdir.name)
    kills: list[dict[str, Any]] = []
    for role, at, sig in sorted(map(parse_kill, args.kill), key=lambda k: k[1]):
        while len(watch.steps) < at:
            watch.poll()
        pid = json.loads((rdir / "pids.json").read_text())[role]
        kill = {"role": role, "at_step": len(watch.steps), "pid": pid, "signal": sig.name, "t_kill": time.time()}
        try:
            os.kill(pid, sig)
        except ProcessLookupError:  # the role finished its work and exited (the dataset producer does, early)
            kill["not_sent"] = "the role had exited"
        kills.append(kill)
        done = f"not sent ({kill['not_sent']})" if "not_sent" in kill else "sent"
        print(f"{sig.name} {done} to {role} (pid {pid}) after {len(watch.steps)} steps", file=sys.stderr)
    proc.wait()
    watch.close()
    summary = json.loads(out.read_text())
    report = audit_run(bootstrap, rdir.name)
    info = get_run(bootstrap, rdir.name)
    checksums: dict[int, set[str]] = {}  # the trainer's and every holder's (a restarted trainer's too)
    for msg in (m for t in (topics.VERSIONS, topics.HOLDERS) for m in read_run(bootstrap, info, t)):
        ann = PolicyVersion.decode(msg.value(), msg.headers())
        if ann.run_id == rdir.name:
            checksums.setdefault(int(ann.version), set()).add(",".join(b.checksum for b in ann.buckets))
    result = {**measured_on, "command": " ".join(["python bench/kill_run.py", *sys.argv[1:]]),
              "exit_code": proc.returncode, "kills": kills, "summary": summary, "audit": report.verdict,
              "audit_report": report.to_dict(),
              "checksums_per_version": {v: sorted(c) for v, c in sorted(checksums.items())}}
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"killrun-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=2, default=str))
    print(report.render())
    print(f"steps {summary['steps']}, restarts {summary['restarts']}, reward first5 {summary['reward_first5']:.3f} "
          f"-> last5 {summary['reward_last5']:.3f}; wrote {path}")


if __name__ == "__main__":
    main()
