"""Helpers shared by the integration tests that follow a live run (tests/integration is on sys.path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


def _metrics(bootstrap: str, run_id: str) -> list[Any]:
    """The decodable records of ``dora.metrics`` from the run's start (garbage on the topic is passed over)."""
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.runs import get_run, read_run
    from dora_rl.schemas.codec import DecodeError
    from dora_rl.schemas.records import Metric

    out = []
    for msg in read_run(bootstrap, get_run(bootstrap, run_id), topics.METRICS):
        try:
            out.append(Metric.decode(msg.value(), msg.headers()))
        except DecodeError:
            continue
    return out


def steps_done(bootstrap: str, run_id: str) -> int:

    steps = set()
    for m in _metrics(bootstrap, run_id):
        if m.run_id == run_id and m.component == "trainer" and m.name == "reward_mean" and m.step is not None:
            steps.add(int(m.step))
    return len(steps)


def wait_for(cond: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.5)


def emulated_run(**overrides: Any) -> dict[str, Any]:
    """A small dora-mode run config on the emulated engine (2 instances, TBS 16, G 4), with overrides;
    ``emulated`` overrides are merged into the engine's parameters."""
    engine = {"vocab": 59, "eos_id": 2, "base_step_s": 0.03, "cap_fraction": 0.1, **overrides.pop("emulated", {})}
    return {"mode": "dora", "max_staleness": 1, "steps": 8, "train_batch_size": 16, "group_size": 4,
            "rollout_batch_size": 32, "num_instances": 2, "instance_concurrency": 16, "max_new_tokens": 96,
            "engine": "emulated", "sft_steps": 0, "weight_transport": "tcp", "seed": 0, **overrides,
            "emulated": engine}


def trajectories_by_instance(bootstrap: str, run_id: str) -> dict[str, int]:
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.runs import get_run, read_run
    from dora_rl.schemas.records import Trajectory

    out: dict[str, int] = {}
    for msg in read_run(bootstrap, get_run(bootstrap, run_id), topics.TRAJECTORIES):
        t = Trajectory.decode(msg.value(), msg.headers())
        if t.run_id == run_id:
            out[t.instance_id] = out.get(t.instance_id, 0) + 1
    return out


def metric_total(bootstrap: str, run_id: str, component: str, name: str) -> float:

    total = 0.0
    for m in _metrics(bootstrap, run_id):
        if m.run_id == run_id and m.component == component and m.name == name:
            total += m.value
    return total


def launch_run(bootstrap: str, dora_home: Path, tmp_path: Path, config: dict[str, Any],
               json_out: Path | None = None, output: int | None = subprocess.PIPE
               ) -> tuple[subprocess.Popen[bytes], Path]:
    """``dora-rl run`` of ``config`` as a child process (stdout+stderr to ``output``); returns it and the
    new run's directory once every role is up (its ``pids.json`` exists). The caller kills it on failure."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config))
    runs = dora_home / "runs"
    known = {d.name for d in runs.iterdir()} if runs.exists() else set()  # the session's earlier runs
    args = [sys.executable, "-m", "dora_rl", "run", "--bootstrap-servers", bootstrap, "--config", str(cfg), "--quiet"]
    launcher = subprocess.Popen(args + (["--json", str(json_out)] if json_out else []), stdout=output,
                                stderr=subprocess.STDOUT if output == subprocess.PIPE else output, env=dict(os.environ))
    try:
        wait_for(lambda: runs.exists() and any((d / "pids.json").exists() for d in runs.iterdir()
                                               if d.name not in known), 120, "the roles")
    except BaseException:
        launcher.kill()
        raise
    return launcher, next(d for d in runs.iterdir() if d.name not in known and (d / "pids.json").exists())
