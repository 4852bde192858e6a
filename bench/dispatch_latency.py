"""bench/dispatch_latency: how long a decided request waits before a rollout instance can act on it.

What runs: ``bench/modes``' workload (real pipeline, emulated engine, 2 instances x 64 slots, TBS 128, S = 2) for the
bounded partial at RBS 1.75x and DORA ``consolidate`` at RBS 3x (the settings ``bench/modes`` chose), one run per
seed, on one local broker; with ``--baseline CHECKOUT`` every run goes first with the roles importing ``dora_rl``
from that checkout (e.g. before a change), then with this tree's, back to back.

Figures per run, from its own topics (wall clocks of one host):

- ``send_delay_ms`` = the request's append time (its Kafka ``CreateTime``, stamped when the orchestrator's
  transaction sends it) - ``dispatched_ms`` (stamped when the rules decided it), apart for GENERATE, CANCEL and
  resumes (a GENERATE carrying partial tokens), and the same for batch plans (``ts_ms``); read_committed readers
  see a record once its transaction commits, right after;
- ``dispatch_to_first_token_ms`` = ``first_token_ms - dispatched_ms`` of each trajectory: the send delay, the
  instance's poll, a wait for KV room or a slot (the engine is KV-bound here: not latency alone), prefill, one step;
- ``version_to_first_token_ms`` = per version and instance, its first token - the version's announcement time;
- the orchestrator's transactions (the last snapshot's commit number), their rate over the run, and its snapshot's
  size (each transaction carries one);
- the run's throughput over the steady steps (as ``bench/modes``; one run per seed is not its comparison).

Usage: ``python bench/dispatch_latency.py [--seeds 3] [--baseline CHECKOUT]``; writes
``bench/results/dispatch-latency-<timestamp>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

CASES = (("partial_bounded", 1), ("dora", 3))
"""(mode, index into ``bench/modes.settings(mode)``): bounded partial RBS 1.75x, DORA consolidate RBS 3x."""


def spread(xs: list[float]) -> dict[str, float]:
    """Mean and quantiles of ``xs`` (empty: ``{"n": 0}``)."""
    if not xs:
        return {"n": 0}
    s = sorted(xs)
    return {"n": len(s), "mean": statistics.fmean(s), "p50": s[len(s) // 2], "p90": s[int(0.9 * len(s))],
            "max": s[-1]}


def request_kind(req: Any) -> str:
    if req.action == "CANCEL":
        return "cancel"
    return "resume" if len(req.partial_ids) else "generate"


def send_delays(bootstrap: str, info: Any) -> dict[str, dict[str, float]]:
    """``send_delay_ms`` per kind of request, and of the batch plans."""
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.runs import read_run
    from dora_rl.schemas.records import BatchPlan, RolloutRequest

    send: dict[str, list[float]] = {"generate": [], "cancel": [], "resume": [], "plan": []}
    for msg in read_run(bootstrap, info, topics.REQUESTS):
        req = RolloutRequest.decode(msg.value(), msg.headers())
        send[request_kind(req)].append(float(msg.timestamp()[1] - req.dispatched_ms))
    for msg in read_run(bootstrap, info, topics.SCHEDULE):
        plan = BatchPlan.decode(msg.value(), msg.headers())
        send["plan"].append(float(msg.timestamp()[1] - plan.ts_ms))
    return {k: spread(v) for k, v in send.items()}


def first_tokens(bootstrap: str, info: Any) -> dict[str, dict[str, float]]:
    """``dispatch_to_first_token_ms`` and ``version_to_first_token_ms``."""
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.runs import read_run
    from dora_rl.schemas.records import PolicyVersion, Trajectory

    announced: dict[int, int] = {}
    for msg in read_run(bootstrap, info, topics.VERSIONS):
        v = PolicyVersion.decode(msg.value(), msg.headers())
        announced.setdefault(int(v.version), msg.timestamp()[1])
    first_token: list[float] = []
    first_of: dict[tuple[int, str], int] = {}
    for msg in read_run(bootstrap, info, topics.TRAJECTORIES):
        t = Trajectory.decode(msg.value(), msg.headers())
        first_token.append(float(t.first_token_ms - t.dispatched_ms))
        key = (int(t.policy_version), t.instance_id)
        first_of[key] = min(first_of.get(key, t.first_token_ms), t.first_token_ms)
    switch = [float(ms - announced[v]) for (v, _), ms in first_of.items() if v in announced and v > 0]
    return {"dispatch_to_first_token_ms": spread(first_token), "version_to_first_token_ms": spread(switch)}


def orchestrator_transactions(bootstrap: str, info: Any, run_id: str) -> dict[str, Any]:
    """The orchestrator's transactions (its last snapshot's commit number), their rate, its snapshot sizes."""
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.runs import read_run
    from dora_rl.infra.kafka.snapshots import snapshot_key
    from dora_rl.schemas.records import ProcessorSnapshot

    key = snapshot_key(run_id, "orchestrator").encode()
    commits, sizes, stamps = 0, list[float](), list[int]()
    for msg in read_run(bootstrap, info, topics.STATE):
        if msg.key() == key:
            snap = ProcessorSnapshot.decode(msg.value(), msg.headers())
            commits = max(commits, snap.commit)
            sizes.append(float(len(snap.state)))
            stamps.append(snap.ts_ms)
    span_s = (max(stamps) - min(stamps)) / 1000 if stamps else 0.0
    return {"orchestrator_transactions": commits, "orchestrator_transactions_per_s": commits / max(1e-3, span_s),
            "orchestrator_snapshot_bytes": spread(sizes)}


def latencies(bootstrap: str, run_id: str) -> dict[str, Any]:
    """The figures of the module docstring, read back from a finished run's topics."""
    from dora_rl.infra.kafka.runs import get_run

    info = get_run(bootstrap, run_id)
    return {**orchestrator_transactions(bootstrap, info, run_id), "send_delay_ms": send_delays(bootstrap, info),
            **first_tokens(bootstrap, info)}


