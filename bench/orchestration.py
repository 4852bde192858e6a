"""bench/orchestration: wall-clock of the real orchestrator scheduling path per training step, at scale.

Drives the rules the orchestrator runs (``make_scheduler``: ``dora_policy``, ``planning``,
``membership``) as the orchestrator role and the simulator do, without Kafka, in a virtual world:
``instances x capacity`` slots (RBS = all of them, TBS = RBS / K), every trajectory decoding for a
long-tailed time (log-normal, p99/p50 = 12, capped at 5x the median; a cancelled one keeps its
progress), a trainer taking ``--step-time-s`` per batch before it publishes the next version.
Events reach the rules as ``KafkaDriver`` delivers them: polls of at most 500 records or 0.05 s,
each followed by a punctuate (a ``Tick``, then ``decide``; the cancelled hand back at once, an
``Aborted`` each, and the rules decide again); ``Completed`` + ``Scored`` per finished trajectory,
``Consumed`` per planned batch, ``VersionSeen`` per version, one ``Heartbeat`` per instance per
``--heartbeat-s`` (:mod:`dora_rl.streams.scheduling_events`). Only the rules' calls are timed
(``time.perf_counter``; their CPU time too, ``time.thread_time``, as a shared machine's wall-clock includes
waiting for a core), not the world.

Per scale: median and max wall ms per training step (one ``VersionSeen`` to the next), by part, with
and without heartbeats, as a fraction of ``--step-time-s``; requests in flight (dispatched, not yet
consumed: the rules' state; and still decoding); growth between scales. Mode ``dora``, S = 2 (K = 3).

Cost per step (from the code; N instances, R <= RBS unconsumed, T = TBS, K = S + 1, P polls, H
heartbeats, M migrations, F instances freed by re-partitions, E re-partitions that move an instance):
``O((T + M) log N + R log R + E N + F log F + P K + H)``: an event O(1) plus O(log N) when a heap is read
next (a group's completion O(G)), an idle punctuate O(K), a dispatch O(log N) per trajectory (a
version's heap is rebuilt, O(N), only after instances change version), a re-partition O(K + the
instances it frees + its migrations) — O(K) when it would decide nothing — and a batch cut O(R log R).
T, R, M, H grow with N.

Usage: ``python bench/orchestration.py [--scales 512 2048 8192] [--capacity 16] [--steps 4]
[--step-time-s 300] [--heartbeat-s 1] [--repartition drain|migrate|consolidate]``; writes
``bench/results/orchestration-<UTC stamp>.json``, ``.png``.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

PARTS = ("events", "heartbeats", "tick", "decide", "aborts", "consumed", "version")


def run_scale(instances: int, capacity: int = 16, *, steps: int = 4, warmup: int = 3, step_time_s: float = 300.0,
              heartbeat_s: float = 1.0, poll_s: float = 0.05, poll_records: int = 500, group_size: int = 16,
              max_staleness: int = 2, decode_median: float = 0.5, seed: int = 0,
              repartition_policy: str | None = None) -> dict[str, Any]:
    """Run ``warmup + steps`` training steps; returns per-step timings (measured steps only) and checks.
    ``repartition_policy``: DORA's (``migrate`` / ``drain`` / ``consolidate``); ``None``: the config's default."""
    from dora_rl.config import DoraConfig
    from dora_rl.streams.rules import make_scheduler
    from dora_rl.streams.scheduling_events import Aborted, Consumed, Decisions, PromptQueued, Tick, VersionSeen

    k = max_staleness + 1
    rbs = instances * capacity // group_size * group_size
    tbs = max(group_size, rbs // k // group_size * group_size)
    total = warmup + steps
    cfg = DoraConfig.from_dict({
        "mode": "dora", "max_staleness": max_staleness, "steps": total + k + 1, "train_batch_size": tbs,
        "rollout_batch_size": rbs, "group_size": group_size, "num_instances": instances,
        "max_instances": instances, "instance_concurrency": capacity, "engine": "emulated",
        **({"repartition_policy": repartition_policy} if repartition_policy else {})})
    sched: Any = make_scheduler(cfg)
    rng = random.Random(seed)
    median_s, sigma, cap_s = decode_median * step_time_s, math.log(12) / 2.326, 5 * decode_median * step_time_s
    for g in range(cfg.steps * tbs // group_size + rbs // group_size):
        sched.handle(PromptQueued(f"g{g}", None))

    heap: list[tuple[float, int, str]] = []  # (finish time, epoch, trajectory id) of what decodes
    epoch: dict[str, int] = {}  # per trajectory: decode epoch (a cancel ends one), finish time, version
    finish: dict[str, float] = {}
    version_of: dict[str, int] = {}
    batches: dict[int, list[str]] = {}
    plan_time: dict[int, float] = {}
    steps_out: list[dict[str, Any]] = []
    cur: dict[str, float] = dict.fromkeys((*PARTS, "cpu"), 0.0)
    polls, peak, migrated, marks = [0], [0], [0], [0, 0, 0]

    def timed(part: str, fn: Callable[[], Any]) -> Any:
        c0 = time.thread_time()  # CPU time too: on a shared machine wall-clock includes waiting for a core
        t0 = time.perf_counter()
        out = fn()
        cur[part] += time.perf_counter() - t0
        cur["cpu"] += time.thread_time() - c0
        return out

    def start(tid: str, now: float, dur: float) -> None:
        epoch[tid] = epoch.get(tid, 0) + 1
        finish[tid] = now + dur
        heapq.heappush(heap, (now + dur, epoch[tid], tid))

    def punctuate(now: float) -> None:
        polls[0] += 1
        timed("tick", partial(sched.handle, Tick(now)))
        while carry_out(timed("decide", sched.decide), now):
            pass  # the cancelled hand back at once (as in the simulator): their resumes are decided now

    def carry_out(decided: Decisions[None], now: float) -> bool:
        for d in decided.dispatches:
            version_of[d.trajectory_id] = d.version
            start(d.trajectory_id, now, min(cap_s, rng.lognormvariate(math.log(median_s), sigma)))
        for c in decided.cancels:
            migrated[0] += len(c.trajectory_ids)
            for tid in c.trajectory_ids:
                epoch[tid] += 1  # it stops decoding there
                timed("aborts", partial(sched.handle, Aborted(tid, finish[tid] - now, c.instance)))  # decode left
        for mig, _target in decided.resumes:
            left = mig.partial if mig.partial is not None else rng.lognormvariate(math.log(median_s), sigma)
            start(mig.trajectory_id, now, max(0.0, left))
        peak[0] = max(peak[0], sched.planner.unplanned())
        for step, tids in decided.plans:
            batches[step], plan_time[step] = list(tids), now
            timed("consumed", partial(sched.handle, Consumed(step, tids)))
        return bool(decided.cancels)

    now, version, version_at = 0.0, 0, 0.0
    hb_round, hb_index = 1, 0
    timed("version", partial(sched.handle, VersionSeen(0, 0.0)))
    punctuate(now)
    while version < total:
        if version in plan_time and now >= max(plan_time[version], version_at) + step_time_s:
            decoding = sum(1 for f in _live(heap, epoch).values() if f > now)
            steps_out.append({**{p: cur[p] * 1e3 for p in PARTS}, "wall_ms": sum(cur[p] for p in PARTS) * 1e3,
                              "cpu_ms": cur["cpu"] * 1e3,
                              "polls": polls[0], "virtual_s": now - version_at, "decoding": decoding,
                              "unconsumed_peak": peak[0], "repartitions": sched.repartitions - marks[0],
                              "unchanged_repartitions": getattr(sched, "unchanged_repartitions", 0) - marks[2],
                              "switches": sched.switches - marks[1], "migrations": migrated[0]})
            cur = dict.fromkeys((*PARTS, "cpu"), 0.0)
            polls[0], peak[0], migrated[0] = 0, 0, 0
            marks[:] = [sched.repartitions, sched.switches, getattr(sched, "unchanged_repartitions", 0)]
            version, version_at = version + 1, now
            timed("version", partial(sched.handle, VersionSeen(version, now)))
            punctuate(now)
            continue
        end, last = now + poll_s, now  # one poll: what arrives within poll_s, at most poll_records
        done: list[str] = []
        beats: list[tuple[int, float]] = []
        while 2 * len(done) + len(beats) < poll_records:
            t_hb = (hb_round + hb_index / instances) * heartbeat_s if heartbeat_s > 0 else math.inf
            while heap and epoch[heap[0][2]] != heap[0][1]:
                heapq.heappop(heap)  # cancelled: a stale finish time
            t_c = heap[0][0] if heap else math.inf
            if min(t_c, t_hb) > end:
                break
            if t_c <= t_hb:
                done.append(heapq.heappop(heap)[2])
            else:
                beats.append((hb_index, t_hb))
                hb_index, hb_round = (0, hb_round + 1) if hb_index + 1 == instances else (hb_index + 1, hb_round)
            last = max(last, min(t_c, t_hb))
        now = last if 2 * len(done) + len(beats) >= poll_records else end

        timed("events", partial(_deliver, sched, done))
        timed("heartbeats", partial(_beat, sched, beats))
        punctuate(now)
        if now > 100 * total * step_time_s:
            raise RuntimeError(f"no progress by virtual {now:.0f}s: {sched.describe()[:400]}")
    for st in steps_out:
        st["sched_ms"] = st["wall_ms"] - st["heartbeats"]
    return {"instances": instances, "capacity": capacity, "slots": instances * capacity, "rbs": rbs, "tbs": tbs,
            "group_size": group_size, "max_staleness": max_staleness, "steps": steps_out[warmup:],
            **_check(sched, version_of, batches, tbs, max_staleness, heap, epoch)}


def _deliver(sched: Any, done: list[str]) -> None:
    from dora_rl.streams.scheduling_events import Completed, Scored
    for tid in done:  # the trajectories topic, then the scored one
        sched.handle(Completed(tid))
        sched.handle(Scored(tid))


def _beat(sched: Any, beats: list[tuple[int, float]]) -> None:
    from dora_rl.streams.scheduling_events import Heartbeat
    for i, t in beats:
        sched.handle(Heartbeat(i, t))


def _live(heap: list[tuple[float, int, str]], epoch: dict[str, int]) -> dict[str, float]:
    """Trajectories decoding now (valid heap entries) and their finish times."""
    return {t: f for f, e, t in heap if epoch[t] == e}


def _check(sched: Any, version_of: dict[str, int], batches: dict[int, list[str]], tbs: int, s: int,
           heap: list[tuple[float, int, str]], epoch: dict[str, int]) -> dict[str, Any]:
    """Every dispatched trajectory is in exactly one batch (TBS, staleness in [0, S]) or still accounted for."""
    batched = [t for b in batches.values() for t in b]
    stale = [k - version_of[t] for k, b in batches.items() for t in b]
    unplanned = set(version_of) - set(batched)
    resuming = {m.trajectory_id for m, _ in sched._resume} | set(sched.state.migrating)
    alive = set(_live(heap, epoch)) | resuming
    lost = [t for t in unplanned if t not in sched.planner.version_of
            or (not sched.state.trajs[t].done and t not in alive)]
    return {"dispatched": len(version_of), "batched": len(batched), "unplanned": len(unplanned),
            "duplicates": len(batched) - len(set(batched)), "unaccounted": len(lost),
            "bad_batches": sum(1 for b in batches.values() if len(b) != tbs),
            "staleness_range": [min(stale, default=0), max(stale, default=0)],
            "accounted": not lost and len(batched) == len(set(batched)) and all(0 <= x <= s for x in stale)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scales", type=int, nargs="+", default=[512, 2048, 8192], help="rollout instances")
    ap.add_argument("--capacity", type=int, default=16, help="slots per instance (RBS = instances x capacity)")
    ap.add_argument("--steps", type=int, default=4, help="measured training steps per scale")
    ap.add_argument("--warmup", type=int, default=3, help="steps run before measuring (fill the pipeline)")
    ap.add_argument("--step-time-s", type=float, default=300.0, help="reference step time (trainer time per batch)")
    ap.add_argument("--heartbeat-s", type=float, default=1.0, help="instance heartbeat interval (0: none)")
    ap.add_argument("--decode-median", type=float, default=0.5, help="median decode time, in steps")
    for flag, default in (("--max-staleness", 2), ("--group", 16), ("--seed", 0)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--repartition", choices=("migrate", "drain", "consolidate"), default=None,
                    help="DORA's re-partition policy (default: the config's, recorded in the result)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from provenance import provenance, write_result

    from dora_rl.config import DoraConfig

    out: dict[str, Any] = {**provenance(), "engine": "virtual world, real scheduling rules (no Kafka)",
                           "args": vars(args), "cpus": os.cpu_count(), "scales": {},
                           "repartition_policy": args.repartition or DoraConfig().repartition_policy}
    med = statistics.median
    for n in args.scales:
        t0, load0 = time.perf_counter(), os.getloadavg()[0]
        r = run_scale(n, args.capacity, steps=args.steps, warmup=args.warmup, step_time_s=args.step_time_s,
                      heartbeat_s=args.heartbeat_s, group_size=args.group, max_staleness=args.max_staleness,
                      decode_median=args.decode_median, seed=args.seed, repartition_policy=args.repartition)
        st = r["steps"]
        for key in ("wall_ms", "sched_ms", "cpu_ms"):
            r[f"{key}_median"], r[f"{key}_max"] = med(s[key] for s in st), max(s[key] for s in st)
            r[f"{key}_fraction"] = r[f"{key}_median"] / 1e3 / args.step_time_s  # of --step-time-s
            r[f"{key}_max_fraction"] = r[f"{key}_max"] / 1e3 / args.step_time_s
            r[f"{key}_own_step_fraction_max"] = max(s[key] / 1e3 / s["virtual_s"] for s in st)
        r.update(in_flight=med(s["unconsumed_peak"] for s in st), decoding=med(s["decoding"] for s in st),
                 virtual_step_s=med(s["virtual_s"] for s in st), polls=med(s["polls"] for s in st),
                 parts_median_ms={p: med(s[p] for s in st) for p in PARTS}, run_s=time.perf_counter() - t0,
                 loadavg=[load0, os.getloadavg()[0]])
        out["scales"][str(n)] = r
        print(f"{n:5d} instances x {args.capacity}: in flight {r['in_flight']:.0f} (decoding {r['decoding']:.0f}); "
              f"per step median {r['wall_ms_median']:.0f} ms, max {r['wall_ms_max']:.0f} ms = "
              f"{r['wall_ms_fraction']:.3%} / {r['wall_ms_max_fraction']:.3%} of {args.step_time_s:g} s (without "
              f"heartbeats {r['sched_ms_median']:.0f} / {r['sched_ms_max']:.0f} ms; CPU {r['cpu_ms_median']:.0f} / "
              f"{r['cpu_ms_max']:.0f} ms = {r['cpu_ms_fraction']:.3%}); accounted {r['accounted']} "
              f"({r['run_s']:.0f} s, load {load0:.1f} on {os.cpu_count()} cpus)", flush=True)
        print("      " + "  ".join(f"{p} {v:.0f}" for p, v in r["parts_median_ms"].items()) + " (ms)", flush=True)
    sc = out["scales"]
    ns = [int(n) for n in sc]
    out["growth"] = [{"instances": [a, b], "wall_x": sc[str(b)]["wall_ms_median"] / sc[str(a)]["wall_ms_median"],
                      "sched_x": sc[str(b)]["sched_ms_median"] / sc[str(a)]["sched_ms_median"]}
                     for a, b in itertools.pairwise(ns)]
    path = write_result("orchestration", out, args.out)

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    bottom = [0.0] * len(ns)
    for p in PARTS:
        vals = [sc[str(n)]["parts_median_ms"][p] for n in ns]
        axes[0].bar([str(n) for n in ns], vals, bottom=bottom, label=p)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    axes[0].set(title="orchestrator wall ms per step (median), by part", xlabel="instances", ylabel="ms")
    for key, style, label in (("wall_ms_median", "o-", "median"), ("wall_ms_max", "s--", "max"),
                              ("sched_ms_median", "^:", "median, without heartbeats")):
        axes[1].loglog(ns, [sc[str(n)][key] for n in ns], style, label=label)
    axes[1].axhline(args.step_time_s * 10, color="r", lw=0.8, label=f"1% of {args.step_time_s:.0f}s step")
    axes[1].set(title="wall ms per step vs instances", xlabel="instances", ylabel="ms")
    for a in axes:
        a.legend(fontsize=7)
    fig.suptitle(f"orchestrator scheduling path (dora, S={args.max_staleness}, {args.capacity} slots/instance, "
                 f"RBS = slots, heartbeat {args.heartbeat_s:g} s)")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=90)
    print("growth:" if ns[1:] else "", ", ".join(f"{g['instances'][0]}->{g['instances'][1]}: x{g['wall_x']:.2f} "
                                                 f"(without heartbeats x{g['sched_x']:.2f})" for g in out["growth"]))
    print(f"wrote {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
