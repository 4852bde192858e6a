"""The trainer's data-parallel ranks (``config.trainer_ranks = N > 1``): N processes train one policy.

Rank 0 is the trainer role's own process (:mod:`.role`); :meth:`TrainerRanks.start` spawns ranks
``1 .. N-1`` as child processes (``python -c ...worker_main()``) that rendezvous with it over a
``TCPStore`` rank 0 opened on a free local port, so the launcher and ``dora-rl trainer`` start one
process as for one rank. Every rank holds an FSDP2-sharded copy of the policy and its AdamW state
(:func:`.step.build_state` with ``shard=True``) on its device: ``cpu`` for all ranks on CPU (gloo), else
``cuda:<base + rank>`` (``cuda`` is ``cuda:0``; gloo + NCCL, untested here). Rank 0 also keeps the
*plain* state the role works with (the "shadow": an unsharded model, optimizer and schedule on CPU) —
what it checkpoints, publishes and evaluates, exactly as a 1-rank trainer does with its own state.

Invariants:

- Commands, in one order on every rank: rank 0 broadcasts each on a control group (``("sync", ...)``,
  ``("train", batch)``, ``("stop", None)``) and then runs it itself; a worker rank runs what it receives
  until ``stop``. Every collective of a command (FSDP's all-gathers and reduce-scatters, the statistics'
  all-reduces, the state gathers and broadcasts) is therefore entered by every rank in the same order.
- After :meth:`TrainerRanks.sync` every rank holds its shard of the shadow's weights, optimizer state
  and LR-schedule position (the shadow after a restore or the warm-up: rank 0 loaded it from a
  checkpoint or trained it alone).
- After :meth:`TrainerRanks.train_step` the shadow holds the full weights, optimizer state and schedule
  the ranks ended with (gathered from the shards, bit for bit), which equal a 1-rank trainer's update of
  the same state on the same batch up to float rounding (:mod:`.distributed`). So a checkpoint has the
  1-rank format and loads into a 1-rank or an N-rank trainer; announced checksums are the shadow's.
- Worker ranks never outlive rank 0: each reads its standard input (a pipe from rank 0) until end of
  file and exits at once when it ends — rank 0 exited, however (``kill -9`` included: the kernel closes
  the pipe) — and on Linux also gets SIGKILL when its parent dies (``PR_SET_PDEATHSIG``). A worker that
  dies makes rank 0's next collective or command fail, so the role fails and its supervisor restarts
  rank 0, which spawns fresh workers and restores them from the checkpoint. A worker waits for commands
  on a control group whose timeout is :data:`IDLE_TIMEOUT_S` (rank 0 may wait long for a batch); every
  other collective is bounded by :data:`COLLECTIVE_TIMEOUT_S`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from dora_rl.config import DoraConfig
from dora_rl.schemas.records import TrainBatch

from .distributed import (
    DataParallel,
    broadcast_batch,
    full_optimizer_state_dict,
    full_state_dict,
    init_ranks,
    load_full_state,
    load_plain,
    plain_state_dicts,
)
from .step import TrainerState, build_state, train_step

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 1800.0
"""Bound on a training or state collective (and on the rendezvous): a step, or a gather, never takes longer."""
IDLE_TIMEOUT_S = 7 * 24 * 3600.0
"""Bound on a worker's wait for rank 0's next command (rank 0 waits on Kafka for batches meanwhile)."""
STOP_WAIT_S = 60.0
"""How long rank 0 waits for the workers to exit after ``stop`` before killing them."""
PARENT_GONE = 3
"""A worker's exit status when rank 0 disappeared."""

Command = tuple[str, Any]


def rank_device(config: DoraConfig, rank: int) -> str:
    """Rank ``rank``'s device: ``cpu`` on CPU, else ``cuda:<n + rank>`` for ``config.device = cuda[:n]``."""
    if config.device == "cpu":
        return "cpu"
    base = int(config.device.split(":", 1)[1]) if ":" in config.device else 0
    return f"cuda:{base + rank}"


