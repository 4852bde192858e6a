"""Role supervision for ``dora-rl run``: a role that dies is started again, within bounds.

Rule (pure: :class:`RestartPolicy`, tested without processes):

- a role that exits with code 0 has finished (the dataset after writing its prompts, the trainer
  after its last step, the orchestrator once every step is consumed) and is not started again;
- a role that dies any other way (non-zero exit, a signal such as SIGKILL, or a graceful stop on SIGTERM,
  SIGINT or SIGHUP by someone else, which exits ``128 + signum``: ``dora_rl.roles.StopFlag``) is started again after a
  backoff of ``backoff_s[k]`` seconds for its ``k``-th restart (the last value repeats);
- a role that died more than ``max_restarts`` times within ``window_s`` seconds keeps dying: the run
  fails, naming it.

Roles restart from the log (their state is on Kafka, docs/decisions/0015), so restarting is safe.
:class:`Supervisor` applies the rule to child processes and counts restarts per role for the summary. Its
interface (``start``, ``check``, ``finished``, ``restarts``, ``placement``, ``stop``) is the one
``launcher.supervise`` follows a run through; :class:`dora_rl.ray_placement.RayRoles` offers it for roles
placed by Ray, whose own fault tolerance restarts them.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    """When to start a dead role again (see the module docstring)."""

    max_restarts: int = 5
    """Deaths tolerated per role within ``window_s``; one more fails the run."""
    window_s: float = 300.0
    backoff_s: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0)

    def decide(self, exit_code: int, deaths: list[float], now: float) -> tuple[str, float]:
        """``("finished", 0)``, ``("restart", delay_s)`` or ``("fail", 0)`` for a role that just exited
        with ``exit_code``; ``deaths`` are the times of its earlier deaths (this one excluded)."""
        if exit_code == 0:
            return "finished", 0.0
        recent = [t for t in deaths if now - t <= self.window_s]
        if len(recent) >= self.max_restarts:
            return "fail", 0.0
        return "restart", self.backoff_s[min(len(deaths), len(self.backoff_s) - 1)]


@dataclass
class _Child:
    name: str
    role: str
    index: int
    proc: subprocess.Popen[bytes]
    deaths: list[float] = field(default_factory=list)
    restart_at: float | None = None
    finished: bool = False


class Supervisor:
    """Starts roles with ``spawn(role, index)`` and applies :class:`RestartPolicy` to them."""

    def __init__(self, spawn: Callable[[str, int], subprocess.Popen[bytes]],
                 policy: RestartPolicy | None = None) -> None:
        self.spawn = spawn
        self.policy = policy or RestartPolicy()
        self.children: dict[str, _Child] = {}
        self.failed: str | None = None

    def start(self, name: str, role: str, index: int = 0) -> None:
        self.children[name] = _Child(name, role, index, self.spawn(role, index))

    placement_file = "pids.json"

    def processes(self) -> dict[str, subprocess.Popen[bytes]]:
        return {n: c.proc for n, c in self.children.items()}

    def placement(self) -> dict[str, int]:
        """Each role's process id (``pids.json``: what ``dora-rl resume`` kills as orphans)."""
        return {n: c.proc.pid for n, c in self.children.items()}

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM every child, then SIGKILL what is still alive after ``timeout``."""
        procs = self.processes().values()
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for p in procs:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def finished(self, name: str) -> bool:
        return self.children[name].finished

    def restarts(self) -> dict[str, int]:
        """Restarts so far, per role name."""
        return {n: len(c.deaths) for n, c in self.children.items() if c.deaths}

    def check(self, now: float | None = None) -> str | None:
        """Reap exited roles, restart the due ones; returns the failure reason once a role keeps dying."""
        now = time.monotonic() if now is None else now
        for c in self.children.values():
            if c.finished or self.failed:
                continue
            if c.restart_at is not None:
                if now >= c.restart_at:
                    log.warning("restarting %s (restart %d)", c.name, len(c.deaths))
                    c.proc = self.spawn(c.role, c.index)
                    c.restart_at = None
                continue
            code = c.proc.poll()
            if code is None:
                continue
            action, delay = self.policy.decide(code, c.deaths, now)
            if action == "finished":
                c.finished = True
            elif action == "fail":
                self.failed = (f"role {c.name} keeps dying: {len(c.deaths) + 1} deaths within "
                               f"{self.policy.window_s:.0f}s (last exit code {code})")
            else:
                c.deaths.append(now)
                c.restart_at = now + delay
                log.warning("role %s died (exit code %s); restart in %.1fs", c.name, code, delay)
        return self.failed
