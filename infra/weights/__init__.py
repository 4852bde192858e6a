"""Out-of-band policy weight channel: packed buckets with checksums, served by holders over UCX, TCP
or files on a shared file system.

Kafka carries only the announcement (``WeightManifest.announce()``, a ``PolicyVersion`` whose
``TensorEntry`` / ``BucketEntry`` records are the manifest's own); bytes move through
:func:`make_weight_server` / :func:`make_weight_client` (``kind`` = ``"ucx"``, ``"tcp"`` or ``"file"``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .channel import FetchStats, WeightClient, WeightServer, make_weight_client, make_weight_server
    from .manifest import BucketEntry, TensorEntry, WeightManifest, pack_state_dict, unpack_into
    from .protocol import (
        HolderFailed,
        HolderRefused,
        TransportUnavailableError,
        WeightChannelError,
        WeightFetchError,
    )
    from .store import FaultInjection

# Imported on first use (PEP 562): the channel and the manifest need torch, and a process that only names
# an error type (an emulated rollout instance) starts without it.
_HOME = {
    "FetchStats": "channel", "WeightClient": "channel", "WeightServer": "channel",
    "make_weight_client": "channel", "make_weight_server": "channel",
    "BucketEntry": "manifest", "TensorEntry": "manifest", "WeightManifest": "manifest",
    "pack_state_dict": "manifest", "unpack_into": "manifest",
    "HolderFailed": "protocol", "HolderRefused": "protocol", "TransportUnavailableError": "protocol",
    "WeightChannelError": "protocol", "WeightFetchError": "protocol",
    "FaultInjection": "store",
}


def __getattr__(name: str) -> Any:
    if name in _HOME:
        return getattr(importlib.import_module(f".{_HOME[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "BucketEntry",
    "FaultInjection",
    "FetchStats",
    "HolderFailed",
    "HolderRefused",
    "TensorEntry",
    "TransportUnavailableError",
    "WeightChannelError",
    "WeightClient",
    "WeightFetchError",
    "WeightManifest",
    "WeightServer",
    "make_weight_client",
    "make_weight_server",
    "pack_state_dict",
    "unpack_into",
]
