"""The weight channel: holders serve packed policy versions, fetchers pull them out of band.

Kafka carries only the announcement (the manifest); the bytes move here. The transport is chosen
explicitly by config (``kind`` = ``"ucx"`` or ``"tcp"``), never silently: asking for ``ucx`` where
``ucxx`` cannot be imported raises :class:`TransportUnavailableError` telling to set ``"tcp"``.

Fetch algorithm (:meth:`WeightClient.fetch`), invariants:

1. Holders are asked for their load (``status``) and tried in increasing ``active_transfers``
   (ties: the caller's order); holders that are unreachable, refuse, or lack the version are noted
   and skipped.
2. Every request carries the run's token; a holder refuses a wrong one and sends no weight byte.
3. A holder's reply names the version it serves; any other version than the one asked for is refused.
4. Each bucket is checked against the checksum of the *manifest* (the announcement), not against what
   the holder claims; a corrupt bucket, a truncated stream or a dead holder makes the fetcher refuse
   those buckets and ask the next holder for exactly the buckets still missing.
5. The fetch succeeds only when every bucket passed its checksum, else :class:`WeightFetchError`
   lists every holder's reason. With ``into`` the result is ``into`` itself, overwritten in place.

Figures of each fetch (:class:`FetchStats`: bytes, seconds, GB/s) go to ``on_stats`` and
``WeightClient.last_stats`` so callers can publish them on ``dora.metrics``.
"""

from __future__ import annotations

from typing import Any

from .fetcher import FetchStats, WeightClient
from .holder import WeightServer
from .manifest import DEFAULT_BUCKET_BYTES
from .protocol import Transport, TransportUnavailableError, WeightFetchError
from .store import FaultInjection

KINDS = ("ucx", "tcp")


def _make_transport(kind: str, **options: Any) -> Transport:
    if kind == "tcp":
        from .tcp import TcpTransport

        return TcpTransport(**options)
    if kind == "ucx":
        from .ucx import UcxTransport  # raises TransportUnavailableError without ucxx

        return UcxTransport(**options)
    raise ValueError(f"unknown weight transport kind {kind!r}; choose one of {KINDS}")


def make_weight_server(
    kind: str,
    token: str,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    recycle: bool = False,
    faults: FaultInjection | None = None,
    **transport_options: Any,
) -> WeightServer:
    """A holder on ``host:port`` over transport ``kind`` (``"ucx"`` or ``"tcp"``; never a silent fallback)."""
    return WeightServer(
        _make_transport(kind, **transport_options),
        token,
        host,
        port,
        bucket_bytes=bucket_bytes,
        recycle=recycle,
        faults=faults,
    )


def make_weight_client(kind: str, token: str, **transport_options: Any) -> WeightClient:
    """A fetcher using transport ``kind`` (``"ucx"`` or ``"tcp"``)."""
    return WeightClient(_make_transport(kind, **transport_options), token)


__all__ = [
    "KINDS",
    "FaultInjection",
    "FetchStats",
    "TransportUnavailableError",
    "WeightClient",
    "WeightFetchError",
    "WeightServer",
    "make_weight_client",
    "make_weight_server",
]
