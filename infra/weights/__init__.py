"""Out-of-band policy weight channel: packed buckets with checksums, served by holders over UCX, TCP
or files on a shared file system.

Kafka carries only the announcement (``WeightManifest.announce()``, a ``PolicyVersion`` whose
``TensorEntry`` / ``BucketEntry`` records are the manifest's own); bytes move through
:func:`make_weight_server` / :func:`make_weight_client` (``kind`` = ``"ucx"``, ``"tcp"`` or ``"file"``).
"""

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
