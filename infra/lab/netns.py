"""A lab of separate network "hosts" on one machine: one Linux network namespace per name, on a bridge.

Layout of a lab with tag ``t``, subnet octet ``k`` and names ``n_0 .. n_{m-1}``:

- bridge ``db-t`` in the root namespace, address ``10.k.0.1/24`` (:attr:`NetLab.bridge_ip`);
- namespace ``dora-t-n_i`` holding ``lo`` (up) and ``eth0`` = ``10.k.0.(i+2)/24``, default route via
  ``10.k.0.1``; ``eth0`` is the peer of veth ``dv-t-i`` (root namespace), a port of the bridge.

Invariants:

- Every name in the lab reaches every other one and the root namespace (the caller) reaches all of
  them, and back, over the bridge. No address of the lab overlaps an address or route that existed
  when it was made (``k`` is chosen free, or checked when given), and the choice is made under a
  file lock, so concurrent labs never collide. Interface names stay within 15 characters
  (``len(tag) <= 6``).
- Teardown (leaving the ``with`` block, also on errors) kills the processes left in the namespaces
  (``ip netns pids``), deletes the namespaces (which deletes ``eth0`` and so its veth pair), the
  bridge, and any firewall rule the lab added. Each lab writes its owner PID to
  ``/run/dora-netlab/<tag>.pid``; :func:`cleanup_stale` removes only labs whose owner is dead.
- ``net.bridge.bridge-nf-call-iptables = 1`` sends bridged IPv4 traffic through iptables' FORWARD
  chain (a host firewall with policy DROP would cut namespace <-> namespace traffic). The lab then
  inserts ``FORWARD -i db-t -o db-t -j ACCEPT`` (removed on teardown) when ``iptables`` exists; with
  no ``iptables`` binary and no legacy table loaded nothing can filter; otherwise it refuses to
  start (:class:`NetLabError` says what to do) rather than build a lab that silently drops packets.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

STATE_DIR = Path("/run/dora-netlab")
BRIDGE_NF = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")
_TAG = re.compile(r"^[a-z0-9]{1,6}$")
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")
_KILL_WAIT_S = 5.0


class NetLabError(RuntimeError):
    """A lab could not be built or torn down (the failing command and its stderr included)."""


def _ip(*args: str, check: bool = True) -> str:
    """Run ``ip args``; :class:`NetLabError` with the command and stderr when it fails."""
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and r.returncode != 0:
        raise NetLabError(f"`ip {' '.join(args)}` failed (rc {r.returncode}): {r.stderr.strip()}")
    return r.stdout


def netns_available() -> str | None:
    """None when network namespaces can be made here, else why not (not root, no ``ip``, EPERM)."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return f"network namespaces need root (euid is {os.geteuid()})"
    probe = f"dora-probe-{secrets.token_hex(4)}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` failed: {r.stderr.strip() or r.returncode}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    br = f"db-p{secrets.token_hex(2)}"
    r = subprocess.run(["ip", "link", "add", br, "type", "bridge"], capture_output=True, text=True)
    if r.returncode != 0:
        return f"cannot create a bridge: {r.stderr.strip() or r.returncode}"
    subprocess.run(["ip", "link", "del", br], capture_output=True)
    return None


def _namespaces() -> list[str]:
    return [line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()]


def _kill_netns(ns: str) -> None:
    """SIGKILL every process in ``ns`` and wait (bounded) until none is left, then delete it."""
    deadline = time.monotonic() + _KILL_WAIT_S
    while True:
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).split()]
        if not pids or time.monotonic() > deadline:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.02)
    _ip("netns", "del", ns, check=False)


def _used_10_octets() -> set[int]:
    """Second octets of every 10.x address or route of the root namespace."""
    text = _ip("-4", "-o", "addr") + _ip("-4", "route", "show", "table", "all")
    return {int(m) for m in re.findall(r"\b10\.(\d{1,3})\.", text)}


