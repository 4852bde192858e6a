"""NetLab: two namespaces talk TCP over the lab bridge, the root namespace reaches both, and teardown
leaves no namespace or interface behind. Without netns support this skips with the reason, except
under ``CI=true`` where it fails (the cross-namespace tests must run in CI)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from dora_rl.infra.lab.netns import NetLab, NetLabError, netns_available

ECHO_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], 7007)); s.listen(4); print("ready", flush=True)
for _ in range(2):
    c, _ = s.accept()
    with c:
        c.sendall(c.recv(100).upper())
"""

ECHO_CLIENT = """
import socket, sys
with socket.create_connection((sys.argv[1], 7007), timeout=5) as c:
    c.sendall(b"hello from " + sys.argv[2].encode()); print(c.recv(100).decode())
"""


@pytest.fixture(scope="module")
def available() -> None:
    reason = netns_available()
    if reason is None:
        return
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"network namespaces are required in CI: {reason}")
    pytest.skip(f"network namespaces unavailable: {reason}")


def _echo(addr: str, name: str, lab: NetLab | None = None) -> str:
    argv = [sys.executable, "-c", ECHO_CLIENT, addr, name]
    r = lab.run(name, argv, capture_output=True, text=True, timeout=10) if lab else subprocess.run(
        argv, capture_output=True, text=True, timeout=10
    )
    assert r.returncode == 0, r.stderr
    return str(r.stdout.strip())


def _root_state() -> tuple[str, str]:
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return ns, links


def test_two_namespaces_echo_and_clean_teardown(available: None) -> None:
    before = _root_state()
    with NetLab(["a", "b"]) as lab:
        assert lab.device == "eth0" and lab.bridge_ip.endswith(".0.1")
        assert lab.ip("a") != lab.ip("b") and lab.netns("a") != lab.netns("b")
        server = lab.popen("a", [sys.executable, "-c", ECHO_SERVER, lab.ip("a")], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        assert _echo(lab.ip("a"), "b", lab) == "HELLO FROM B"  # namespace -> namespace
        assert _echo(lab.ip("a"), "root") == "HELLO FROM ROOT"  # root -> namespace
        server.wait(10)
        # namespace -> root: a listener in the root namespace on the bridge address
        back = subprocess.Popen([sys.executable, "-c", ECHO_SERVER, lab.bridge_ip], stdout=subprocess.PIPE, text=True)
        assert back.stdout is not None and back.stdout.readline().strip() == "ready"
        assert _echo(lab.bridge_ip, "a", lab) == "HELLO FROM A"
        assert _echo(lab.bridge_ip, "b", lab) == "HELLO FROM B"
        back.wait(10)
        # the eth0 inside carries the lab address; the namespace does not see the root's links
        inner = lab.run("b", ["ip", "-o", "-4", "addr", "show", "dev", "eth0"], capture_output=True, text=True)
        assert f"{lab.ip('b')}/24" in inner.stdout
        left_running = lab.popen("b", ["sleep", "60"])  # teardown kills what is left in a namespace
        names = [lab.netns("a"), lab.netns("b")]
        tag = lab.tag
    assert left_running.wait(5) is not None
    ns, links = _root_state()
    assert not any(n in ns for n in names), ns
    assert f"db-{tag}" not in links and f"dv-{tag}-" not in links, links
    assert (ns, links) == before


def test_teardown_after_error_and_bad_arguments(available: None) -> None:
    with pytest.raises(ValueError):
        NetLab(["x", "x"])
    with pytest.raises(ValueError):
        NetLab(["x"], tag="far-too-long")
    before = _root_state()
    t0 = time.monotonic()
    with pytest.raises(RuntimeError, match="boom"), NetLab(["x"]) as lab:
        tag = lab.tag
        raise RuntimeError("boom")
    assert _root_state() == before and f"db-{tag}" not in before[1]
    with NetLab(["y"]) as lab, pytest.raises(NetLabError, match="overlaps"), NetLab(["z"], lab.octet):
        pass
    assert _root_state() == before
    assert time.monotonic() - t0 < 10


def test_cleanup_stale_removes_a_crashed_lab_only(available: None) -> None:
    from dora_rl.infra.lab.netns import STATE_DIR, cleanup_stale

    cleanup_stale()  # labs left by an earlier, killed run on this machine are not this test's subject
    crash = "from dora_rl.infra.lab.netns import NetLab\nlab = NetLab(['c']).__enter__()\nprint(lab.tag, flush=True)\n"
    crash += "import time; time.sleep(60)\n"
    child = subprocess.Popen([sys.executable, "-c", crash], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    tag = child.stdout.readline().strip()
    try:
        with NetLab(["live"]) as lab:
            removed = cleanup_stale()  # the crashed lab's owner still runs: its lab is not stale yet
            pidfile = STATE_DIR / f"{tag}.pid"
            owner = pidfile.read_text().strip() if pidfile.exists() else "no pid file"
            assert not [r for r in removed if tag in r or lab.tag in r], (removed, child.poll(), child.pid, owner)
            child.kill()
            child.wait(5)
            removed = cleanup_stale()
            assert f"dora-{tag}-c" in removed and f"db-{tag}" in removed, removed
            assert lab.netns("live") in _root_state()[0]  # a live lab is left alone
    finally:  # a failure above must not leave the crashed lab to fail the next run's first check
        child.kill()
        child.wait(5)
        cleanup_stale()
    ns, links = _root_state()
    assert tag not in ns and f"db-{tag}" not in links
