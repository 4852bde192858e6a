"""Where a process listens and what address it announces: Kafka's ``listeners`` / ``advertised.listeners``.

Every endpoint a role opens (the weight holders over UCX and TCP) binds ``bind_host`` and is
announced to peers (on ``dora.policy.versions`` / ``dora.instances``) as ``advertised_host:port``.
These are facts of the *process's host*, not of the run, so they come from the environment of each
process (or the role command's ``--bind-host`` / ``--advertised-host`` flags, which set it), never from
the run's shared config:

- ``DORA_BIND_HOST``: interface address to bind; default ``127.0.0.1`` (today's single-host run);
  ``0.0.0.0`` binds every interface.
- ``DORA_ADVERTISED_HOST``: address peers connect to; default the bind host. Binding ``0.0.0.0``
  without an advertised host is an error (``0.0.0.0`` is not an address a peer can reach).
- ``DORA_UCX_NET_DEVICES``: the interface(s) UCX may use; default the interface that holds the
  advertised address (``lo`` for loopback), or ``all`` when no local interface holds it (NAT).

Invariant: an announced address is never a wildcard, and UCX is never restricted to ``lo`` when it
announces a non-loopback address (a peer on another host could not reach it).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

BIND_ENV, ADVERTISED_ENV, UCX_DEVICES_ENV = "DORA_BIND_HOST", "DORA_ADVERTISED_HOST", "DORA_UCX_NET_DEVICES"
_SIOCGIFADDR = 0x8915
_WILDCARDS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class Endpoints:
    """The addresses of this process's listening endpoints (see the module docstring)."""

    bind_host: str = "127.0.0.1"
    """Interface address the weight holders bind (``0.0.0.0``: all interfaces)."""
    advertised_host: str | None = None
    """Address announced to peers; None: ``bind_host`` (which must then not be a wildcard)."""
    ucx_net_devices: str | None = None
    """UCX ``NET_DEVICES``; None: the interface holding the advertised address (``all`` if none does)."""

    def __post_init__(self) -> None:
        if self.advertised_host is None and self.bind_host in _WILDCARDS:
            raise ValueError(f"{BIND_ENV}={self.bind_host!r} binds every interface: set {ADVERTISED_ENV} to the "
                             "address peers on other hosts reach this one at")
        if self.advertised_host is not None and self.advertised_host in _WILDCARDS:
            raise ValueError(f"{ADVERTISED_ENV}={self.advertised_host!r} is a wildcard, not a reachable address")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Endpoints:
        """The endpoints configured by ``DORA_BIND_HOST`` / ``DORA_ADVERTISED_HOST`` / ``DORA_UCX_NET_DEVICES``."""
        env = os.environ if env is None else env
        return cls(bind_host=env.get(BIND_ENV) or "127.0.0.1", advertised_host=env.get(ADVERTISED_ENV) or None,
                   ucx_net_devices=env.get(UCX_DEVICES_ENV) or None)

    @property
    def advertised(self) -> str:
        """The host announced to peers."""
        return self.advertised_host or self.bind_host

    def address(self, port: int) -> str:
        """``host:port`` as announced (IPv6 hosts in brackets)."""
        host = self.advertised
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def net_devices(self) -> str:
        """UCX ``NET_DEVICES`` for this process (see the class docstring)."""
        if self.ucx_net_devices:
            return self.ucx_net_devices
        return interface_of(self.advertised) or "all"

    def weight_transport_options(self, kind: str) -> dict[str, Any]:
        """Constructor options of weight transport ``kind`` that depend on the host (UCX's devices)."""
        if kind != "ucx":
            return {}
        from dora_rl.infra.weights.ucx_config import UcxOptions

        return {"options": UcxOptions(net_devices=self.net_devices())}


def interface_of(host: str) -> str | None:
    """Name of the local interface holding IPv4 address ``host`` (``lo`` for loopback); None if none does."""
    try:
        addr = ipaddress.ip_address(socket.gethostbyname(host))
    except (OSError, ValueError):
        return None
    if addr.is_loopback:
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode()))
            except OSError:  # an interface without an IPv4 address
                continue
            if socket.inet_ntoa(raw[20:24]) == str(addr):
                return name
    return None


__all__ = ["ADVERTISED_ENV", "BIND_ENV", "UCX_DEVICES_ENV", "Endpoints", "interface_of"]
