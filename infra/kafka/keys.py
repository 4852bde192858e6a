"""Record keys and partitioning.

Every key carries the policy version first, so tools can filter, compact and replay by version
without decoding values: ``v<version:010d>/<suffix>`` (``v-/<suffix>`` when no version exists yet,
e.g. a prompt before dispatch). The zero padding makes keys sort by version as strings.

The partition is chosen from the *suffix only* (usually the GRPO group id), never from the
version: ``partition = murmur2(suffix) & 0x7fffffff % n`` — the same function Kafka's Java
default partitioner applies to a key, so Java tools and this code agree. Consequence: all
trajectories of a group land on one partition even when they come from different versions.
"""

from __future__ import annotations

NO_VERSION = "v-"


def make_key(version: int | None, suffix: str) -> str:
    """``v0000000003/g-12`` for version 3; ``v-/g-12`` when ``version`` is None."""
    if "/" in suffix and suffix.startswith("v"):
        raise ValueError(f"key suffix {suffix!r} looks like a full key")
    if version is None:
        return f"{NO_VERSION}/{suffix}"
    if version < 0:
        raise ValueError(f"policy version must be >= 0, got {version}")
    return f"v{version:010d}/{suffix}"


def parse_key(key: bytes | str) -> tuple[int | None, str]:
    """Inverse of :func:`make_key`: (version or None, suffix). ValueError on a malformed key."""
    text = key.decode() if isinstance(key, bytes | bytearray) else key
    head, sep, suffix = text.partition("/")
    if not sep or not head.startswith("v"):
        raise ValueError(f"malformed key {text!r}: expected 'v<version>/<suffix>'")
    if head == NO_VERSION:
        return None, suffix
    try:
        return int(head[1:]), suffix
    except ValueError:
        raise ValueError(f"malformed key {text!r}: version {head[1:]!r} is not an integer") from None


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 (as in ``org.apache.kafka.common.utils.Utils.murmur2``), signed 32-bit."""
    length = len(data)
    seed = 0x9747B28C
    m = 0x5BD1E995
    r = 24
    h = (seed ^ length) & 0xFFFFFFFF
    length4 = length // 4
    for i in range(length4):
        i4 = i * 4
        k = (data[i4] & 0xFF) + ((data[i4 + 1] & 0xFF) << 8) + ((data[i4 + 2] & 0xFF) << 16) + (
            (data[i4 + 3] & 0xFF) << 24)
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = (h * m) & 0xFFFFFFFF
        h ^= k
    extra = length % 4
    index = length & ~3
    if extra == 3:
        h ^= (data[index + 2] & 0xFF) << 16
    if extra >= 2:
        h ^= (data[index + 1] & 0xFF) << 8
    if extra >= 1:
        h ^= data[index] & 0xFF
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for(suffix: str, num_partitions: int) -> int:
    """Partition of a key suffix (group id): ``(murmur2(suffix) & 0x7fffffff) % n``."""
    if num_partitions < 1:
        raise ValueError("num_partitions must be >= 1")
    return (murmur2(suffix.encode()) & 0x7FFFFFFF) % num_partitions
