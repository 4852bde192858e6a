"""bench/pipeline: the Kafka path's own cost, trajectories/s carried durably from rollout to committed batch.

What runs: the real ``dora-rl scorer`` (built-in ``task`` reward, in its reward worker) and ``dora-rl assembler``,
each its own process started by its console entry point, in a run recorded with ``create`` on the embedded
broker (replication 1). The bench plays the rollout instances (their producer settings: idempotent, acks=all;
``Trajectory`` records keyed and partitioned as ``producers/rollout/worker.py`` writes them, encoded before the
clock starts) and the orchestrator's plans: with ``--plans scored`` (the real order) batch ``k`` is planned, in a
transaction of its own, once all its trajectories are committed on ``dora.rollout.scored`` (the orchestrator's
rule; the real orchestrator commits a plan as soon as it is decided, decision 0078); with ``ahead`` every plan is
written first, so the path is the scorer and the assembler alone.

Workload: TBS trajectories a step in whole groups of G, responses of U[64, 512] tokens, 64 prompt tokens, task
``reverse``, version ``k`` in step ``k``; produced step after step at each of ``--rates`` trajectories/s (0: as
fast as the producer goes, i.e. the saturated throughput, whose latency is mostly backlog), after ``--warmup``
unmeasured steps produced at the same rate (a broker in a run lives for hours: its JIT has compiled the paths that
load takes; 160 steps at 2,100/s is ~20 s). The default rate is 2,100/s so that the carried throughput, whose window
includes the last batch's latency, can show 2,000/s. Each phase runs ``--repeats`` times (the tail moves between
runs on 2 shared cores), on a fresh local broker per ``--broker-jit`` setting (``JIT``: the shipped JVM options,
i.e. HotSpot's tiered JIT, or C1 only), the settings back to back in one invocation, each broker first warmed until
its JIT has settled (``--broker-warmup``, ``--jit-settled``; decision 0038).

Formulas, on the bench's monotonic clock: ``ack(t)`` = the producer's delivery report of trajectory t (acks=all);
``seen(x)`` = when a read_committed consumer in the bench gets x (its commit, plus one fetch).
  throughput = measured trajectories / (seen(last batch) - first ack)   (one scorer and one assembler process)
  latency(k) = seen(batch k) - max ack over batch k;   fill(k) = max ack - min ack over batch k (reported apart)
  hops: scorer = seen(last scored of k) - max ack; planner = plan committed - that; assembler = the rest
CPU per process (psutil, user+system over the measured window; the scorer's reward workers apart), the broker's
per thread group (``/proc``: JIT compilers, request handlers, coordinators...), and the machine's 1-minute load
average before and after each phase (other work on the machine shows there).

Usage: ``python bench/pipeline.py [--rates 2100,0] [--plans scored,ahead] [--steps 40] [--warmup 160] [--repeats 3]
[--broker-jit shipped] [--broker-warmup 10] [--tbs 256] [--group 8] [--baseline OTHER_CHECKOUT] [--profile DIR]``;
writes ``bench/results/pipeline-<UTC timestamp>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import psutil
from confluent_kafka import Consumer, TopicPartition

RESULTS = Path(__file__).resolve().parent / "results"
#: JIT settings of the local broker compared with ``--broker-jit`` (HotSpot: a later flag wins over the shipped one).
JIT = {"shipped": (), "c1": ("-XX:TieredStopAtLevel=1",), "tiered": ("-XX:TieredStopAtLevel=4",)}
Wire = tuple[bytes, bytes, list[tuple[str, str | bytes | None]], int]  # value, key, headers, partition


def workload(run_id: str, steps: int, tbs: int, group: int, partitions: int, seed: int,
             token: str = "") -> list[list[Wire]]:
    """Encoded trajectories per step (group ``<run>/p<i>``, trajectory ``<group>/<j>``, version = step), each
    signed with the run's ``token`` as an instance signs it (decision 0062)."""
    from dora_rl.infra.kafka.keys import make_key, partition_for
    from dora_rl.infra.kafka.signing import signed
    from dora_rl.schemas.records import Trajectory

    rng, out = random.Random(seed), []
    for k in range(steps):
        recs: list[Wire] = []
        for g in range(tbs // group):
            gid = f"{run_id}/p{k * (tbs // group) + g}"
            ref = "".join(rng.choice("abcdefghij") for _ in range(rng.randint(64, 512)))
            for j in range(group):  # token ids below 50: inside the vocabulary the run records (its model's, 59)
                text = ref if j % 2 == 0 else ref[::-1][:len(ref) + rng.randint(-8, 8)]
                t = Trajectory(run_id=run_id, trajectory_id=f"{gid}/{j}", group_id=gid, prompt_id=gid, sample_index=j,
                               group_size=group, policy_version=k, task="reverse", reference=ref,
                               prompt_ids=np.arange(64, dtype=np.int32) % 50, response_ids=np.ones(len(text), np.int32),
                               behaviour_logprobs=np.full(len(text), -0.5, np.float32), response_text=text,
                               instance_id="rollout-0", instance_version=k, dispatched_ms=1, first_token_ms=2,
                               finished_ms=3)
                value, headers = signed(t, token).encode()
                recs.append((value, make_key(k, gid).encode(), list(headers), partition_for(gid, partitions)))
        out.append(recs)
    return out


class Observer(threading.Thread):
    """Reads dora.rollout.scored and dora.train.batches (read_committed, keys only); plans on scored if asked."""

    def __init__(self, bootstrap: str, run_id: str, start: dict[tuple[str, int], int], groups: int, group: int,
                 plan: Callable[[list[int]], None] | None) -> None:
        from dora_rl.infra.kafka import topics
        from dora_rl.infra.kafka.io import reader_config

        super().__init__(daemon=True)
        self.run_id, self.groups, self.group, self.plan = run_id, groups, group, plan
        self.batches = topics.in_run(run_id, topics.BATCHES)
        self.consumer = Consumer(reader_config(bootstrap, f"bench-observer-{run_id}"))
        self.consumer.assign([TopicPartition(t, p, o) for (t, p), o in start.items()
                              if t in (topics.in_run(run_id, topics.SCORED), self.batches)])
        self.per_group: dict[str, int] = {}
        self.left: dict[int, int] = {}
        self.scored_t: dict[int, float] = {}
        self.plan_t: dict[int, float] = {}
        self.batch_t: dict[int, float] = {}
        self.stop = threading.Event()

    def run(self) -> None:
        from dora_rl.infra.kafka.keys import parse_key

        while not self.stop.is_set():
            first = self.consumer.poll(0.01)
            for msg in [] if first is None else [first, *self.consumer.consume(1000, 0)]:
                if msg.error() is not None:
                    continue
                now = time.monotonic()
                step, suffix = parse_key(msg.key() or b"")
                if msg.topic() == self.batches:
                    if self.run_id.encode() in (msg.value() or b"")[:64]:
                        self.batch_t.setdefault(int(step or 0), now)
                    continue
                self.per_group[suffix] = n = self.per_group.get(suffix, 0) + 1
                if n == self.group and suffix.startswith(self.run_id):
                    k = int(step or 0)
                    self.left[k] = left = self.left.get(k, self.groups) - 1
                    if left == 0:
                        self.scored_t[k] = now
                        if self.plan is not None:
                            self.plan([k])
                            self.plan_t[k] = time.monotonic()
        self.consumer.close()


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) * 1000 if xs else float("nan")


