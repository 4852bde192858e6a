"""bench/chaos: kill the roles of a real run on a seeded schedule and prove from the log that nothing broke.

Two runs of the same workload (dora mode, emulated engine, several instances, S = 2) on a fresh local
broker, in one invocation: one untouched, one in which every role is SIGKILLed at least twice on a
seeded random schedule (spread over the run by training step) while named crash points fire once
each (``infra/crashpoints.py``: trainer between update and announce and between announce and commit,
orchestrator, assembler and scorer between producing their outputs — for the assembler a batch — and
committing them, a rollout instance with a generation in flight, and one resuming a moved trajectory with its
KV rows fetched and not yet imported: the workload re-partitions by ``migrate``, so trajectories move between
instances with their rows, decision 0065), and every role goes through one SIGSTOP/SIGCONT *zombie episode*
(below). The KV moves of each run are counted from its metrics (``kv_moves``, ``kv_fallback`` by reason).
Each run is audited (strict: nothing missing, nothing duplicated, staleness <= S, exact TBS, one checksum
per version, every batch trained once): the chaos run's audit is the proof that no zombie published anything twice.

Recovery time of a kill = the kill's wall time -> the role's first new output record in the log:
the orchestrator's next committed snapshot on ``dora.state``, the trainer's next announcement on
``dora.policy.versions``, the assembler's next metric, the scorer's next scored trajectory, a rollout
instance's next heartbeat on ``dora.instances``. Crash points are not in that table (their time is
not the bench's); they show up as restarts.

Zombie episodes (one per role, seeded step thresholds interleaved with the kills, one at a time, never
next to a kill of the same role; ``--no-zombies`` skips them):

- a transactional role (trainer, orchestrator, assembler, scorer-0): its current process (from
  ``pids.json``) is SIGSTOPped once it has produced output; the bench starts a replacement incarnation
  itself (``dora-rl <role> --run-id ...``, the launcher's command line and environment, crash points
  disarmed, log ``<chaos home>/replacement-<role>.log``), waits for the replacement's first output (at
  most 30 s), then SIGCONTs the zombie. Expected: the zombie's next commit is fenced and it exits
  non-zero; the supervisor restarts the role, and that newer incarnation fences the replacement, which
  exits too (the bench stops it after 60 s otherwise, and says so);
- a rollout instance (not transactional: its outputs are idempotent by trajectory id, duplicates are
  the audit's waste): SIGSTOPped for 12 s (longer than a 10 s consumer session), then SIGCONTed, with
  no replacement; expected: it lives on and the run continues.

Each episode records: role, zombie pid, replacement pid, wall times (stop, replacement's first output,
cont), steps done at stop and at cont, whether the zombie exited within 20 s of the SIGCONT (watched in
``/proc``: it is the launcher's child, not the bench's) and its exit code (from ``/proc/<pid>/stat``
while unreaped, else the supervisor's "died (exit code N)" line in the launcher log; negative = signal),
the pid the supervisor restarted the role with, the replacement's exit code and time, and the
instance's next output after the SIGCONT. With 5 deaths allowed per role in 300 s by the supervisor,
the trainer (2 crash points + 1 fenced zombie) stands at most 2 kills.

Separately (role kills and a broker kill together would overload 2 cores), ``--broker-kill`` runs the
workload on the project's 3-node loopback cluster (replication 3, ``min.insync.replicas`` 2, idempotent
``acks=all`` producers) and SIGKILLs the broker leading ``dora.train.batches`` a third of the way in.

Usage: ``python bench/chaos.py [--steps 100] [--kills-per-role 2] [--seed 0] [--no-zombies] [--broker-kill]``;
writes ``bench/results/chaos-<timestamp>.json`` (zombie episodes under ``zombies``, one line per role
under ``zombie_summary``) and ``.png`` (recovery per kill, throughput, and the step timeline with kills
and zombie episodes marked); ``chaos-broker-kill-<timestamp>.json``. Zombie episodes take 5-25 s
each (about 100 s for the seven) while the run goes on, hence the 100 steps: events the run ends
before are listed under ``chaos.not_reached`` (give more ``--steps``). Figures are from the
**emulated** engine.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from chaos_zombies import proc_stat, role_pid, zombie_episode, zombie_line  # bench/ is on sys.path

RESULTS = Path(__file__).resolve().parent / "results"
KILL_WAIT_S = 60.0  # a scheduled kill waits this long for its role to be running again (e.g. after a crash point)
CRASH_POINTS = ("trainer.after_update", "trainer.before_commit", "orchestrator.before_commit",
                "assembler.before_commit", "scorer.before_commit", "rollout.in_flight", "rollout.kv_transfer")

WORKLOAD: dict[str, Any] = {
    "mode": "dora", "max_staleness": 2, "train_batch_size": 32, "group_size": 4, "rollout_batch_size": 96,
    "num_instances": 3, "instance_concurrency": 32, "max_new_tokens": 96, "engine": "emulated", "sft_steps": 0,
    "weight_transport": "tcp", "seed": 11, "ppo_epochs": 1, "minibatches": 1,
    "repartition_policy": "migrate",  # trajectories move between instances, with their KV rows (decision 0065)
    "emulated": {"vocab": 59, "eos_id": 2, "base_step_s": 0.02, "cap_fraction": 0.1},
}


class RunWatch:
    """Follows one run's topics with plain consumers (no group): steps done and per-role outputs."""

    def __init__(self, bootstrap: str, run_id: str) -> None:
        from confluent_kafka import Consumer, TopicPartition

        from dora_rl.infra.kafka import topics
        from dora_rl.infra.kafka.io import reader_config
        from dora_rl.infra.kafka.runs import get_run, offsets_map

        start = offsets_map(get_run(bootstrap, run_id))
        self.run_id = run_id
        self.consumer = Consumer(reader_config(bootstrap, f"chaos-{time.time()}"))
        names = [topics.in_run(run_id, t) for t in (topics.METRICS, topics.VERSIONS, topics.STATE, topics.INSTANCES,
                                                       topics.SCORED)]
        md = self.consumer.list_topics(timeout=30)
        self.consumer.assign([TopicPartition(t, p, start.get((t, p), 0)) for t in names
                              for p in md.topics[t].partitions])
        self.steps: set[int] = set()
        self.step_times: dict[int, float] = {}  # step -> wall time (s) of its reward metric
        self.outputs: dict[str, list[float]] = {}  # role name -> wall times (s) of its output records

    def _out(self, role: str, ts_ms: int) -> None:
        self.outputs.setdefault(role, []).append(ts_ms / 1000)

    def poll(self, timeout: float = 0.5) -> None:
        from dora_rl.infra.kafka.topics import catalogue_name, spec
        from dora_rl.schemas.codec import DecodeError
        from dora_rl.schemas.records import (
            RECORDS,
            InstanceStatus,
            Metric,
            PolicyVersion,
            ProcessorSnapshot,
            Trajectory,
        )

        for msg in self.consumer.consume(1000, timeout):
            if msg.error() is not None:
                continue
            topic = catalogue_name(self.run_id, msg.topic() or "")  # the run's own topic (decision 0063)
            try:
                rec = RECORDS[spec(topic).schema].decode(msg.value(), msg.headers())
            except (KeyError, DecodeError):
                continue
            if getattr(rec, "run_id", None) != self.run_id:
                continue
            if isinstance(rec, Metric):
                if rec.component == "trainer" and rec.name == "reward_mean" and rec.step is not None:
                    self.steps.add(int(rec.step))
                    self.step_times.setdefault(int(rec.step), rec.ts_ms / 1000)
                if rec.component == "assembler":
                    self._out("assembler", rec.ts_ms)
            elif isinstance(rec, PolicyVersion) and rec.checkpoint_uri is not None:  # the trainer's (restore too)
                self._out("trainer", rec.created_ms)
            elif isinstance(rec, ProcessorSnapshot):
                self._out(rec.processor, rec.ts_ms)
            elif isinstance(rec, InstanceStatus):
                self._out(rec.instance_id, rec.ts_ms)
            elif isinstance(rec, Trajectory) and rec.scored_ms:
                self._out("scorer-0", rec.scored_ms)

    def close(self) -> None:
        self.consumer.close()


