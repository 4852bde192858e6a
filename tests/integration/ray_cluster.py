"""A real Ray cluster for the tests: ``ray start`` nodes (the ``ray`` package's own CLI), on this host or one per
network namespace of a :class:`~dora_rl.infra.lab.netns.NetLab`.

Each node gets a small object store (100 MB: several nodes share this host's memory), no dashboard, and
custom resources that steer placement the way GPUs would on a real cluster (``dora_trainer`` where a trainer
may run, ``dora_rollout`` where instances may). The head's health checks are tightened
(:data:`FAST_HEALTH`) so that a vanished node is declared dead within about three seconds, not thirty.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

RAY = str(Path(sys.executable).with_name("ray"))
FAST_HEALTH = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 500,
               "health_check_timeout_ms": 500, "health_check_failure_threshold": 5}


def _common(ip: str, cpus: float, resources: dict[str, float]) -> list[str]:
    return ["--node-ip-address", ip, "--num-cpus", str(int(cpus)), "--num-gpus", "0",
            "--resources", json.dumps(resources), "--object-store-memory", str(100 * 2**20),
            "--disable-usage-stats"]


def start_head(ip: str, port: int, cpus: float, resources: dict[str, float],
               prefix: Sequence[str] = (), env: dict[str, str] | None = None) -> str:
    """Start the head node (GCS on ``ip:port``); returns the cluster address. Its temporary directory, which
    the workers take over, is a short one under /tmp: Ray's socket paths must fit in 107 bytes."""
    temp_dir = tempfile.mkdtemp(prefix="dray-", dir="/tmp")
    argv = [*prefix, RAY, "start", "--head", "--port", str(port), "--include-dashboard", "false",
            "--temp-dir", temp_dir, "--system-config", json.dumps(FAST_HEALTH), *_common(ip, cpus, resources)]
    _run(argv, env)
    return f"{ip}:{port}"


def start_worker(address: str, ip: str, cpus: float, resources: dict[str, float],
                 prefix: Sequence[str] = (), env: dict[str, str] | None = None) -> None:
    """Join a worker node to the cluster at ``address``."""
    _run([*prefix, RAY, "start", "--address", address, *_common(ip, cpus, resources)], env)


def _run(argv: list[str], env: dict[str, str] | None) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, env={**os.environ, **(env or {})})
    assert proc.returncode == 0, f"$ {' '.join(argv)}\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}"


def stop(prefix: Sequence[str] = ()) -> None:
    """``ray stop --force``: every Ray process on this machine (it finds them by name, whatever their network
    namespace)."""
    subprocess.run([*prefix, RAY, "stop", "--force"], capture_output=True, timeout=120)


def _ask(address: str, expression: str) -> Any:
    """``expression`` (JSON-able) evaluated in a fresh process joined to the cluster at ``address`` (a test process
    stays out of Ray); RuntimeError with its stderr when it fails."""
    code = ("import json,ray,sys; from ray._private import state; "
            f"ray.init(address=sys.argv[1], logging_level='ERROR'); print(json.dumps({expression}))")
    out = subprocess.run([sys.executable, "-c", code, address], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip()[-500:] or f"exit {out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def describe_actors(address: str) -> str:
    """One entry per named actor of the cluster at ``address`` (name, state, node, restarts: from Ray's control
    store, no dashboard needed), for a failing test's message; what went wrong asking, if that failed."""
    try:
        rows = _ask(address, "[[a['Name'], a['State'], a['Address']['IPAddress'], a['NumRestarts']] "
                             "for a in state.actors().values() if a['Name']]")
        return "Ray's actors: " + "; ".join(f"{n} {s} on {ip or '-'} ({r} restarts)" for n, s, ip, r in rows)
    except (RuntimeError, ValueError, IndexError, subprocess.TimeoutExpired) as exc:
        return f"Ray's actors: no answer ({exc})"


def _nodes(address: str) -> list[tuple[str, bool]]:
    """Each node of the cluster at ``address`` (its address, whether Ray counts it alive)."""
    rows = _ask(address, "[[n['NodeManagerAddress'], n['Alive']] for n in ray.nodes()]")
    return [(str(ip), bool(alive)) for ip, alive in rows]


def alive_nodes(address: str, expect: int, timeout: float = 60.0) -> None:
    """Wait until the cluster at ``address`` counts ``expect`` alive nodes."""
    deadline = time.monotonic() + timeout
    seen = ""
    while time.monotonic() < deadline:
        try:
            seen = str(sum(alive for _, alive in _nodes(address)))
        except (RuntimeError, ValueError) as exc:  # not up yet: asked again
            seen = f"no answer ({exc})"
        if seen == str(expect):
            return
        time.sleep(1)
    raise AssertionError(f"{address}: {seen or 'no answer'} alive nodes, expected {expect}")


def describe_nodes(address: str) -> str:
    """One line per node of the cluster at ``address`` (its address and whether Ray counts it alive), for a
    failing test's message; what went wrong asking, if that failed."""
    try:
        return "Ray's nodes: " + "; ".join(f"{ip} {'alive' if alive else 'dead'}" for ip, alive in _nodes(address))
    except (RuntimeError, ValueError, subprocess.TimeoutExpired) as exc:
        return f"Ray's nodes: no answer ({exc})"
