"""host_id(): equal within one network namespace, different across network namespaces of one kernel
(so UCX picks its network profile, never shared memory or cma, between NetLab hosts)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from dora_rl.infra.weights.ucx_config import host_id

PRINT_ID = "from dora_rl.infra.weights.ucx_config import host_id; print(host_id())"


def test_host_id_names_boot_pid_and_net_namespace() -> None:
    boot, pidns, netns = host_id().rsplit(":", 2)
    with open("/proc/sys/kernel/random/boot_id") as fh:
        assert boot == fh.read().strip()
    assert int(pidns) == os.stat("/proc/self/ns/pid").st_ino
    assert int(netns) == os.stat("/proc/self/ns/net").st_ino
    same = subprocess.run([sys.executable, "-c", PRINT_ID], capture_output=True, text=True, check=True)
    assert same.stdout.strip() == host_id()


def test_host_id_differs_in_another_network_namespace() -> None:
    from dora_rl.infra.lab.netns import NetLab, netns_available

    reason = netns_available()
    if reason is not None:
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"network namespaces are required in CI: {reason}")
        pytest.skip(f"network namespaces unavailable: {reason}")
    with NetLab(["h"]) as lab:
        r = lab.run("h", [sys.executable, "-c", PRINT_ID], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    other = r.stdout.strip()
    assert other != host_id()
    assert other.rsplit(":", 1)[0] == host_id().rsplit(":", 1)[0]  # same boot and PID namespace