@dataclass
class _Rank:
    """What every rank holds: its place, its sharded state, the control group and the config."""

    dp: DataParallel
    state: TrainerState
    control: dist.ProcessGroup
    config: DoraConfig


def _join(rank: int, world: int, store: dist.Store, config: DoraConfig) -> _Rank:
    """Join the process group (collective over all ranks, same order everywhere) and build the sharded state."""
    device = rank_device(config, rank)
    if device != "cpu":
        torch.cuda.set_device(device)
    dp = init_ranks(rank, world, store, cuda=device != "cpu", timeout_s=COLLECTIVE_TIMEOUT_S)
    control = dist.new_group(backend="gloo", timeout=timedelta(seconds=IDLE_TIMEOUT_S))
    return _Rank(dp, build_state(config, device=device, shard=True), control, config)


def _run(me: _Rank, cmd: Command, shadow: TrainerState | None,
         loaded: tuple[dict[str, Any], dict[str, Any] | None] = ({}, None)) -> dict[str, float] | None:
    """Run ``cmd`` on this rank (rank 0 passes its ``shadow``, and ``loaded``: the shadow's dicts for a
    sync). Collective: every rank runs every command."""
    kind, payload = cmd
    if kind == "sync":
        schedule, with_optimizer = payload
        model_sd, optim_sd = loaded
        load_full_state(me.state.model, me.state.optimizer if with_optimizer else None, model_sd, optim_sd or {})
        me.state.lr_schedule.load_state_dict(schedule)
        return None
    if kind == "train":
        stats = train_step(me.state, payload, me.config, me.dp)
        model_sd = full_state_dict(me.state.model)
        optim_sd = full_optimizer_state_dict(me.state.model, me.state.optimizer)
        if shadow is not None:
            load_plain(shadow.model, shadow.optimizer, model_sd, optim_sd)
            shadow.lr_schedule.load_state_dict(me.state.lr_schedule.state_dict())
        return stats
    raise ValueError(f"unknown trainer-rank command {kind!r}")


class TrainerRanks:
    """Rank 0's handle on the ranks: :meth:`start`, then :meth:`sync`, :meth:`train_step`, ...,
    :meth:`close` (or :meth:`abort` on failure). ``shadow`` is the role's plain state (see the module)."""

    def __init__(self, me: _Rank, shadow: TrainerState, workers: list[subprocess.Popen[bytes]]) -> None:
        self.me, self.shadow, self.workers = me, shadow, workers
        self.closed = False

    @classmethod
    def start(cls, config: DoraConfig, shadow: TrainerState) -> TrainerRanks:
        """Spawn ranks ``1 .. trainer_ranks - 1``, join them, and :meth:`sync` them to ``shadow``."""
        world = config.trainer_ranks
        store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        workers: list[subprocess.Popen[bytes]] = []
        try:
            for rank in range(1, world):
                workers.append(_spawn(rank, world, store.port, config))
            ranks = cls(_join(0, world, store, config), shadow, workers)
        except BaseException:
            _kill(workers)
            if dist.is_initialized():
                dist.destroy_process_group()
            raise
        log.info("trainer ranks: %d (worker pids %s) on %s", world, [p.pid for p in workers],
                 [rank_device(config, r) for r in range(world)])
        try:
            ranks.sync()
        except BaseException:
            ranks.abort()
            raise
        return ranks

    @property
    def pids(self) -> list[int]:
        """The worker ranks' process ids (ranks 1 .. N-1)."""
        return [p.pid for p in self.workers]

    def _command(self, cmd: Command) -> None:
        for rank, proc in enumerate(self.workers, start=1):
            code = proc.poll()
            if code is not None:
                raise RuntimeError(f"trainer rank {rank} (pid {proc.pid}) exited with status {code}")
        broadcast_batch(cmd, self.me.dp, self.me.control)

    def sync(self) -> None:
        """Every rank takes the shadow's weights, optimizer state and schedule position (collective)."""
        loaded = plain_state_dicts(self.shadow.model, self.shadow.optimizer)
        cmd: Command = ("sync", (self.shadow.lr_schedule.state_dict(), loaded[1] is not None))
        self._command(cmd)
        _run(self.me, cmd, self.shadow, loaded)

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """Every rank applies ``batch`` (:func:`.step.train_step` with its ``dp``); the shadow then holds
        the result. Returns the (global) statistics."""
        cmd: Command = ("train", batch)
        self._command(cmd)
        stats = _run(self.me, cmd, self.shadow)
        assert stats is not None
        return stats

    def close(self) -> None:
        """Tell the workers to stop, wait for them (killing any still alive after :data:`STOP_WAIT_S`),
        leave the process group. Idempotent. Never raises for a worker that died or hangs: everything the
        ranks computed is in the shadow (and durable) by now, so that only costs a warning."""
        if self.closed:
            return
        try:
            self._command(("stop", None))
            for proc in self.workers:
                proc.wait(STOP_WAIT_S)
        except Exception as exc:
            log.warning("trainer ranks did not stop cleanly (%s): killing them", exc)
        finally:
            self.abort()

    def abort(self) -> None:
        """Kill the workers (they may be stuck in a collective rank 0 left) and leave the process group."""
        if self.closed:
            return
        self.closed = True
        _kill(self.workers)
        dist.destroy_process_group()