def cpu_s(procs: dict[str, list[psutil.Process]]) -> dict[str, float]:
    """User+system CPU seconds so far of each named set of processes."""
    return {name: sum(sum(p.cpu_times()[:2]) for p in ps) for name, ps in procs.items()}


def thread_cpu_s(pid: int | None) -> dict[str, float]:
    """User+system CPU seconds so far of each thread group of process ``pid`` (names from ``/proc``, trailing
    digits dropped: the JVM's JIT compilers, GC, request handlers, network threads... apart)."""
    out: dict[str, float] = {}
    if pid is None:
        return out
    for t in psutil.Process(pid).threads():
        try:
            name = Path(f"/proc/{pid}/task/{t.id}/comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        name = re.sub(r"[-_ ]*\d+[-_\d]*$", "", name) or "?"
        out[name] = out.get(name, 0.0) + t.user_time + t.system_time
    return out


def start_roles(bootstrap: str, run: str, tag: str, logs: Path, args: argparse.Namespace,
                code: str | None, rdir: Path) -> dict[str, subprocess.Popen[bytes]]:
    """``dora-rl scorer`` and ``dora-rl assembler`` of ``run`` (under cProfile with ``--profile``; importing
    ``dora_rl`` from the checkout ``code`` when given), with the run's token and scorer key as ``dora-rl run``
    gives them (``rdir``: the run's directory), so every record is signed and checked as in a run."""
    exe = shutil.which("dora-rl", path=str(Path(sys.executable).parent))
    env = {**os.environ, **({"PYTHONPATH": code} if code else {}), "DORA_WEIGHT_TOKEN_FILE": str(rdir / "weight-token"),
           "DORA_SCORER_KEY_FILE": str(rdir / "scorer-key")}
    roles = {}
    for role in ("scorer", "assembler"):
        prof = [sys.executable, "-m", "cProfile", "-o", f"{args.profile}/{tag}-{role}.prof"] if args.profile else []
        cmd = [*prof, exe] if exe else [*(prof or [sys.executable]), "-m", "dora_rl"]
        roles[role] = subprocess.Popen(
            [*cmd, "--log-level", args.role_log_level, role, "--bootstrap-servers", bootstrap, "--run-id", run],
            stdout=(logs / f"{tag}-{role}.log").open("w"), stderr=subprocess.STDOUT, env=env)
    return roles


def phase(bootstrap: str, broker_pid: int | None, args: argparse.Namespace, rate: float, plans: str,
          logs: Path, code: str | None) -> dict[str, Any]:
    """One run: roles started, warm-up, ``args.steps`` measured steps at ``rate``, roles stopped, batches checked."""
    from dora_rl.config import DoraConfig
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.io import RecordProducer
    from dora_rl.infra.kafka.keys import make_key
    from dora_rl.infra.kafka.runs import offsets_map, read_run
    from dora_rl.infra.kafka.signing import signed
    from dora_rl.launcher import create
    from dora_rl.schemas.records import BatchPlan, TrainBatch

    load0 = os.getloadavg()[0]
    total, groups = args.warmup + args.steps, args.tbs // args.group
    cfg = DoraConfig.from_dict({"mode": "dora", "max_staleness": 1, "steps": total, "train_batch_size": args.tbs,
                                "rollout_batch_size": 2 * args.tbs, "group_size": args.group,
                                "num_partitions": args.partitions, "task": "reverse", "reward_fn": "task"})
    info, token_file = create(cfg, bootstrap)
    run, start, token = info.run_id, offsets_map(info), token_file.read_text().strip()
    steps = workload(run, total, args.tbs, args.group, args.partitions, args.seed, token)
    ids = [[f"{run}/p{k * groups + g}/{j}" for g in range(groups) for j in range(args.group)] for k in range(total)]
    planner = RecordProducer(bootstrap, f"bench-planner-{run}", **{"transactional.id": f"dora.{run}.bench-planner"})
    planner.init_transactions()

    def plan(ks: list[int]) -> None:  # as the orchestrator's commit: plans in one transaction
        planner.raw.begin_transaction()
        for k in ks:
            plan_k = BatchPlan(run_id=run, train_step=k, trajectory_ids=tuple(ids[k]), ts_ms=int(time.time() * 1000))
            planner.send(topics.in_run(run, topics.SCHEDULE), signed(plan_k, token), make_key(k, "plan"))
        planner.raw.commit_transaction(30)

    obs = Observer(bootstrap, run, start, groups, args.group, plan if plans == "scored" else None)
    obs.start()
    roles = start_roles(bootstrap, run, f"{plans}-{rate:g}{'-baseline' if code else ''}", logs, args, code,
                        token_file.parent)
    if plans == "ahead":
        plan(list(range(total)))
    producer = RecordProducer(bootstrap, f"bench-rollout-{run}")  # the rollout instances' producer settings
    trajectories = topics.in_run(run, topics.TRAJECTORIES)
    acks: dict[tuple[int, int], float] = {}
    failed: list[str] = []

    def produce(k: int, i: int, w: Wire) -> None:
        def done(err: Any, msg: Any) -> None:
            acks[(k, i)] = time.monotonic()
            if err is not None:
                failed.append(str(err))
        while True:
            try:
                producer.raw.produce(trajectories, value=w[0], key=w[1], headers=w[2], partition=w[3],
                                     on_delivery=done)
                break
            except BufferError:
                producer.raw.poll(0.005)

    def wait_batches(ks: range, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not all(k in obs.batch_t for k in ks):
            if time.monotonic() > deadline or any(p.poll() is not None for p in roles.values()):
                return False
            producer.raw.poll(0.005)
        return True

    def produce_paced(ks: range) -> float:
        """Steps ``ks`` at ``rate`` (0: as fast as possible); returns when pacing started."""
        t, n = time.monotonic(), 0
        for k in ks:
            for i, w in enumerate(steps[k]):
                if rate > 0 and (left := t + n / rate - time.monotonic()) > 0:
                    time.sleep(left)  # not poll(left): librdkafka rounds it down to 0 ms and spins
                produce(k, i, w)
                producer.raw.poll(0)  # delivery reports, timed when served
                n += 1
        return t

    try:
        produce_paced(range(args.warmup))  # at the measured rate: the JVM compiles the paths that rate takes
        if not wait_batches(range(args.warmup), 180):
            raise RuntimeError(f"warm-up batches never committed; role logs in {logs}")
        scorer = psutil.Process(roles["scorer"].pid)
        procs = {"scorer": [scorer], "assembler": [psutil.Process(roles["assembler"].pid)],
                 "reward_workers": scorer.children(recursive=True),
                 "broker": [psutil.Process(broker_pid)] if broker_pid else [], "bench": [psutil.Process()]}
        cpu0, threads0 = cpu_s(procs), thread_cpu_s(broker_pid)
        t0 = produce_paced(range(args.warmup, total))
        t_produced = time.monotonic()
        producer.flush(60)
        ok = wait_batches(range(args.warmup, total), 120)
        cpu1, threads1 = cpu_s(procs), thread_cpu_s(broker_pid)
    finally:
        for p in roles.values():
            p.terminate()
        for p in roles.values():
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        obs.stop.set()
        obs.join(5)
    ks = [k for k in range(args.warmup, total) if k in obs.batch_t]
    span = {k: (min(acks[(k, i)] for i in range(args.tbs)), max(acks[(k, i)] for i in range(args.tbs))) for k in ks}
    lat, fill = [obs.batch_t[k] - span[k][1] for k in ks], [b - a for a, b in span.values()]
    hops = {"scorer": [obs.scored_t[k] - span[k][1] for k in ks if k in obs.scored_t],
            "planner": [obs.plan_t[k] - obs.scored_t[k] for k in ks if k in obs.plan_t],
            "assembler": [obs.batch_t[k] - max(obs.scored_t.get(k, 0.0), obs.plan_t.get(k, 0.0)) for k in ks]}
    window = max(obs.batch_t[k] for k in ks) - min(acks[(args.warmup, i)] for i in range(args.tbs)) if ks else 0.0
    problems, got = failed[:3], {}
    for msg in read_run(bootstrap, info, topics.BATCHES):
        b = TrainBatch.decode(msg.value(), msg.headers())
        if b.run_id == run:
            if int(b.train_step) in got or any(t.reward is None for t in b.trajectories):
                problems.append(f"batch {b.train_step}: a second copy, or an unscored trajectory")
            got[int(b.train_step)] = sorted(t.trajectory_id for t in b.trajectories)
    problems += [f"batch {k}: missing, or not its plan" for k in range(total) if got.get(k) != sorted(ids[k])]
    n_traj, used = args.steps * args.tbs, {name: cpu1[name] - cpu0[name] for name in cpu0}
    return {"plans": plans, "rate_target": rate, "roles_from": code or "this tree", "run_id": run,
            "loadavg_1m": [load0, os.getloadavg()[0]],
            "all_committed": ok, "verified": not problems, "problems": problems[:5], "measured_trajectories": n_traj,
            "measured_batches": len(lat), "produce_rate": n_traj / (t_produced - t0),
            "throughput_traj_s": n_traj / window if window else 0.0,
            "latency_ms": {"p50": pct(lat, 50), "p99": pct(lat, 99), "max": pct(lat, 100)},
            "fill_ms": {"p50": pct(fill, 50), "p99": pct(fill, 99)},
            "hops_ms": {name: {"p50": pct(xs, 50), "p99": pct(xs, 99)} for name, xs in hops.items() if xs},
            "latency_per_batch_ms": [x * 1000 for x in lat],
            "cpu": {name: {"cpu_s": s, "cores": s / window if window else 0.0, "ms_per_1k_traj": 1e6 * s / n_traj}
                    for name, s in used.items()},
            "broker_threads_cores": dict(sorted(((name, (s - threads0.get(name, 0.0)) / window if window else 0.0)
                                                 for name, s in threads1.items() if s - threads0.get(name, 0.0) > 0),
                                                key=lambda kv: -kv[1]))}


def jit_cores(r: dict[str, Any]) -> float:
    """Cores the broker's JIT compiler threads used over a phase's measured window."""
    return sum(v for k, v in r["broker_threads_cores"].items() if "Compiler" in k)


def report(r: dict[str, Any]) -> None:
    print(f"   {r['throughput_traj_s']:6.0f} traj/s (produced {r['produce_rate']:.0f}/s)  latency p50 "
          f"{r['latency_ms']['p50']:.0f} p99 {r['latency_ms']['p99']:.0f} ms (fill p50 {r['fill_ms']['p50']:.0f})  "
          "hops p50/p99 " + " ".join(f"{h} {v['p50']:.0f}/{v['p99']:.0f}" for h, v in r["hops_ms"].items())
          + "  cores " + " ".join(f"{p} {c['cores']:.2f}" for p, c in r["cpu"].items()) + f" (JIT {jit_cores(r):.2f})"
          + f"  load {r['loadavg_1m'][0]:.1f}-{r['loadavg_1m'][1]:.1f}  verified {r['verified']}",
          file=sys.stderr, flush=True)


def warm_broker(bootstrap: str, pid: int, args: argparse.Namespace, jit: str, logs: Path) -> list[dict[str, Any]]:
    """Unmeasured phases (the first paced rate, plans after scoring) on a fresh broker until its JIT compilers use
    under ``--jit-settled`` cores over a phase, at most ``--broker-warmup`` phases: the broker a run lives with for
    hours, not its first minutes (decision 0038). Returned as they ran, kept in the result apart."""
    rate = next((float(r) for r in args.rates.split(",") if float(r) > 0), 2000.0)
    done: list[dict[str, Any]] = []
    for i in range(args.broker_warmup):
        print(f"== broker JIT {jit}: warm-up phase {i} at {rate:g}/s (until JIT < {args.jit_settled} cores)",
              file=sys.stderr)
        r = {"broker_jit": jit, "warmup_phase": i, **phase(bootstrap, pid, args, rate, "scored", logs, None)}
        r.pop("latency_per_batch_ms")
        done.append(r)
        report(r)
        if jit_cores(r) < args.jit_settled:
            break
    return done


def plot(out: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jits = list(dict.fromkeys(r.get("broker_jit", "shipped") for r in out["phases"]))
    fig, axes = plt.subplots(len(jits), 1, figsize=(11, 4.5 * len(jits)), squeeze=False, sharey=True)
    for ax, jit in zip(axes[:, 0], jits, strict=True):
        for r in (r for r in out["phases"] if r.get("broker_jit", "shipped") == jit):
            cores = ", ".join(f"{p} {c['cores']:.2f}" for p, c in r["cpu"].items())
            ax.plot(r["latency_per_batch_ms"], marker=".", label=f"{r['plans']} @{r['rate_target']:g}/s "
                    f"#{r.get('repeat', 0)} ({r['roles_from']}): {r['throughput_traj_s']:.0f} traj/s; cores {cores}")
        ax.axhline(200, color="grey", ls="--", lw=1)
        ax.set(title=f"{title}; broker JIT: {jit}", xlabel="measured batch",
               ylabel="ms, last trajectory acked -> batch committed", yscale="log")
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rates", default="2100,0", help="trajectories/s to produce at, comma-separated; 0 = unpaced")
    ap.add_argument("--plans", default="scored,ahead", help="scored (the orchestrator's order) and/or ahead")
    ap.add_argument("--steps", type=int, default=40, help="measured steps per phase")
    ap.add_argument("--warmup", type=int, default=160, help="unmeasured steps first, at the phase's rate (JIT, caches, "
                    "connections)")
    ap.add_argument("--tbs", type=int, default=256)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--partitions", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bootstrap-servers", default=None, help="an existing cluster instead of a fresh local broker")
    ap.add_argument("--baseline", default=None, help="another checkout (e.g. before a change): every phase runs "
                    "first with the roles importing dora_rl from there, then with this tree's, back to back")
    ap.add_argument("--profile", default=None, help="a directory: run the roles under cProfile, .prof files there")
    ap.add_argument("--role-log-level", default="INFO", help="DEBUG: the roles log every commit's duration")
    ap.add_argument("--broker-warmup", type=int, default=10, help="at most this many unmeasured phases on each "
                    "fresh broker first, until its JIT has settled (0: measure a cold broker)")
    ap.add_argument("--jit-settled", type=float, default=0.05, help="settled: the broker's JIT compiler threads "
                    "used under this many cores over a warm-up phase")
    ap.add_argument("--repeats", type=int, default=3, help="each phase this many times (the tail moves between runs)")
    ap.add_argument("--broker-jit", default="shipped", help=f"comma-separated, of {sorted(JIT)}: each gets "
                    "a fresh local broker with the shipped JVM options plus these, the phases run on each in turn")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from provenance import provenance

    from dora_rl.infra.broker.dist import dora_home
    from dora_rl.infra.broker.server import BROKER_JVM_OPTS, LocalBroker
    from dora_rl.launcher import prepare_topics

    root = Path(tempfile.mkdtemp(prefix="bench-pipeline-"))
    (logs := root / "logs").mkdir()
    (root / "home").mkdir()  # the runs' directories go there, the Kafka jars are shared
    (root / "home" / "kafka").symlink_to(dora_home() / "kafka", target_is_directory=True)
    os.environ["DORA_HOME"] = str(root / "home")
    if args.profile:
        Path(args.profile).mkdir(parents=True, exist_ok=True)
    out: dict[str, Any] = {**provenance(), "args": vars(args), "engine": "none (records pre-encoded by the bench)",
                           "workload": f"TBS {args.tbs}, G {args.group}, responses U[64,512] tokens, 64 prompt tokens, "
                                       f"{args.partitions} partitions, replication 1, acks=all", "cpus": os.cpu_count(),
                           "broker_warmup": [], "phases": []}
    for jit in args.broker_jit.split(",") if not args.bootstrap_servers else ["(an existing cluster)"]:
        broker = None if args.bootstrap_servers else LocalBroker(root / f"broker-{jit}", port=0,
                                                                 jvm_opts=(*BROKER_JVM_OPTS, *JIT[jit])).start()
        bootstrap = args.bootstrap_servers or (broker.bootstrap_servers if broker else "")
        try:
            prepare_topics(bootstrap, args.partitions)
            if broker is not None and broker.pid is not None:
                out["broker_warmup"] += warm_broker(bootstrap, broker.pid, args, jit, logs)
            codes = [args.baseline, None] if args.baseline else [None]
            for plans in args.plans.split(","):
                for rate, code, rep in ((float(r), c, i) for r in args.rates.split(",") for c in codes
                                        for i in range(args.repeats)):
                    print(f"== broker JIT {jit}, plans {plans}, rate {rate:g}/s, roles from {code or 'this tree'}, "
                          f"repeat {rep}", file=sys.stderr)
                    r = {"broker_jit": jit, "broker_jvm_opts": list(JIT.get(jit, ())), "repeat": rep,
                         **phase(bootstrap, broker.pid if broker else None, args, rate, plans, logs, code)}
                    out["phases"].append(r)
                    report(r)
        finally:
            if broker is not None:
                broker.stop()
                shutil.rmtree(root / f"broker-{jit}", ignore_errors=True)
    shutil.rmtree(root / "home", ignore_errors=True)
    path = Path(args.out) if args.out else RESULTS / f"pipeline-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    plot(out, path.with_suffix(".png"), f"pipeline: TBS {args.tbs}, G {args.group}, embedded broker "
                                        f"(replication 1, acks=all), {os.cpu_count()} CPUs")
    print(f"wrote {path} (role logs in {logs})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