def measure(bootstrap: str, mode: str, index: int, seed: int, code: str | None) -> dict[str, Any]:
    """One run of ``mode``'s setting ``index`` on ``seed``, the roles importing ``dora_rl`` from ``code`` if given."""
    import modes

    from dora_rl.config import DoraConfig
    from dora_rl.launcher import run

    setting = modes.settings(mode, False)[index]
    cfg = modes.mode_config(mode, 10, setting, seed)
    before, cwd = os.environ.get("PYTHONPATH"), os.getcwd()
    if code:  # the roles run ``python -m dora_rl``: the working directory comes first on their path
        os.environ["PYTHONPATH"] = code
        os.chdir(code)
    try:
        summary = run(DoraConfig.from_dict(cfg), bootstrap, quiet=True)
    finally:
        os.chdir(cwd)
        if code:
            os.environ.pop("PYTHONPATH") if before is None else os.environ.update(PYTHONPATH=before)
    fig = modes.collect(bootstrap, summary["run_id"], summary)
    out = {"mode": mode, "setting": setting, "seed": seed, "code": code or "this tree", "run_id": summary["run_id"],
           "throughput_tokens_per_s": fig["throughput_tokens_per_s"], "audit_ok": fig["audit_ok"],
           **latencies(bootstrap, summary["run_id"])}
    gen, plan = out["send_delay_ms"]["generate"], out["send_delay_ms"]["plan"]
    print(f"   {mode:16s} seed {seed} {out['code'][-24:]:>24s}: send {gen.get('mean', 0):6.1f} ms "
          f"(p90 {gen.get('p90', 0):5.0f}), plan {plan.get('mean', 0):6.1f} ms, "
          f"dispatch->first token {out['dispatch_to_first_token_ms']['mean']:6.1f} ms, "
          f"{out['orchestrator_transactions_per_s']:4.1f} orchestrator transactions/s, "
          f"{fig['throughput_tokens_per_s']:5.0f} tok/s", file=sys.stderr, flush=True)
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key in zip(axes, ("send", "first"), strict=True):
        labels, values = [], []
        for r in result["runs"]:
            d = r["send_delay_ms"]["generate"] if key == "send" else r["dispatch_to_first_token_ms"]
            labels.append(f"{r['mode']}\ns{r['seed']} {'base' if r['code'] != 'this tree' else 'new'}")
            values.append(d.get("mean", 0.0))
        ax.bar(range(len(values)), values)
        ax.set_xticks(range(len(values)), labels, fontsize=7)
        ax.set_ylabel("ms (mean)")
        ax.set_title("GENERATE send delay" if key == "send" else "dispatch -> first token (incl. KV-room wait)")
    fig.suptitle(f"dispatch latency, emulated engine ({result['commit'][:7]})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[3])
    ap.add_argument("--baseline", default=None, help="another checkout: each run goes first with the roles importing "
                    "dora_rl from there, then with this tree's")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from provenance import provenance, write_result

    from dora_rl.infra.broker.server import LocalBroker
    from dora_rl.infra.observability.logs import setup_logging
    from dora_rl.launcher import prepare_topics

    setup_logging("WARNING")
    codes = [str(Path(args.baseline).resolve()), None] if args.baseline else [None]
    result: dict[str, Any] = {**provenance(), "engine": "emulated", "seeds": args.seeds, "baseline": codes[0]
                              if args.baseline else None, "runs": []}
    broker = LocalBroker(Path(tempfile.mkdtemp(prefix="bench-latency-")) / "broker", port=0)
    broker.start()
    try:
        prepare_topics(broker.bootstrap_servers, 4)
        for mode, index in CASES:
            for seed in args.seeds:
                for code in codes:
                    result["runs"].append(measure(broker.bootstrap_servers, mode, index, seed, code))
    finally:
        broker.stop()
    path = write_result("dispatch-latency", result)
    plot(result, path.with_suffix(".png"))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