def _spawn(rank: int, world: int, port: int, config: DoraConfig) -> subprocess.Popen[bytes]:
    """Start worker rank ``rank``; its stdin (a pipe rank 0 keeps open) carries the config, then its
    end-of-file says rank 0 is gone. Output goes where rank 0's goes (the role's log)."""
    code = "from dora_rl.consumers.trainer.ranks import worker_main; worker_main()"
    proc = subprocess.Popen([sys.executable, "-c", code, str(rank), str(world), str(port), str(os.getpid())],
                            stdin=subprocess.PIPE)
    assert proc.stdin is not None
    proc.stdin.write(config.to_json().encode() + b"\n")
    proc.stdin.flush()
    return proc


def _kill(workers: list[subprocess.Popen[bytes]]) -> None:
    for proc in workers:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        if proc.stdin is not None:
            proc.stdin.close()


def _exit_with_parent(parent: int, stdin: int) -> None:
    """Die when rank 0 does: SIGKILL on the parent's death (Linux), and a thread that reads the file
    descriptor ``stdin`` to its end (rank 0 closed it or died) and exits the process at once."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # died before the line above
        os._exit(PARENT_GONE)

    def watch() -> None:
        while os.read(stdin, 4096):  # unbuffered: no lock a daemon thread could hold at shutdown
            pass
        os._exit(PARENT_GONE)

    threading.Thread(target=watch, name="rank0-watch", daemon=True).start()


def _read_line(fd: int) -> str:
    """One line from ``fd``, read byte by byte (nothing after it is consumed)."""
    out = bytearray()
    while not out.endswith(b"\n"):
        byte = os.read(fd, 1)
        if not byte:
            os._exit(PARENT_GONE)
        out += byte
    return out.decode()


def worker_main() -> None:
    """Entry point of worker rank ``argv[1]`` of ``argv[2]``: join rank 0's store at port ``argv[3]``
    (``argv[4]``: rank 0's pid), then run rank 0's commands until ``stop``."""
    torch.set_num_threads(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C reaches rank 0, which stops us
    rank, world, port, parent = (int(a) for a in sys.argv[1:5])
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s trainer-rank{rank} %(levelname)s %(name)s: "
                                                   "%(message)s")
    config = DoraConfig.from_json(_read_line(0))
    _exit_with_parent(parent, 0)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    me = _join(rank, world, store, config)
    try:
        while True:
            cmd: Command = broadcast_batch(None, me.dp, me.control)
            if cmd[0] == "stop":
                break
            _run(me, cmd, None)
    finally:
        dist.destroy_process_group()
    log.info("rank %d stopped", rank)