def launch(bootstrap: str, config: dict[str, Any], home: Path,
           crash_points: tuple[str, ...]) -> subprocess.Popen[bytes]:
    cfg = home / "config.json"
    cfg.write_text(json.dumps(config))
    env = dict(os.environ, DORA_HOME=str(home), DORA_CRASH_POINTS=",".join(crash_points),
               DORA_CRASH_DIR=str(home))
    return subprocess.Popen([sys.executable, "-m", "dora_rl", "run", "--bootstrap-servers", bootstrap, "--config",
                             str(cfg), "--json", str(home / "summary.json"), "--quiet"],
                            stdout=(home / "launcher.log").open("w"), stderr=subprocess.STDOUT, env=env)


def fresh_home(root: Path, name: str) -> Path:
    from dora_rl.infra.broker.dist import dora_home

    home = root / name
    home.mkdir(parents=True)
    (home / "kafka").symlink_to(dora_home() / "kafka", target_is_directory=True)  # the jar cache
    return home


def wait_run_dir(home: Path, timeout: float = 180) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        runs = home / "runs"
        found = [d for d in runs.iterdir() if (d / "pids.json").exists()] if runs.exists() else []
        if found:
            return found[0]
        time.sleep(0.5)
    raise TimeoutError(f"no run started under {home}")


