"""``dora-rl run``: the whole loop on one machine, each role a separate process.

Steps: (1) use the given bootstrap servers, or start the embedded broker (kept between commands);
(2) create the topics; (3) record the run on ``dora.runs``; (4) write the prompts; (5) launch the
trainer, scorer, assembler, orchestrator and rollout instances as processes (logs under
``$DORA_HOME/runs/<run_id>/logs``); (6) follow ``dora.metrics`` / ``dora.instances`` with a
progress bar until the trainer reports ``done``; (7) stop the roles, record the summary.

Summary figures: ``reward_per_step`` is the mean reward of each step's batch (0–1);
``trained_tokens`` sums the response tokens of all batches; ``throughput_tokens_per_s`` is
``trained_tokens / rl_wall_s`` where ``rl_wall_s`` runs from version 0's announcement to the last
update (the warm-up is reported apart as ``warmup_s``); ``wall_s`` is the whole command.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from confluent_kafka.admin import AdminClient
from tqdm import tqdm

from dora_rl.config import DoraConfig
from dora_rl.consumers.dashboard.plot import plot_summary
from dora_rl.consumers.tensorboard_log import TensorBoardLog
from dora_rl.infra.kafka import topics
from dora_rl.infra.kafka.consume import RunConsumer
from dora_rl.infra.kafka.io import DeadLetters, RecordProducer, now_ms
from dora_rl.infra.kafka.runs import (
    RetentionGap,
    RunExists,
    finish_run,
    get_run,
    list_runs,
    new_run_id,
    offsets_map,
    publish,
    retention_gaps,
    start_run,
)
from dora_rl.infra.kafka.security import child_env, effective
from dora_rl.infra.storage import write_atomic
from dora_rl.prompt_source import dataset_identity
from dora_rl.schemas.records import InstanceStatus, Metric, RunInfo

from .roles import SCORER_KEY_FILE, TRAINER_KEY_FILE, WEIGHT_TOKEN_FILE, prompts_needed, run_dir
from .run_progress import Progress, eval_summary
from .supervisor import Supervisor

if TYPE_CHECKING:
    from .ray_placement import RayRoles

log = logging.getLogger(__name__)


def embedded_broker() -> Any:
    """Handle on the embedded broker (``$DORA_HOME/broker``), whether or not it was ever started."""
    from dora_rl.infra.broker.server import BrokerError, LocalBroker

    try:
        return LocalBroker.attach()
    except BrokerError:
        return LocalBroker()


def ensure_broker(bootstrap: str | None) -> str:
    """``bootstrap`` if given, else the embedded broker's (started if it is not running)."""
    if bootstrap:
        from dora_rl.infra.broker.server import require_reachable

        require_reachable(bootstrap)  # one line at once, not a client's error stream then a traceback
        return bootstrap
    broker = embedded_broker()
    if not broker.is_running():
        print("starting the embedded Kafka broker (first start fetches the jars with Maven) ...", file=sys.stderr)
        broker.start()
    if broker.security is None:
        print(f"note: {SINGLE_USER_NOTE}", file=sys.stderr)
    return broker.bootstrap_servers


SINGLE_USER_NOTE = (
    "the embedded broker is single-user: PLAINTEXT on 127.0.0.1 with no principals, so anyone who can reach it "
    "can read and write the run's topics. Signed announcements and code-free checkpoints keep them from taking "
    "over the weights; nothing keeps them from disturbing the run. On a shared machine: `dora-rl broker start "
    "--secure` (SASL_SSL, a user per role, ACLs)")
"""Said by ``dora-rl run`` whenever it uses the embedded broker without security (issue 32)."""


def prepare_topics(bootstrap: str, num_partitions: int, instances: int = topics.MAX_INSTANCES,
                   run_id: str | None = None) -> dict[str, str]:
    """Create the shared topics and, with ``run_id``, that run's (its request topic with ``instances``
    partitions); idempotent."""
    from dora_rl.infra.kafka.security import client_config
    from dora_rl.infra.kafka.topic_admin import ensure_topics

    return ensure_topics(AdminClient(client_config(bootstrap)), num_partitions, instances=instances,
                                run_id=run_id)


