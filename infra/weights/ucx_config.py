"""UCX transport configuration: the options, the host identity, and the ucxx import check.

The defaults are the fastest configuration measured on the project machine; ``ucx.py``'s docstring
says why each one was chosen.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, field
from typing import Any

from .protocol import TransportUnavailableError


def import_ucxx() -> Any:
    """The ``ucxx`` low-level module, or :class:`TransportUnavailableError` with the remedy."""
    try:
        import ucxx._lib.libucxx as ucx_api
    except Exception as e:  # ImportError, or a broken native library
        raise TransportUnavailableError(
            f"weight transport 'ucx' was configured but ucxx cannot be imported ({e!r}); install the "
            "'ucx' extra (ucxx-cu12) or set the weight transport to \"tcp\""
        ) from None
    return ucx_api


def host_id() -> str:
    """``<boot id>:<PID namespace inode>:<network namespace inode>``: equal on two processes <=> same
    kernel boot, PID namespace and network namespace.

    Equal ids select the UCX ``local`` profile (shared memory / cross-memory attach). Processes in
    different network namespaces of one kernel count as different hosts here (they model separate
    machines, e.g. ``dora_rl.infra.lab.netns.NetLab``), so they always get the ``net`` profile and UCX
    never uses cma, posix, sysv, xpmem or knem between them. Unreadable ids never compare equal.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
        pidns = os.stat("/proc/self/ns/pid").st_ino
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return f"unknown-{secrets.token_hex(8)}"  # never equal: always the network profile
    return f"{boot}:{pidns}:{netns}"


@dataclass(frozen=True)
class UcxOptions:
    """UCX knobs, given to the UCX contexts (not via the environment). Defaults = fastest measured.

    ``net_devices`` names the interface UCX may use (``lo`` for loopback-only runs, the NIC across
    machines); ``same_host_tls=None`` disables the same-host profile; ``window`` = sends a holder
    keeps in flight per fetch; ``holder_workers`` = ``net`` workers (progress threads) a holder
    spreads its sessions over (1 -> 4 concurrent fetches: 1.2x of 4 serial ones with 1, 0.7x with 2);
    ``fetcher_workers`` = workers per profile a fetcher spreads its connections (a fetch's parallel
    streams) over, round robin, so two streams are received by two progress threads (``net``, across
    namespaces, 500 MB: 2.30 GB/s with 2 vs 2.06 with 1) or copied by two (``local`` cma, loopback:
    5.6 vs 4.4 GB/s);
    ``epoll_timeout_ms`` bounds how long an idle progress thread sleeps.
    """

    tls: str = "tcp"
    rndv_scheme: str = "put_zcopy"
    same_host_tls: str | None = "tcp,cma"
    same_host_rndv_scheme: str = "get_zcopy"
    net_devices: str = "lo"
    error_handling: bool = False
    window: int = 4
    holder_workers: int = 2
    fetcher_workers: int = 2
    delayed_submission: bool = True
    epoll_timeout_ms: int = 100
    extra: tuple[tuple[str, str], ...] = field(default_factory=tuple)

    def config(self, profile: str) -> dict[str, str]:
        """UCX configuration of ``profile`` (``net`` or ``local``; keys without the ``UCX_`` prefix)."""
        if profile == "local" and self.same_host_tls:
            tls, scheme = self.same_host_tls, self.same_host_rndv_scheme
        else:
            tls, scheme = self.tls, self.rndv_scheme
        return {"TLS": tls, "NET_DEVICES": self.net_devices, "RNDV_SCHEME": scheme, **dict(self.extra)}

    @property
    def profiles(self) -> tuple[str, ...]:
        return ("net", "local") if self.same_host_tls else ("net",)