def schedule(roles: list[str], steps: int, kills_per_role: int, seed: int, zombies: bool) -> list[dict[str, Any]]:
    """The seeded events of a chaos run, in order: ``{"kind": "kill" | "zombie", "role", "at_step"}``.

    Kills: every role ``kills_per_role`` times, one per step threshold in ``1 .. steps - 3`` (the same
    draws as without zombies). Zombie episodes: every role once, thresholds in the first two thirds of
    the run (an episode lasts while the run goes on); at a shared threshold the kills go first. The
    zombie episodes' roles are permuted so that none is next to a kill of the same role (as far as a
    permutation can)."""
    rng = random.Random(seed)
    victims = [r for r in roles for _ in range(kills_per_role)]
    rng.shuffle(victims)
    at_steps = sorted(rng.sample(range(1, steps - 2), len(victims)))  # one kill per step threshold
    events = [{"kind": "kill", "role": v, "at_step": at} for v, at in zip(victims, at_steps, strict=True)]
    if not zombies:
        return events
    order = list(roles)
    rng.shuffle(order)
    pool = range(1, max(2, 2 * steps // 3))
    z_at = sorted(rng.sample(pool, len(order)) if len(pool) >= len(order) else rng.choices(pool, k=len(order)))
    events += [{"kind": "zombie", "role": r, "at_step": at} for r, at in zip(order, z_at, strict=True)]
    events.sort(key=lambda e: (e["at_step"], e["kind"] == "zombie"))

    def clashes() -> int:
        return sum(a["role"] == b["role"] and a["kind"] != b["kind"] for a, b in itertools.pairwise(events))

    def swap(i: int, j: int) -> None:
        events[i]["role"], events[j]["role"] = events[j]["role"], events[i]["role"]

    zs = [i for i, e in enumerate(events) if e["kind"] == "zombie"]
    while (now := clashes()) > 0:  # swap which role each zombie episode stops; the kills stay as drawn
        tries = []
        for i in zs:
            for j in zs:
                if i < j:
                    swap(i, j)
                    tries.append((clashes(), i, j))
                    swap(i, j)
        best = min(tries, default=None)
        if best is None or best[0] >= now:
            break
        swap(best[1], best[2])
    return events


def chaos_run(bootstrap: str, home: Path, steps: int, kills_per_role: int, seed: int,
              zombies: bool = True) -> dict[str, Any]:
    """The killed run: returns its kills with recovery times, zombie episodes, summary and audit."""
    config = {**WORKLOAD, "steps": steps}
    proc = launch(bootstrap, config, home, CRASH_POINTS)
    rdir = wait_run_dir(home)
    watch = RunWatch(bootstrap, rdir.name)
    roles = ["orchestrator", "trainer", "assembler", "scorer-0",
             *[f"rollout-{i}" for i in range(config["num_instances"])]]
    events = schedule(roles, steps, kills_per_role, seed, zombies)
    kills: list[dict[str, Any]] = []
    killed_pids: set[int] = set()
    episodes: list[dict[str, Any]] = []
    not_reached: list[dict[str, Any]] = []
    missed: list[dict[str, Any]] = []
    t_launch = time.time()
    try:
        for n, ev in enumerate(events):
            victim, at = ev["role"], ev["at_step"]
            while len(watch.steps) < at and proc.poll() is None:
                watch.poll()
            if proc.poll() is not None:
                not_reached = events[n:]
                print(f"the run ended (exit code {proc.returncode}) before {len(not_reached)} event(s), "
                      f"the first at step {at}: see {home / 'launcher.log'}", file=sys.stderr)
                break
            if ev["kind"] == "zombie":
                print(f"zombie episode: {victim} at step {len(watch.steps)}", file=sys.stderr)
                ep = zombie_episode(victim, bootstrap, rdir, home, watch, proc)
                ep["scheduled_step"] = at
                episodes.append(ep)
                print(f"  {victim}: {zombie_line(ep)}", file=sys.stderr)
                continue
            deadline = time.monotonic() + KILL_WAIT_S
            while True:  # a role between death and restart (a crash point, the previous kill) is killed once back
                pid = role_pid(rdir, victim)
                t_kill = time.time()
                try:
                    if pid in killed_pids or _exited(pid):  # an unreaped child still takes a signal
                        raise ProcessLookupError(pid)
                    os.kill(pid, signal.SIGKILL)
                    killed_pids.add(pid)
                    kills.append({"role": victim, "pid": pid, "at_step": len(watch.steps), "t_kill": t_kill})
                    break
                except ProcessLookupError:
                    if time.monotonic() > deadline or proc.poll() is not None:
                        missed.append({**ev, "reason": f"no live {victim} process within {KILL_WAIT_S:.0f}s"})
                        print(f"kill of {victim} at step {at} missed: not restarted in time", file=sys.stderr)
                        break
                    watch.poll(0.2)
        while proc.poll() is None:
            watch.poll()
        for _ in range(6):
            watch.poll(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
        watch.close()
    for k in kills:
        later = [t for t in watch.outputs.get(k["role"], []) if t > k["t_kill"]]
        k["recovery_s"] = round(min(later) - k["t_kill"], 3) if later else None
    summary = json.loads((home / "summary.json").read_text()) if (home / "summary.json").exists() else {}
    return {"exit_code": proc.returncode, "run_id": rdir.name, "kills": kills, "zombies": episodes,
            "kv": kv_counts(bootstrap, rdir.name),
            "not_reached": not_reached, "missed_kills": missed, "summary": summary,
            "crash_points_fired": sorted(p.name.removeprefix("crashed.") for p in home.glob("crashed.*")),
            "timeline": {"t_launch": round(t_launch, 3),
                         "step_times": [[s, round(t, 3)] for s, t in sorted(watch.step_times.items())]}}


def _exited(pid: int) -> bool:
    """Whether ``pid`` is dead or a zombie (exited, not yet reaped by the launcher's supervisor)."""
    stat = proc_stat(pid)
    return stat is None or stat[0] in "ZX"


def clean_run(bootstrap: str, home: Path, steps: int) -> dict[str, Any]:
    proc = launch(bootstrap, {**WORKLOAD, "steps": steps}, home, ())
    proc.wait()
    rdir = wait_run_dir(home, 5)
    summary = json.loads((home / "summary.json").read_text()) if (home / "summary.json").exists() else {}
    return {"exit_code": proc.returncode, "run_id": rdir.name, "summary": summary,
            "kv": kv_counts(bootstrap, rdir.name)}


def kv_counts(bootstrap: str, run_id: str) -> dict[str, int]:
    """Trajectories resumed (orchestrator), KV rows imported, and prefills instead by reason, from the run's metrics."""
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.runs import get_run, read_run
    from dora_rl.schemas.codec import DecodeError
    from dora_rl.schemas.records import Metric

    out: dict[str, int] = {}
    for msg in read_run(bootstrap, get_run(bootstrap, run_id), topics.METRICS):
        try:
            m = Metric.decode(msg.value(), msg.headers())
        except DecodeError:
            continue
        if m.name in ("resumed", "kv_moves", "kv_fallback"):
            key = m.name if m.name != "kv_fallback" else f"kv_fallback:{m.labels.get('reason', '')}"
            out[key] = out.get(key, 0) + int(m.value)
    return out


def broker_kill_run(steps: int, root: Path) -> dict[str, Any]:
    """One run on a 3-node loopback cluster (RF 3, min.insync 2, acks=all) with one broker SIGKILLed
    a third of the way in: the leader of ``dora.train.batches``; returns the run and its audit."""
    from confluent_kafka.admin import AdminClient

    from dora_rl.consumers.audit import audit_run
    from dora_rl.infra.broker.cluster import LocalCluster
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.security import client_config
    from dora_rl.launcher import prepare_topics

    cluster = LocalCluster(root / "cluster").start()
    try:
        bootstrap = cluster.bootstrap_servers
        prepare_topics(bootstrap, 4)
        home = fresh_home(root, "broker-kill")
        proc = launch(bootstrap, {**WORKLOAD, "steps": steps}, home, ())
        rdir = wait_run_dir(home)
        watch = RunWatch(bootstrap, rdir.name)
        while len(watch.steps) < steps // 3:
            watch.poll()
        batches = topics.in_run(rdir.name, topics.BATCHES)
        md = AdminClient(client_config(bootstrap)).list_topics(batches, timeout=10)
        victim = cluster.node_index(md.topics[batches].partitions[0].leader)
        t_kill, at = time.time(), len(watch.steps)
        cluster.kill_node(victim)
        print(f"killed broker node {victim} after {at} steps", file=sys.stderr)
        watch.close()
        proc.wait()
        summary = json.loads((home / "summary.json").read_text()) if (home / "summary.json").exists() else {}
        report = audit_run(bootstrap, rdir.name)
        return {"exit_code": proc.returncode, "run_id": rdir.name, "killed_node": victim, "at_step": at,
                "t_kill": t_kill, "summary": summary, "audit": report.verdict, "audit_report": report.to_dict()}
    finally:
        cluster.stop()


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    per_role = result["recovery_s_by_role"]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(17, 4.2), gridspec_kw={"width_ratios": [1, 0.7, 1.4]})
    names = sorted(per_role)
    for i, n in enumerate(names):
        a.scatter([i] * len(per_role[n]), per_role[n], color="tab:red")
        a.hlines(statistics.median(per_role[n]), i - 0.3, i + 0.3, color="black")
    a.axhline(15, ls="--", color="grey", label="15 s goal")
    a.set_xticks(range(len(names)), names, rotation=30)
    a.set_ylabel("kill -> first new output (s)")
    a.set_title("recovery per kill (bar: median)")
    a.legend()
    chaos = result["chaos"]
    episodes = [e for e in result.get("zombies", []) if "skipped" not in e]
    thr = [result["clean"]["summary"].get("throughput_tokens_per_s", 0),
           chaos["summary"].get("throughput_tokens_per_s", 0)]
    b.bar(["no kills", f"{len(chaos['kills'])} kills + {len(chaos['crash_points_fired'])} crash points\n"
                       f"+ {len(episodes)} zombies"], thr, color=["tab:blue", "tab:red"])
    b.set_ylabel("trained tokens / s (emulated engine)")
    b.set_title(f"audit: {result['audit']['clean']} / {result['audit']['chaos']}")
    t0 = chaos["timeline"]["t_launch"]
    pts = chaos["timeline"]["step_times"]
    c.step([t - t0 for _, t in pts], [s + 1 for s, _ in pts], where="post", color="black")
    for k in chaos["kills"]:
        c.axvline(k["t_kill"] - t0, color="tab:red", lw=0.8, alpha=0.6)
    for i, e in enumerate(episodes):
        color = "tab:purple" if e["kind"] == "fenced" else "tab:orange"
        c.axvspan(e["t_stop"] - t0, e["t_cont"] - t0, color=color, alpha=0.25)
        code = e["zombie_exit_code"] if e["zombie_exited"] else "alive"
        c.text(e["t_stop"] - t0, (0.95 - 0.07 * (i % 6)) * max(1, len(pts)), f"{e['role']} ({code})", fontsize=7)
    firsts = [t - t0 for _, t in pts[:1]] + [k["t_kill"] - t0 for k in chaos["kills"]] + \
        [e["t_stop"] - t0 for e in episodes]
    c.set_xlim(left=max(0.0, min(firsts, default=0.0) - 3))
    c.set_xlabel("s since launch")
    c.set_ylabel("steps trained")
    c.set_title("timeline (label: the zombie's exit code)")
    c.legend([Line2D([], [], color="black"), Line2D([], [], color="tab:red", lw=0.8),
              Patch(color="tab:purple", alpha=0.25), Patch(color="tab:orange", alpha=0.25)],
             ["steps trained", "SIGKILL", "zombie stopped (fenced role)", "zombie stopped (rollout)"],
             fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from provenance import provenance

    from dora_rl.consumers.audit import audit_run
    from dora_rl.infra.broker.server import LocalBroker
    from dora_rl.launcher import prepare_topics

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=100,
                    help="training steps; the zombie episodes take ~100 s of the chaos run: with much fewer "
                         "steps, late events are not reached")
    ap.add_argument("--kills-per-role", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-zombies", action="store_true",
                    help="skip the SIGSTOP/SIGCONT zombie episodes (kills and crash points only)")
    ap.add_argument("--broker-kill", action="store_true",
                    help="instead: one run on a 3-node cluster with a broker killed mid-run (no role kills)")
    args = ap.parse_args()
    trainer_deaths = args.kills_per_role + 2 + (0 if args.no_zombies else 1)  # kills, crash points, fenced zombie
    if not args.broker_kill and trainer_deaths > 5:
        print(f"warning: the trainer would die {trainer_deaths} times; the supervisor fails a run at 6 deaths "
              "of a role within 300 s", file=sys.stderr)
    measured_on = provenance()  # before anything runs: the code the roles start from
    root = Path(tempfile.mkdtemp(prefix="bench-chaos-"))
    if args.broker_kill:
        run = broker_kill_run(args.steps, root)
        RESULTS.mkdir(exist_ok=True)
        out = RESULTS / f"chaos-broker-kill-{time.strftime('%Y%m%d-%H%M%S')}.json"
        out.write_text(json.dumps({**measured_on, "engine": "emulated", "workload": WORKLOAD, **run}, indent=2))
        print(f"audit {run['audit']}, steps {run['summary'].get('steps')}; wrote {out}")
        return
    broker = LocalBroker(root / "broker", port=0).start()
    try:
        bootstrap = broker.bootstrap_servers
        prepare_topics(bootstrap, 4)
        print("== clean run (no kills) ...", file=sys.stderr)
        clean = clean_run(bootstrap, fresh_home(root, "clean"), args.steps)
        print("== chaos run ...", file=sys.stderr)
        chaos = chaos_run(bootstrap, fresh_home(root, "chaos"), args.steps, args.kills_per_role, args.seed,
                          zombies=not args.no_zombies)
        audits = {name: audit_run(bootstrap, r["run_id"]) for name, r in (("clean", clean), ("chaos", chaos))}
    finally:
        broker.stop()
    zombies = chaos.pop("zombies")
    by_role: dict[str, list[float]] = {}
    for k in chaos["kills"]:
        if k["recovery_s"] is not None:
            by_role.setdefault(k["role"], []).append(k["recovery_s"])
    result: dict[str, Any] = {
        **measured_on, "engine": "emulated", "workload": WORKLOAD, "steps": args.steps, "seed": args.seed,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "clean": clean, "chaos": chaos,
        "kills_per_role": {r: sum(1 for k in chaos["kills"] if k["role"] == r) for r in by_role},
        "restarts": chaos["summary"].get("restarts", {}),
        "recovery_s_by_role": by_role,
        "median_recovery_s": {r: statistics.median(v) for r, v in by_role.items()},
        "throughput_ratio_chaos_over_clean": (chaos["summary"].get("throughput_tokens_per_s", 0)
                                              / max(1e-9, clean["summary"].get("throughput_tokens_per_s", 0))),
        "audit": {name: rep.verdict for name, rep in audits.items()},
        "zombies": zombies,
        "zombie_summary": {e["role"]: zombie_line(e) for e in zombies},
        "audit_reports": {name: rep.to_dict() for name, rep in audits.items()},
    }
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"chaos-{stamp}.json"
    out.write_text(json.dumps(result, indent=2, default=str))
    plot(result, RESULTS / f"chaos-{stamp}.png")
    print(json.dumps({k: result[k] for k in ("kills_per_role", "restarts", "median_recovery_s",
                                             "throughput_ratio_chaos_over_clean", "zombie_summary", "audit")},
                     indent=2))
    if chaos["not_reached"]:
        print(f"not reached (the run ended first): {chaos['not_reached']}", file=sys.stderr)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