def spawn(role: str, bootstrap: str, run_id: str, logs: Path, env: dict[str, str],
          index: int = 0) -> subprocess.Popen[bytes]:
    """Start ``dora-rl <role>`` as a child process appending to ``logs/<role>[-i].log``."""
    name = role_name(role, index)
    out: TextIO = (logs / f"{name}.log").open("a")
    cmd = [sys.executable, "-m", "dora_rl", role, "--bootstrap-servers", bootstrap, "--run-id", run_id,
           "--index", str(index)]
    return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def role_name(role: str, index: int = 0) -> str:
    return role if role not in ("rollout", "scorer") else f"{role}-{index}"


def run(config: DoraConfig, bootstrap: str | None = None, json_path: Path | None = None,
        run_id: str | None = None, quiet: bool = False, stall_timeout_s: float = 600.0,
        ray_address: str | None = None) -> dict[str, Any]:
    """Record a new run and run it to the end; returns (and optionally writes) the summary. With
    ``ray_address`` the roles are placed on that Ray cluster (:mod:`dora_rl.ray_placement`)."""
    t_start = time.monotonic()
    if ray_address is not None and bootstrap is None:
        raise ValueError("--ray needs --bootstrap-servers: a broker every Ray node reaches (not an embedded one)")
    bootstrap = ensure_broker(bootstrap)
    info, _ = create(config, bootstrap, run_id)
    return supervise(bootstrap, info, config, t_start, json_path, quiet, stall_timeout_s, ray_address)


def create(config: DoraConfig, bootstrap: str, run_id: str | None = None) -> tuple[RunInfo, Path]:
    """Record a run without starting any role (``dora-rl create``): the topics, the run on ``dora.runs``
    (config and start offsets: what every role on any host joins from), and the weight-channel token
    in ``<run dir>/weight-token`` and the trainer's and scorer's keys beside it (mode 0600; never on a topic).
    Returns the run and the token file."""
    prepare_topics(bootstrap, config.num_partitions, config.instance_limit)  # dora.runs; the run's: start_run
    config = with_vocab_size(config)
    if run_id is not None and run_id in list_runs(bootstrap):  # before its directory's secrets are touched
        raise RunExists(f"run {run_id!r} exists on this cluster: choose another id, or continue it with "
                        f"`dora-rl resume {run_id}`")
    rdir = run_dir(topics.check_run_id(run_id or new_run_id()))
    token_file = weight_token_file(rdir)  # first: the run record is signed with it
    trainer_key_file(rdir), scorer_key_file(rdir)
    info = start_run(bootstrap, config, rdir.name, token_file.read_text().strip())
    (rdir / "config.json").write_text(config.to_json())
    return info, token_file


def with_vocab_size(config: DoraConfig) -> DoraConfig:
    """``config`` with ``vocab_size`` read from its model when unset and the model is on this host (else a
    warning: the trainer alone then checks token ids, and refuses a whole batch for one bad trajectory)."""
    from dora_rl.policy_source import model_vocab_size

    if config.vocab_size:
        return config
    vocab = model_vocab_size(config.model, config.seed)
    if vocab is None:
        log.warning("model %s is not on this host: vocab_size unknown, so the assembler cannot refuse a token id "
                    "outside the vocabulary (set vocab_size in the config)", config.model)
        return config
    return dataclasses.replace(config, vocab_size=vocab)


def weight_token_file(rdir: Path) -> Path:
    """``<rdir>/weight-token``, created once (from ``DORA_WEIGHT_TOKEN`` or random), mode 0600: the same
    token across a resume, so restarted holders keep serving their peers."""
    return _secret_file(rdir / WEIGHT_TOKEN_FILE, os.environ.get("DORA_WEIGHT_TOKEN"))


def trainer_key_file(rdir: Path) -> Path:
    """``<rdir>/trainer-key``, created once (random), mode 0600: handed to the trainer alone, which signs its
    ``done`` with it; the launcher ends a run only on a ``done`` signed with it."""
    return _secret_file(rdir / TRAINER_KEY_FILE, None)


