"""A dora-mode run across separate network stacks (real broker, real model, real weight channel): the
broker, the trainer, the stream roles and two rollout instances each in a Linux network namespace of
their own, joined by a bridge (``infra/netns.py``); the operator (this test) is in the root namespace.

Started as on many hosts: ``dora-rl create``, then each role alone in its namespace, binding its own
address (``--bind-host``), instances with ``--index auto``. Checked: the run finishes, the strict
audit passes, every announced weight holder is a namespace address (never loopback), and each
instance fetched weights across namespaces over the configured channel, with the route recorded:
UCX restricted to its network transport (``ucx/net TLS=tcp NET_DEVICES=eth0``: no shared memory, no
cma across namespaces, since host ids differ per network namespace) in the PLAINTEXT run.
Needs root (namespaces): with ``CI=true`` a missing capability fails, elsewhere it skips with the reason.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from multihost import STREAM_ROLES, claimed_indices, create_run, role_argv, run_state, stop
from run_helpers import wait_for

pytestmark = pytest.mark.broker
HOSTS = ("broker", "trainer", "streams", "rollout-a", "rollout-b")
BROKER_PORT = 19092
CONFIG: dict[str, Any] = {"mode": "dora", "max_staleness": 1, "steps": 4, "train_batch_size": 16,
                          "rollout_batch_size": 32, "group_size": 4, "num_instances": 2, "instance_concurrency": 16,
                          "sft_steps": 5, "max_new_tokens": 24, "seed": 21, "weight_transport": "ucx"}


@pytest.fixture
def lab() -> Iterator[Any]:
    from dora_rl.infra.netns import NetLab, netns_available

    why = netns_available()
    if why:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"network namespaces unavailable in CI: {why}")
        pytest.skip(f"network namespaces unavailable: {why}")
    with NetLab(HOSTS) as built:
        yield built


def start_broker(lab: Any, data_dir: Path, extra: str = "") -> str:
    """A broker inside the ``broker`` namespace, listening on its address; returns the bootstrap."""
    ip = lab.ip("broker")
    code = ("from dora_rl.infra.broker import LocalBroker; "
            f"LocalBroker({str(data_dir)!r}, port={BROKER_PORT}, host={ip!r}{extra}).start()")
    res = lab.run("broker", [sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return f"{ip}:{BROKER_PORT}"


def run_across_namespaces(lab: Any, bootstrap: str, tmp_path: Path, dora_home: Path, config: dict[str, Any],
                          env: dict[str, str] | None = None) -> tuple[str, Path]:
    """Create the run from here, start every role in its namespace, wait for FINISHED; (run id, logs)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(config))
    base = dict(env or os.environ, PYTHONUNBUFFERED="1")
    base.pop("DORA_WEIGHT_TOKEN", None)
    run_id = create_run(bootstrap, cfg, base)
    base["DORA_WEIGHT_TOKEN_FILE"] = str(dora_home / "runs" / run_id / "weight-token")
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def spawn(host: str, name: str, argv: list[str]) -> None:
        procs[name] = lab.popen(host, [*argv, "--bind-host", lab.ip(host)], env=base,
                                stdout=(logs / f"{name}.log").open("ab"), stderr=subprocess.STDOUT)

    try:
        for host in ("rollout-a", "rollout-b"):
            spawn(host, host, role_argv("rollout", bootstrap, run_id, "--index", "auto", "--instance-name", host))
        for role in STREAM_ROLES:
            spawn("streams", role, role_argv(role, bootstrap, run_id))
        spawn("trainer", "trainer", role_argv("trainer", bootstrap, run_id))
        spawn("streams", "dataset", role_argv("dataset", bootstrap, run_id))

        def finished() -> bool:
            dead = [n for n, p in procs.items() if p.poll() not in (None, 0)]
            assert not dead, f"roles died: {dead}: " + (logs / f"{dead[0]}.log").read_text()[-3000:]
            return run_state(bootstrap, run_id) == "FINISHED"

        wait_for(finished, 420, "the run to finish across namespaces")
    finally:
        stop(procs)
    return run_id, logs


def check_run(lab: Any, bootstrap: str, run_id: str, logs: Path, route: str) -> list[str]:
    """Audit, holders, routes; returns the fetch lines of the rollout logs."""
    from dora_rl.consumers.audit import audit_run
    from dora_rl.infra import topics
    from dora_rl.infra.kafka_io import read_all
    from dora_rl.infra.runs import get_run, offsets_map
    from dora_rl.schemas.records import PolicyVersion

    report = audit_run(bootstrap, run_id)
    assert report.verdict == "PASS", report.render()
    assert report.c2_missing == 0
    assert sorted(claimed_indices(bootstrap, run_id).values()) == [0, 1]
    start = {p: o for (t, p), o in offsets_map(get_run(bootstrap, run_id)).items() if t == topics.VERSIONS}
    holders = {h for m in read_all(bootstrap, topics.VERSIONS, start)
               for h in PolicyVersion.decode(m.value(), m.headers()).holders}
    lab_ips = {lab.ip(h) for h in ("trainer", "rollout-a", "rollout-b")}
    assert holders and {h.rsplit(":", 1)[0] for h in holders} <= lab_ips, f"holders {holders} not in {lab_ips}"
    fetches = []
    for host in ("rollout-a", "rollout-b"):
        lines = [ln for ln in (logs / f"{host}.log").read_text().splitlines() if re.search(r"version \d+ fetched", ln)]
        assert lines, f"{host} fetched no weights"
        assert all(route in ln for ln in lines), lines
        fetches += lines
    return fetches


def test_a_dora_run_across_network_namespaces_with_ucx_on_its_network_path(
        lab: Any, tmp_path: Path, dora_home: Path) -> None:
    from dora_rl.infra.broker import LocalBroker

    bootstrap = start_broker(lab, tmp_path / "broker")
    try:
        run_id, logs = run_across_namespaces(lab, bootstrap, tmp_path, dora_home, CONFIG)
        fetches = check_run(lab, bootstrap, run_id, logs, "via ucx/net TLS=tcp NET_DEVICES=eth0")
        print("\n".join(fetches))  # the measured cross-namespace fetches (GB/s), for the log of the test run
    finally:
        LocalBroker.attach(tmp_path / "broker").stop()
