"""The weight channel: holders serve packed policy versions, fetchers pull them out of band.

Kafka carries only the announcement (the manifest); the bytes move here. The transport is chosen
explicitly by config (``kind`` = ``"ucx"``, ``"tcp"`` or ``"file"``), never silently: asking for ``ucx``
where ``ucxx`` cannot be imported raises :class:`TransportUnavailableError` telling to set ``"tcp"``.
``ucx`` and ``tcp`` holders keep versions in memory and stream them; a ``file`` holder publishes them
as files in ``directory`` (its address) on a shared file system, read by the fetchers (``file.py``).
Packing, checksums and the fetch algorithm below are the same for the three.

Fetch algorithm (:meth:`WeightClient.fetch`), invariants:

1. Holders are asked for their load (``status``) and tried in increasing ``active_transfers``
   (ties: the caller's order); holders that are unreachable, refuse, or lack the version are noted
   and skipped. The buckets move over up to ``streams`` connections at once (byte-balanced groups,
   spread over the holders tied at the lowest load; ``fetcher.py``).
2. Every request carries the run's token; a holder refuses a wrong one and sends no weight byte
   (``file``: no holder process checks it; the directory's permissions are the access control).
3. A holder's reply names the version it serves; any other version than the one asked for is refused.
4. Each bucket is checked against the checksum of the *manifest* (the announcement), not against what
   the holder claims; a corrupt bucket, a truncated stream or a dead holder makes the fetcher refuse
   those buckets and ask the next holder for exactly the buckets still missing (a holder that failed
   one stream gets no further stream of that fetch).
5. The fetch succeeds only when every bucket passed its checksum, else :class:`WeightFetchError`
   lists every holder's reason. With ``into`` the result is ``into`` itself, overwritten in place.

Figures of each fetch (:class:`FetchStats`: bytes, seconds, GB/s) go to ``on_stats`` and
``WeightClient.last_stats`` so callers can publish them on ``dora.metrics``.
"""

from __future__ import annotations

import os
from typing import Any

from .fetcher import DEFAULT_STREAMS, FetchStats, WeightClient
from .holder import WeightServer
from .manifest import DEFAULT_BUCKET_BYTES
from .protocol import Transport, TransportUnavailableError, WeightFetchError
from .store import FaultInjection

KINDS = ("ucx", "tcp", "file")


def _make_transport(kind: str, directory: str | os.PathLike[str] | None = None, **options: Any) -> Transport:
    if kind == "file":
        from .file import FileTransport

        return FileTransport(directory, **options)
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
    directory: str | os.PathLike[str] | None = None,
    advertised_host: str | None = None,
    checksum_algo: str | None = None,
    **transport_options: Any,
) -> WeightServer:
    """A holder over transport ``kind`` (never a silent fallback): on ``host:port`` for ``"ucx"`` and
    ``"tcp"``, announced as ``advertised_host:port`` when given; publishing into ``directory`` for
    ``"file"`` (required there, ignored by the others). ``checksum_algo``: the buckets' digest
    (``checksum.py``; default the fast one, ``"blake2b"`` authenticates them)."""
    return WeightServer(
        _make_transport(kind, directory, **transport_options),
        token,
        host,
        port,
        bucket_bytes=bucket_bytes,
        recycle=recycle,
        faults=faults,
        advertised_host=advertised_host,
        checksum_algo=checksum_algo,
    )


def make_weight_client(
    kind: str, token: str, streams: int = DEFAULT_STREAMS, **transport_options: Any
) -> WeightClient:
    """A fetcher using transport ``kind`` (``"ucx"``, ``"tcp"`` or ``"file"``), fetching over up to
    ``streams`` connections at once (``fetcher.py``)."""
    return WeightClient(_make_transport(kind, **transport_options), token, streams=streams)


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