def scorer_key_file(rdir: Path) -> Path:
    """``<rdir>/scorer-key``, created once (random), mode 0600: handed to the scorer, which signs its scores
    with it, and to the assembler, which trains only scores signed with it."""
    return _secret_file(rdir / SCORER_KEY_FILE, None)


def role_env(role: str, env: dict[str, str], rdir: Path) -> dict[str, str]:
    """``env`` for ``role``: the trainer alone also gets its key's file (``DORA_TRAINER_KEY_FILE``), the scorer
    and the assembler alone the scorer's (``DORA_SCORER_KEY_FILE``)."""
    if role == "trainer":
        return {**env, "DORA_TRAINER_KEY_FILE": str(trainer_key_file(rdir))}
    if role in ("scorer", "assembler"):
        return {**env, "DORA_SCORER_KEY_FILE": str(scorer_key_file(rdir))}
    return env


def _secret_file(path: Path, value: str | None) -> Path:
    if not path.exists():
        path.touch(mode=0o600)
        path.write_text(value or secrets.token_hex(16))
    return path


def resume(run_id: str, bootstrap: str | None = None, steps: int | None = None, json_path: Path | None = None,
           quiet: bool = False, stall_timeout_s: float = 600.0, ray_address: str | None = None) -> dict[str, Any]:
    """Continue run ``run_id`` (its launcher died, or the machine rebooted) to ``steps`` steps.

    Orphan roles of the dead launcher (their process ids are in the run directory) are killed first;
    the transactional roles would fence them anyway, this also stops orphan rollout instances from
    doubling work. Every role restores its state from the run's topics."""
    t_start = time.monotonic()
    bootstrap = ensure_broker(bootstrap)
    info = get_run(bootstrap, run_id, _token_of(run_id))
    placed = run_dir(info.run_id) / "placement.json"
    if ray_address is None and placed.exists():  # its roles may still run as Ray actors: no second set here
        raise ValueError(f"run {run_id} was placed by Ray: resume it with --ray ADDRESS (its actors are adopted), "
                         f"or, once its Ray cluster is gone, delete {placed} and resume it here")
    kill_orphans(run_dir(info.run_id))  # first: they would go on changing the offsets checked below
    gaps = retention_gaps(bootstrap, info)
    if gaps:
        raise RetentionGap(f"run {run_id} cannot be resumed: retention deleted records it still needs "
                           f"(nothing was started): " + "; ".join(gaps[:5]) + (" ..." if len(gaps) > 5 else ""))
    config = DoraConfig.from_json(info.config_json)
    if steps is not None and steps != config.steps:
        config = dataclasses.replace(config, steps=steps).validate()
        info = publish(bootstrap, info.replace(config_json=config.to_json(), state="STARTED"), _token_of(run_id))
    return supervise(bootstrap, info, config, t_start, json_path, quiet, stall_timeout_s, ray_address)


def _token_of(run_id: str) -> str:
    """The run's token, from its directory on this host (empty where there is none: a run created elsewhere)."""
    path = run_dir(run_id) / WEIGHT_TOKEN_FILE
    return path.read_text().strip() if path.exists() else ""


def kill_orphans(rdir: Path) -> list[int]:
    """SIGKILL the role processes a dead launcher left running (recorded in ``pids.json``)."""
    path = rdir / "pids.json"
    killed: list[int] = []
    if not path.exists():
        return killed
    for pid in json.loads(path.read_text()).values():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if rdir.name.encode() in cmdline:  # still ours (pids are reused)
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
    if killed:
        print(f"killed {len(killed)} orphan role(s) of the previous launcher: {killed}", file=sys.stderr)
    return killed


EXTERNAL_WAIT_NOTE_S = 30.0
"""Seconds without a step after which a run scored by an outside service says what it waits for."""


def waiting_note(config: DoraConfig, idle_s: float, started: bool) -> str | None:
    """What a run that trains nothing for ``idle_s`` seconds after version 0 (``started``) is waiting for,
    when the launcher can tell: an external reward service that may not be running."""
    if config.reward_service != "external" or not started or idle_s < EXTERNAL_WAIT_NOTE_S:
        return None
    return (f"waiting for scores: no step for {idle_s:.0f} s, and this run's trajectories are scored by an outside "
            "service (--reward external). Is one running and scoring the run's trajectories? (docs/integration.md)")