@contextlib.contextmanager
def _state_lock() -> Iterator[None]:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _bridge_filter_rule(bridge: str) -> list[str] | None:
    """The iptables rule to insert so bridged traffic is not filtered (None: nothing to do)."""
    try:
        on = BRIDGE_NF.read_text().strip() == "1"
    except OSError:
        return None  # br_netfilter not loaded: bridged frames never reach iptables
    if not on:
        return None
    rule = ["FORWARD", "-i", bridge, "-o", bridge, "-j", "ACCEPT"]
    if shutil.which("iptables"):
        return rule
    try:
        tables = Path("/proc/net/ip_tables_names").read_text().split()
    except OSError:
        tables = []
    if tables or shutil.which("nft"):
        raise NetLabError(
            f"{BRIDGE_NF} is 1 and a firewall may filter bridged traffic ({tables or 'nftables'}), but "
            "there is no `iptables` to add an ACCEPT rule: install iptables, or run "
            "`sysctl -w net.bridge.bridge-nf-call-iptables=0`"
        )
    return None


def cleanup_stale(prefix: str = "dora-") -> list[str]:
    """Delete namespaces named ``prefix*`` (and bridges / veths ``db-*`` / ``dv-*``) left by labs whose
    owner process is dead (or unknown). Returns what was removed. Live labs are left alone."""
    removed: list[str] = []
    with _state_lock():
        live: set[str] = set()
        for f in STATE_DIR.glob("*.pid"):
            try:
                alive = _pid_alive(int(f.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                alive = False
            if alive:
                live.add(f.stem)
            else:
                f.unlink(missing_ok=True)
        for ns in _namespaces():
            if ns.startswith(prefix) and not any(ns.startswith(f"{prefix}{t}-") for t in live):
                _kill_netns(ns)
                removed.append(ns)
        for line in _ip("-o", "link").splitlines():
            m = re.match(r"^\d+: (d[bv]-([a-z0-9]+)[^:@]*)[:@]", line)
            if m and m.group(2) not in live:
                _ip("link", "del", m.group(1), check=False)
                removed.append(m.group(1))
    return removed


@dataclass(frozen=True)
class Host:
    """One name of a lab: its namespace and its address on the lab bridge."""

    name: str
    netns: str
    ip: str
    veth: str


class NetLab:
    """Context manager: ``with NetLab(["holder", "f1"]) as lab: lab.popen("f1", argv)``."""

    device = "eth0"

    def __init__(self, names: Sequence[str], subnet_octet: int | None = None, tag: str | None = None) -> None:
        names = list(names)
        if not names or len(set(names)) != len(names):
            raise ValueError(f"NetLab needs distinct names, got {names!r}")
        bad = [n for n in names if not _NAME.match(n)]
        if bad or len(names) > 250:
            raise ValueError(f"NetLab names must match {_NAME.pattern} (at most 250): {bad or len(names)}")
        self.tag = tag or secrets.token_hex(3)
        if not _TAG.match(self.tag):
            raise ValueError(f"NetLab tag must match {_TAG.pattern} (interface names <= 15 chars): {self.tag!r}")
        if subnet_octet is not None and not 1 <= subnet_octet <= 254:
            raise ValueError(f"subnet_octet must be in 1..254, got {subnet_octet}")
        self.names = names
        self.bridge = f"db-{self.tag}"
        self._octet_req = subnet_octet
        self.octet = 0
        self.bridge_ip = ""
        self.hosts: dict[str, Host] = {}
        self._fw_rule: list[str] | None = None
        self._bridge_made = False
        self._pidfile = STATE_DIR / f"{self.tag}.pid"

    # -- lifecycle --------------------------------------------------------------------------------
    def __enter__(self) -> NetLab:
        try:
            self._build()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _build(self) -> None:
        with _state_lock():
            if self._pidfile.exists():
                raise NetLabError(f"a lab with tag {self.tag!r} exists ({self._pidfile}); pick another tag")
            used = _used_10_octets()
            if self._octet_req is not None:
                if self._octet_req in used:
                    raise NetLabError(f"10.{self._octet_req}.0.0/24 overlaps an existing address or route")
                self.octet = self._octet_req
            else:
                free = [k for k in range(200, 255) if k not in used] + [k for k in range(1, 200) if k not in used]
                if not free:
                    raise NetLabError("no free 10.k.0.0/24 subnet for the lab bridge")
                self.octet = free[0]
            self._pidfile.write_text(f"{os.getpid()}\n")
            self.bridge_ip = f"10.{self.octet}.0.1"
            _ip("link", "add", self.bridge, "type", "bridge")  # the address reserves the subnet
            self._bridge_made = True
            _ip("addr", "add", f"{self.bridge_ip}/24", "dev", self.bridge)
        _ip("link", "set", self.bridge, "up")
        rule = _bridge_filter_rule(self.bridge)
        if rule is not None:
            r = subprocess.run(["iptables", "-I", *rule], capture_output=True, text=True)
            if r.returncode != 0:
                raise NetLabError(f"`iptables -I {' '.join(rule)}` failed (rc {r.returncode}): {r.stderr.strip()}")
            self._fw_rule = rule
        for i, name in enumerate(self.names):
            h = Host(name, f"dora-{self.tag}-{name}", f"10.{self.octet}.0.{i + 2}", f"dv-{self.tag}-{i}")
            self.hosts[name] = h
            _ip("netns", "add", h.netns)
            _ip("link", "add", h.veth, "type", "veth", "peer", "name", self.device, "netns", h.netns)
            _ip("link", "set", h.veth, "master", self.bridge)
            _ip("link", "set", h.veth, "up")
            ns = ["-n", h.netns]
            _ip(*ns, "link", "set", "lo", "up")
            _ip(*ns, "addr", "add", f"{h.ip}/24", "dev", self.device)
            _ip(*ns, "link", "set", self.device, "up")
            _ip(*ns, "route", "add", "default", "via", self.bridge_ip)

    def close(self) -> None:
        """Tear everything down (idempotent); every step is tried, then one error lists what failed."""
        errors: list[str] = []
        mine = {h.netns for h in self.hosts.values()}
        for h in self.hosts.values():
            try:
                _kill_netns(h.netns)
                _ip("link", "del", h.veth, check=False)  # normally gone with the namespace
            except Exception as e:
                errors.append(f"{h.netns}: {e}")
        self.hosts = {}
        if self._fw_rule is not None:
            r = subprocess.run(["iptables", "-D", *self._fw_rule], capture_output=True, text=True)
            if r.returncode != 0:
                errors.append(f"iptables -D {' '.join(self._fw_rule)}: {r.stderr.strip()}")
            self._fw_rule = None
        if self._bridge_made:
            _ip("link", "del", self.bridge, check=False)
            self._bridge_made = False
        left = [ns for ns in _namespaces() if ns in mine] if mine else []
        if left:
            errors.append(f"namespaces left: {left}")
        with contextlib.suppress(OSError):
            if self._pidfile.exists() and self._pidfile.read_text().split()[0] == str(os.getpid()):
                self._pidfile.unlink()
        if errors:
            raise NetLabError("NetLab teardown: " + "; ".join(errors))

    # -- API --------------------------------------------------------------------------------------
    def _host(self, name: str) -> Host:
        try:
            return self.hosts[name]
        except KeyError:
            raise KeyError(f"{name!r} is not in this lab (names: {list(self.hosts)})") from None

    def ip(self, name: str) -> str:
        """The address of ``name`` on the lab bridge (its ``eth0``)."""
        return self._host(name).ip

    def netns(self, name: str) -> str:
        """The network namespace of ``name``."""
        return self._host(name).netns

    def prefix(self, name: str) -> list[str]:
        """argv prefix that runs a command inside ``name``'s namespace."""
        return ["ip", "netns", "exec", self._host(name).netns]

    def popen(self, name: str, argv: Sequence[str], **popen_kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside ``name``'s namespace (``ip netns exec`` execs it: same PID)."""
        return subprocess.Popen([*self.prefix(name), *argv], **popen_kwargs)

    def lose(self, name: str) -> None:
        """``name`` vanishes like a lost host: every process in its namespace SIGKILLed, the namespace deleted
        (its address answers nothing from then on)."""
        host = self._host(name)
        _kill_netns(host.netns)
        _ip("link", "del", host.veth, check=False)
        del self.hosts[name]

    def cut(self, name: str) -> None:
        """Partition ``name``: its link to the bridge goes down; its processes live on, reaching no one."""
        _ip("link", "set", self._host(name).veth, "down")

    def heal(self, name: str) -> None:
        """End the partition of ``name`` (:meth:`cut`)."""
        _ip("link", "set", self._host(name).veth, "up")

    def run(self, name: str, argv: Sequence[str], **kw: Any) -> subprocess.CompletedProcess[Any]:
        """Run ``argv`` to completion inside ``name``'s namespace (``subprocess.run`` keywords)."""
        return subprocess.run([*self.prefix(name), *argv], **kw)


__all__ = ["Host", "NetLab", "NetLabError", "cleanup_stale", "netns_available"]
