"""Elastic rollout (real broker, dora mode): an instance with work in flight vanishes for good mid-run and a
newcomer with a new index joins later; the lost work is generated again, the newcomer produces
trajectories, and the strict audit passes with nothing missing.

"Vanishes" is SIGSTOP: the process neither heartbeats nor dies, as a host lost behind a partition
(a SIGKILLed one would be restarted by the supervisor and come back).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import emulated_run
from run_helpers import metric_total as _metric_total
from run_helpers import steps_done as _steps_done
from run_helpers import trajectories_by_instance as _trajectories_by_instance
from run_helpers import wait_for as _wait

pytestmark = pytest.mark.broker

CONFIG = emulated_run(steps=14, seed=9, instance_timeout_s=6.0)


def test_a_lost_instance_is_replaced_by_a_newcomer_and_nothing_is_lost(
        bootstrap: str, dora_home: Path, tmp_path: Path) -> None:
    from dora_rl.consumers.audit import audit_run

    cfg, out = tmp_path / "config.json", tmp_path / "summary.json"
    cfg.write_text(json.dumps(CONFIG))
    runs = dora_home / "runs"
    known = {d.name for d in runs.iterdir()} if runs.exists() else set()
    launcher = subprocess.Popen([sys.executable, "-m", "dora_rl", "run", "--bootstrap-servers", bootstrap,
                                 "--config", str(cfg), "--json", str(out), "--quiet"], stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=dict(os.environ))
    newcomer: subprocess.Popen[bytes] | None = None
    lost_pid = 0
    try:
        _wait(lambda: runs.exists() and any((d / "pids.json").exists() for d in runs.iterdir()
                                            if d.name not in known), 120, "the roles")
        rdir = next(d for d in runs.iterdir() if d.name not in known and (d / "pids.json").exists())
        run_id = rdir.name
        _wait(lambda: _steps_done(bootstrap, run_id) >= 2, 180, "two steps")
        lost_pid = json.loads((rdir / "pids.json").read_text())["rollout-1"]
        os.kill(lost_pid, signal.SIGSTOP)  # its host is gone: no heartbeat, no exit, its work in flight
        env = dict(os.environ, DORA_WEIGHT_TOKEN=(rdir / "weight-token").read_text().strip())
        newcomer = subprocess.Popen([sys.executable, "-m", "dora_rl", "rollout", "--bootstrap-servers", bootstrap,
                                     "--run-id", run_id, "--index", "2"], stdout=(tmp_path / "rollout-2.log").open("w"),
                                    stderr=subprocess.STDOUT, env=env)
        # the newcomer joins (started now, it loads while the lost instance's timeout runs out) and must
        # produce before the run ends: wait for it rather than race the run's end
        _wait(lambda: launcher.poll() is not None
              or _trajectories_by_instance(bootstrap, run_id).get("rollout-2", 0) > 0, 300, "the newcomer's output")
        code = launcher.wait(timeout=600)
        log = launcher.stdout.read().decode() if launcher.stdout else ""
        assert code == 0, log[-3000:]
    finally:
        for p in (launcher, newcomer):
            if p is not None and p.poll() is None:
                p.kill()
        if lost_pid:
            try:
                os.kill(lost_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert json.loads(out.read_text())["steps"] == CONFIG["steps"]
    assert _metric_total(bootstrap, run_id, "orchestrator", "redispatched") > 0, "the lost work was not re-dispatched"
    assert _trajectories_by_instance(bootstrap, run_id).get("rollout-2", 0) > 0, "the newcomer produced nothing"
    report = audit_run(bootstrap, run_id)
    assert report.verdict == "PASS", report.render()
    assert report.c2_missing == 0


def test_more_instances_than_request_partitions_all_served_and_moved_between_versions(
        bootstrap: str, dora_home: Path, tmp_path: Path) -> None:
    """More instances than the request topic's 16 default partitions: the run grows the topic to
    ``max_instances``; every instance, the two past the 16 included, is sent work and generates it; instances are
    moved to newer versions; every instance holds each version it generated; the audit passes."""
    from dora_rl.consumers.audit import audit_run
    from dora_rl.infra.kafka import topics
    from dora_rl.infra.kafka.runs import get_run, read_run
    from dora_rl.schemas.records import InstanceStatus, RolloutRequest, Trajectory

    # migrate: a moved instance switches at once. Under drain (the default) the instances that keep the oldest
    # version's stragglers switch only when those finish, which in a 6-step run can come after the last
    # dispatch: measured, rollout-0 and -1 then ended on version 0 alone (decision 0033)
    # 18 > the 16 partitions (24 took a third longer on 2 cores and tested nothing more)
    # Which instances are sent a second version is timing: with 12 new groups a step for 18 one-group instances,
    # six sit idle at any time, and a freed instance may get no work of its new version before the run ends (CI
    # failed twice on "every instance is sent two versions", decision 0037). What the design guarantees is checked.
    config = {**CONFIG, "num_instances": 18, "max_instances": 18, "steps": 6, "train_batch_size": 48,
              "group_size": 4, "rollout_batch_size": 96, "instance_concurrency": 4, "seed": 10,
              "max_staleness": 2, "repartition_policy": "migrate"}
    cfg, out = tmp_path / "config.json", tmp_path / "summary.json"
    cfg.write_text(json.dumps(config))
    res = subprocess.run([sys.executable, "-m", "dora_rl", "run", "--bootstrap-servers", bootstrap, "--config",
                          str(cfg), "--json", str(out), "--quiet"], capture_output=True, text=True, timeout=600,
                         env=dict(os.environ))
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    run_id = json.loads(out.read_text())["run_id"]
    held: dict[str, set[int]] = {}
    for msg in read_run(bootstrap, get_run(bootstrap, run_id), topics.INSTANCES):
        st = InstanceStatus.decode(msg.value(), msg.headers())
        if st.run_id == run_id and st.loaded_version >= 0:
            held.setdefault(st.instance_id, set()).add(int(st.loaded_version))
    assert len(held) == 18, sorted(held)
    sent: dict[int, set[int]] = {}
    for msg in read_run(bootstrap, get_run(bootstrap, run_id), topics.REQUESTS):
        req = RolloutRequest.decode(msg.value(), msg.headers())
        if req.action == "GENERATE":
            sent.setdefault(msg.partition(), set()).add(int(req.policy_version))
    assert sorted(sent) == list(range(18)), sorted(sent)
    assert any(len(versions) >= 2 for versions in sent.values()), "no instance was moved to a newer version"
    assert len(set().union(*sent.values())) >= 3, sent
    generated: dict[str, set[int]] = {}
    for msg in read_run(bootstrap, get_run(bootstrap, run_id), topics.TRAJECTORIES):
        t = Trajectory.decode(msg.value(), msg.headers())
        generated.setdefault(t.instance_id, set()).add(int(t.instance_version))
    assert all(v <= held[i] for i, v in generated.items()), "an instance generated a version it never announced holding"
    assert {"rollout-16", "rollout-17"} <= set(generated), sorted(generated)
    report = audit_run(bootstrap, run_id)
    assert report.verdict == "PASS", report.render()