def run_notes(config: DoraConfig) -> list[str]:
    """What a user should know before reading a run's figures (printed under its first line)."""
    notes = []
    if config.engine == "emulated":
        notes.append("engine=emulated: responses are token ids with no text, so every reward is 0 and nothing is "
                     "learned; its timing and scheduling are the product's (engine=torch or vllm to learn)")
    return notes


def role_group(bootstrap: str, info: RunInfo, config: DoraConfig, env: dict[str, str], rdir: Path,
               ray_address: str | None) -> Supervisor | RayRoles:
    """The roles' supervisor: local child processes, or Ray actors on the cluster at ``ray_address`` (which get
    only the ``DORA_*`` variables, each naming a file or a setting, never a secret)."""
    logs = rdir / "logs"
    if ray_address is None:
        return Supervisor(lambda role, index: spawn(role, bootstrap, info.run_id, logs, role_env(role, env, rdir),
                                                    index))
    from .ray_placement import RayRoles

    def env_of(role: str) -> dict[str, str]:
        full = role_env(role, env, rdir)
        return {k: v for k, v in full.items() if k.startswith("DORA_")} | {"PYTHONUNBUFFERED": "1"}

    return RayRoles(ray_address, info.run_id, bootstrap, config, env_of)


def supervise(bootstrap: str, info: RunInfo, config: DoraConfig, t_start: float, json_path: Path | None,
              quiet: bool, stall_timeout_s: float, ray_address: str | None = None) -> dict[str, Any]:
    """Launch every role of ``info`` (supervised processes, or Ray actors) and follow the run to its end."""
    rdir = run_dir(info.run_id)
    logs = rdir / "logs"
    logs.mkdir(exist_ok=True)
    env = {**os.environ, **child_env(effective(), rdir)}  # the Kafka password by a 0600 file, never inline
    env.pop("DORA_WEIGHT_TOKEN", None)
    env["DORA_WEIGHT_TOKEN_FILE"] = str(weight_token_file(rdir))  # a file, never a secret in the environment
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    print(f"run {info.run_id}: mode={config.mode} steps={config.steps} bootstrap={bootstrap} logs={logs}",
          file=sys.stderr)
    for note in run_notes(config):
        print(f"note: {note}", file=sys.stderr)
    sup = role_group(bootstrap, info, config, env, rdir, ray_address)
    for role in ("dataset", "trainer", "scorer", "assembler", "orchestrator"):
        if role == "scorer" and config.reward_service == "external":  # an outside service scores (0022)
            continue
        sup.start(role_name(role), role)
    for i in range(config.num_instances):
        sup.start(role_name("rollout", i), "rollout", i)

    def record_pids() -> None:  # written whole or not at all: `resume`, `dora-rl scale` and tests read it live
        write_atomic(rdir / sup.placement_file, json.dumps(sup.placement()).encode())

    record_pids()

    def on_term(signum: int, frame: object) -> None:  # a killed launcher must not orphan its roles
        raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_term) for sig in (signal.SIGTERM, signal.SIGHUP)}  # SIGHUP: ssh drop
    producer = RecordProducer(bootstrap, f"run-{info.run_id}")
    watcher = RunConsumer(bootstrap, info.run_id, "launcher",
                          {topics.METRICS: Metric, topics.INSTANCES: InstanceStatus},
                          DeadLetters(producer, "launcher", info.run_id), offsets_map(info),
                          group_suffix=f".{now_ms()}")
    progress = Progress(steps=config.steps, token=trainer_key_file(rdir).read_text().strip())
    failed: str | None = None
    trainer_exit: float | None = None
    tb = TensorBoardLog(rdir / "tensorboard")
    bar = tqdm(total=config.steps, desc=f"{config.mode} RL steps", unit="step", disable=quiet, file=sys.stderr)
    last_progress, waited_note = time.monotonic(), False
    try:
        while not progress.done:
            seen_steps = len(progress.rewards)
            for env_rec in watcher.poll(0.5):
                progress.observe(env_rec.record)
                if isinstance(env_rec.record, Metric):
                    tb.observe(env_rec.record)
            if len(progress.rewards) > seen_steps or progress.version0_ms is None:
                last_progress, waited_note = time.monotonic(), False
            elif not waited_note and (waiting := waiting_note(config, time.monotonic() - last_progress, True)):
                bar.write(f"note: {waiting}", file=sys.stderr)
                waited_note = True
            elif time.monotonic() - last_progress > stall_timeout_s:
                failed = f"no training step for {stall_timeout_s:.0f}s; see {logs}"
                break
            if len(progress.rewards) > bar.n:
                bar.update(len(progress.rewards) - bar.n)
                last = max(progress.rewards)
                elapsed = max(1e-9, ((progress.last_step_ms or 0) - (progress.version0_ms or 0)) / 1000)
                served, progress.versions_since_shown = sorted(progress.versions_since_shown), set()
                bar.set_postfix(reward=f"{progress.rewards[last]:.3f}",
                                tok_s=f"{sum(progress.tokens.values()) / elapsed:.0f}", versions=str(served))
            where = sup.placement()
            failed = sup.check()
            if failed:
                failed = f"{failed}; see {logs}"
                break
            if sup.placement() != where:
                record_pids()
            if sup.finished("trainer") and not progress.done:
                trainer_exit = trainer_exit or time.monotonic()
                if time.monotonic() - trainer_exit > 30:
                    failed = f"the trainer finished but reported no 'done' metric; see {logs}"
                    break
    except KeyboardInterrupt:
        failed = "interrupted"
    finally:
        # the roles first: closing the bar writes to an output that may be gone (Ctrl-C on `| tee`, an ssh
        # drop), and a BrokenPipeError there must not skip the stop (it orphaned every role)
        sup.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for close in (bar.close, tb.close, watcher.close):
            with contextlib.suppress(OSError):
                close()
    steps_done = len(progress.rewards)
    reward_per_step = [progress.rewards[k] for k in sorted(progress.rewards)]
    trained = float(sum(progress.tokens.values()))
    rl_wall = max(1e-9, ((progress.last_step_ms or 0) - (progress.version0_ms or 0)) / 1000)
    summary: dict[str, Any] = {
        "run_id": info.run_id, "mode": config.mode, "engine": config.engine, "steps": steps_done,
        "wall_s": round(time.monotonic() - t_start, 3), "warmup_s": round(progress.warmup_s, 3),
        "max_versions_live": progress.max_versions_live,
        "rl_wall_s": round(rl_wall, 3), "reward_per_step": reward_per_step, "trained_tokens": trained,
        "throughput_tokens_per_s": trained / rl_wall if steps_done else 0.0,
        "max_staleness_seen": max(progress.staleness.values(), default=0.0),
        "reward_first5": sum(reward_per_step[:5]) / max(1, len(reward_per_step[:5])),
        "reward_last5": sum(reward_per_step[-5:]) / max(1, len(reward_per_step[-5:])),
        "prompts": prompts_needed(config), "config": json.loads(config.to_json()), "logs": str(logs),
        "restarts": sup.restarts(), "failed": failed, "data": dataset_identity(config),
        "tensorboard": str(rdir / "tensorboard"), **eval_summary(progress),
    }
    # the evaluations inside the RL window (version 0 .. steps-1: each ran before the next step; the last
    # version's ran after the last step, outside rl_wall_s)
    in_window = sum(s for v, s in progress.eval_s.items() if v < steps_done)
    summary["train_wall_s_excl_eval"] = round(rl_wall - in_window, 3)
    finish_run(bootstrap, info, json.dumps(summary), failed=failed is not None, token=_token_of(info.run_id))
    if json_path is not None:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(summary, indent=2))
    (rdir / "summary.json").write_text(json.dumps(summary, indent=2))
    plot_summary(bootstrap, summary, rdir, json_path)  # summary.png beside each summary.json (never raises)
    if failed:
        raise RuntimeError(failed)
    return summary
