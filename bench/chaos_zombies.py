"""bench/chaos zombie episodes: a role SIGSTOPped, replaced, then SIGCONTed — it must be fenced, never publish.

Used by ``bench/chaos.py`` (see its docstring for what an episode is and records). A transactional
role's replacement is started here with the launcher's command line; the zombie is watched in
``/proc`` (it is the launcher's child, not the bench's).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from chaos import RunWatch

TRANSACTIONAL = ("trainer", "orchestrator", "assembler", "scorer-0")
REPLACEMENT_OUTPUT_S = 30.0  # the longest a transactional zombie stays stopped waiting for its replacement
REPLACEMENT_EXIT_S = 60.0  # after the SIGCONT: the longest the bench waits for its replacement to be fenced
ZOMBIE_WATCH_S = 20.0  # after the SIGCONT: how long the zombie is watched in /proc
ROLLOUT_STOP_S = 12.0  # a rollout instance's stop: longer than a 10 s consumer session
SETTLE_S = 60.0  # before a stop: the longest wait for the role's current process to produce output


def role_spec(name: str) -> tuple[str, int]:
    """Role and index of a role name: ``"scorer-0"`` -> ``("scorer", 0)``, ``"trainer"`` -> ``("trainer", 0)``."""
    role, _, index = name.partition("-")
    return role, int(index or 0)


def proc_stat(pid: int) -> tuple[str, float, int | None] | None:
    """``(state, start wall time, wait status if exited but unreaped)`` of ``pid``; None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2:].split()  # fields[k] is field k + 3 of proc(5)
    started = time.time() - (uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK"))
    status = int(fields[49]) if fields[0] in "ZX" and len(fields) > 49 else None
    return fields[0], started, status


def exit_code(status: int) -> int:
    """A wait status as ``Popen.returncode`` reads: the exit code, or minus the signal."""
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def role_pid(rdir: Path, name: str) -> int:
    """The current pid of role ``name`` from ``pids.json`` (rewritten by the launcher on each restart)."""
    for _ in range(20):
        try:
            return int(json.loads((rdir / "pids.json").read_text())[name])
        except ValueError:  # caught mid-write
            time.sleep(0.05)
    return int(json.loads((rdir / "pids.json").read_text())[name])


def deaths_logged(log: Path, name: str) -> list[int]:
    """Exit codes of ``name``'s deaths, from the supervisor's warnings in the launcher log."""
    text = log.read_text(errors="replace") if log.exists() else ""
    return [int(c) for c in re.findall(rf"role {re.escape(name)} died \(exit code (-?\d+)\)", text)]


def spawn_replacement(bootstrap: str, rdir: Path, home: Path, name: str) -> subprocess.Popen[bytes]:
    """Start one more incarnation of role ``name`` as ``dora_rl.launcher.spawn`` does (same command line,
    environment and weight token), crash points disarmed, logging to ``<home>/replacement-<name>.log``."""
    role, index = role_spec(name)
    env = dict(os.environ, DORA_HOME=str(home), PYTHONUNBUFFERED="1",
               DORA_WEIGHT_TOKEN=(rdir / "weight-token").read_text().strip())
    env.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    env.pop("DORA_CRASH_POINTS", None)
    env.pop("DORA_CRASH_DIR", None)
    cmd = [sys.executable, "-m", "dora_rl", role, "--bootstrap-servers", bootstrap, "--run-id", rdir.name,
           "--index", str(index)]
    return subprocess.Popen(cmd, stdout=(home / f"replacement-{name}.log").open("a"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True)


def zombie_episode(name: str, bootstrap: str, rdir: Path, home: Path, watch: RunWatch,
                   launcher: subprocess.Popen[bytes]) -> dict[str, Any]:
    """One SIGSTOP/SIGCONT episode of role ``name`` (see the module docstring); returns its record."""
    fenced = name in TRANSACTIONAL

    def outputs_after(t: float) -> list[float]:
        return [x for x in watch.outputs.get(name, []) if x > t]

    def running() -> bool:
        return launcher.poll() is None

    ep: dict[str, Any] = {"role": name, "kind": "fenced" if fenced else "paused"}
    # the role's current process: alive, ours, and past its start (it produced output since it started)
    deadline = time.monotonic() + SETTLE_S
    pid, settled = role_pid(rdir, name), False
    while running() and time.monotonic() < deadline:
        pid = role_pid(rdir, name)
        st = proc_stat(pid)
        try:
            ours = rdir.name.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            ours = False
        if st is not None and st[0] not in "ZX" and ours and outputs_after(st[1]):
            settled = True
            break
        watch.poll(0.2)
    if not settled:
        ep["skipped"] = "the run ended" if not running() else f"no live {name} producing output within {SETTLE_S:.0f}s"
        return ep
    deaths_before = len(deaths_logged(home / "launcher.log", name))
    ep.update(zombie_pid=pid, at_step=len(watch.steps), t_stop=time.time())
    try:
        os.kill(pid, signal.SIGSTOP)
    except ProcessLookupError:
        return {"role": name, "kind": ep["kind"], "skipped": f"{name} ({pid}) died just before its SIGSTOP"}
    replacement: subprocess.Popen[bytes] | None = None
    try:
        if fenced:
            replacement = spawn_replacement(bootstrap, rdir, home, name)
            ep["replacement_pid"] = replacement.pid
            until = time.monotonic() + REPLACEMENT_OUTPUT_S
            while running() and replacement.poll() is None and time.monotonic() < until:
                watch.poll(0.2)
                first = outputs_after(ep["t_stop"])
                if first:
                    ep["t_replacement_output"] = min(first)
                    break
        else:
            ep["replacement_pid"] = None
            until = time.monotonic() + ROLLOUT_STOP_S
            while running() and time.monotonic() < until:
                watch.poll(min(0.5, max(0.01, until - time.monotonic())))
    finally:
        ep["t_cont"] = time.time()
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    ep["steps_at_cont"] = len(watch.steps)
    ep.setdefault("t_replacement_output", None)
    # after the SIGCONT: the zombie (in /proc), the supervisor's next incarnation, the replacement
    t_cont, exited_at, code = ep["t_cont"], None, None
    restart_pid: int | None = None
    watch_until = t_cont + ZOMBIE_WATCH_S
    repl_until = t_cont + REPLACEMENT_EXIT_S
    while True:
        now = time.time()
        if exited_at is None and now < watch_until:
            st = proc_stat(pid)
            if st is None or st[0] in "ZX":
                exited_at = now
                code = exit_code(st[2]) if st is not None and st[2] is not None else None
        if restart_pid is None and exited_at is not None:
            current = role_pid(rdir, name)
            restart_pid = current if current != pid else None
        watch.poll(0.05)
        zombie_done = exited_at is not None or now >= watch_until
        if not fenced:
            resumed = bool(outputs_after(t_cont)) and now - t_cont >= 3.0
            if zombie_done or resumed or not running():
                break
            continue
        assert replacement is not None
        if zombie_done and (replacement.poll() is not None or now >= repl_until or not running()):
            break
    if exited_at is not None and code is None:  # reaped before we saw it: the supervisor logged the code
        for _ in range(20):
            logged = deaths_logged(home / "launcher.log", name)
            if len(logged) > deaths_before:
                code = logged[deaths_before]
                break
            time.sleep(0.1)
    ep.update(zombie_exited=exited_at is not None, zombie_exit_code=code,
              zombie_exit_after_cont_s=round(exited_at - t_cont, 3) if exited_at is not None else None,
              restarted_pid=restart_pid)
    later = outputs_after(t_cont)
    ep["next_output_after_cont_s"] = round(min(later) - t_cont, 3) if later else None
    if replacement is not None:
        if replacement.poll() is None:
            ep["replacement_stopped_by_bench"] = True
            replacement.terminate()
            try:
                replacement.wait(15)
            except subprocess.TimeoutExpired:
                replacement.kill()
                replacement.wait()
        else:
            ep["replacement_stopped_by_bench"] = False
            ep["replacement_exit_after_cont_s"] = round(time.time() - t_cont, 3)  # upper bound (polled)
        ep["replacement_exit_code"] = replacement.returncode
    else:
        ep["replacement_exit_code"] = None
    ep["steps_at_end"] = len(watch.steps)
    ep["run_continued"] = ep["steps_at_end"] > ep["at_step"]
    ep["run_ended_during_episode"] = not running()
    ep["t_end"] = time.time()
    ep["watched_after_cont_s"] = round(ep["t_end"] - t_cont, 3)
    for k in ("t_stop", "t_cont", "t_replacement_output", "t_end"):
        if ep.get(k) is not None:
            ep[k] = round(ep[k], 3)
    return ep


def zombie_line(ep: dict[str, Any]) -> str:
    """One line saying what happened in a zombie episode."""
    if "skipped" in ep:
        return f"skipped: {ep['skipped']}"
    stop_s = ep["t_cont"] - ep["t_stop"]
    head = (f"pid {ep['zombie_pid']} stopped {stop_s:.1f}s at step {ep['at_step']} "
            f"({ep['steps_at_cont'] - ep['at_step']} steps meanwhile)")
    if ep["zombie_exited"]:
        zombie = f"zombie exited {ep['zombie_exit_after_cont_s']:.1f}s after SIGCONT (code {ep['zombie_exit_code']})"
    else:
        zombie = f"zombie alive {min(ZOMBIE_WATCH_S, ep['watched_after_cont_s']):.1f}s after SIGCONT"
    nxt = ep["next_output_after_cont_s"]
    end = "; the run ended meanwhile" if ep["run_ended_during_episode"] else ""
    if ep["kind"] == "paused":
        return f"{head}; {zombie}; next output {nxt}s after SIGCONT; run continued: {ep['run_continued']}{end}"
    repl = ep["t_replacement_output"]
    first = f"{repl - ep['t_stop']:.1f}s" if repl is not None else "never"
    how = "stopped by the bench" if ep["replacement_stopped_by_bench"] else "exited"
    return (f"{head}; replacement {ep['replacement_pid']} first output after {first}; {zombie}; "
            f"restarted as {ep['restarted_pid']}; replacement {how} (code {ep['replacement_exit_code']}){end}")

