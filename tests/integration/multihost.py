"""A DORA run started the way a multi-host deployment starts it: ``dora-rl create``, then each role by
itself (any order, rollout instances with ``--index auto``), with no launcher. ``spawn`` decides where
a role runs (here, or inside a network namespace); the helpers read the outcome back from Kafka.
(tests/integration is on sys.path.)"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

Spawn = Callable[[str, list[str], dict[str, str]], "subprocess.Popen[bytes]"]
STREAM_ROLES = ("orchestrator", "assembler", "scorer")


def dora(*args: str) -> list[str]:
    return [sys.executable, "-m", "dora_rl", *args]


def local_spawn(logs: Path) -> Spawn:
    """Start a role here, its output appended to ``logs/<name>.log``."""
    logs.mkdir(parents=True, exist_ok=True)

    def spawn(name: str, argv: list[str], env: dict[str, str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, stdout=(logs / f"{name}.log").open("ab"), stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    return spawn


def create_run(bootstrap: str, config_file: Path, env: dict[str, str] | None = None,
               prefix: Sequence[str] = ()) -> str:
    """``dora-rl create``: the run id (nothing started)."""
    res = subprocess.run([*prefix, *dora("create", "--bootstrap-servers", bootstrap, "--config", str(config_file))],
                         capture_output=True, text=True, timeout=120, env=env or dict(os.environ))
    assert res.returncode == 0, res.stdout + res.stderr
    return res.stdout.split()[0]


def role_argv(role: str, bootstrap: str, run_id: str, *extra: str) -> list[str]:
    return dora(role, "--bootstrap-servers", bootstrap, "--run-id", run_id, *extra)


def claimed_indices(bootstrap: str, run_id: str) -> dict[str, int]:
    """``instance name -> index`` owned, by the rule every instance applies (core/instance_ids.py)."""
    from dora_rl.core.instance_ids import owners
    from dora_rl.infra import topics
    from dora_rl.infra.kafka_io import read_all
    from dora_rl.infra.runs import get_run, offsets_map
    from dora_rl.schemas.records import InstanceStatus

    start = {p: o for (t, p), o in offsets_map(get_run(bootstrap, run_id)).items() if t == topics.INSTANCES}
    recs = [InstanceStatus.decode(m.value(), m.headers()) for m in read_all(bootstrap, topics.INSTANCES, start)]
    own = owners((int(s.instance_index), s.incarnation) for s in recs if s.run_id == run_id)
    return {name: i for i, name in own.items() if name}


def last_in_flight(bootstrap: str, run_id: str, index: int) -> int:
    """Trajectories instance ``index`` reported decoding in its latest heartbeat (0 before it sent one)."""
    from dora_rl.infra import topics
    from dora_rl.infra.kafka_io import read_all
    from dora_rl.infra.runs import get_run, offsets_map
    from dora_rl.schemas.records import InstanceStatus

    start = {p: o for (t, p), o in offsets_map(get_run(bootstrap, run_id)).items() if t == topics.INSTANCES}
    recs = [InstanceStatus.decode(m.value(), m.headers()) for m in read_all(bootstrap, topics.INSTANCES, start)]
    mine = [s for s in recs if s.run_id == run_id and int(s.instance_index) == index]
    return int(mine[-1].in_flight) if mine else 0


def run_state(bootstrap: str, run_id: str) -> str:
    from dora_rl.infra.runs import get_run

    return str(get_run(bootstrap, run_id).state)


def stop(procs: dict[str, subprocess.Popen[bytes]], timeout: float = 20.0) -> None:
    for p in procs.values():
        if p.poll() is None:
            p.terminate()
    for p in procs.values():
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
