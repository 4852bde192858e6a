"""How buckets are cut into wire segments, and where a fetcher lands each segment.

Segmentation is a pure function of the manifest, computed identically by holder and fetcher, so no
per-segment metadata travels. Bucket ``b`` is cut into consecutive byte ranges ``[start, end)`` that
cover ``[0, nbytes)`` exactly once, in order:

- a tensor region of at least ``DIRECT_MIN`` bytes is a *direct* range: the fetcher receives it
  straight into the target tensor's memory (zero copies after the transport);
- maximal runs of smaller tensors and padding are *grouped* ranges: received into a bounce buffer and
  copied into their tensors once the bucket's checksum holds (these are small by construction);
- every range is further cut at ``MAX_SEGMENT`` bytes so a transport can keep several in flight.

The fetcher hashes the segments of a bucket in order (streaming hash == hash of the whole bucket) and
only then *commits* the bucket (copies out of bounce buffers). Direct ranges are written in place
before the check: after a failed fetch the target's contents are unspecified until a later fetch of
the same bucket succeeds.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np
import torch

from dora_rl.schemas.records import TensorEntry

from .checksum import Hasher, new_hasher
from .manifest import (
    WeightManifest,
    alloc_bytes,
    check_target,
    dtype_name,
    tensor_bytes,
    unpack_into,
    view_tensor,
)

DIRECT_MIN = 256 << 10
MAX_SEGMENT = 64 << 20


@dataclass(frozen=True)
class Segment:
    """Bytes ``[start, end)`` of bucket ``bucket``; ``direct`` when they belong to one tensor region."""

    bucket: int
    start: int
    end: int
    direct: bool

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def bucket_segments(manifest: WeightManifest, bucket: int) -> list[Segment]:
    """The wire segments of ``bucket`` (see the module docstring); they tile the bucket in order."""
    size = manifest.buckets[bucket].nbytes
    regions = sorted({(t.offset, t.nbytes) for t in manifest.tensors if t.bucket == bucket})
    ranges: list[tuple[int, int, bool]] = []
    pos = 0
    for off, n in regions:
        if n >= DIRECT_MIN:
            if off > pos:
                ranges.append((pos, off, False))
            ranges.append((off, off + n, True))
            pos = off + n
    if size > pos or not ranges:
        ranges.append((pos, size, False))
    out: list[Segment] = []
    for start, end, direct in ranges:
        for s in range(start, max(end, start + 1), MAX_SEGMENT):
            out.append(Segment(bucket, s, min(end, s + MAX_SEGMENT), direct))
    return out


def request_segments(manifest: WeightManifest, buckets: list[int]) -> list[Segment]:
    """Segments of ``buckets`` in the order a holder sends them."""
    return [s for b in buckets for s in bucket_segments(manifest, b)]


class ReceivePlan:
    """Receive destinations of one fetch.

    ``into is None``: fresh bucket buffers; the result is zero-copy views into them. Otherwise the
    result is ``into`` itself, each tensor overwritten; direct segments land in contiguous CPU target
    tensors, everything else goes through a bounce buffer and ``commit`` copies it out (also to a
    second target tensor of a tied pair when the target does not tie them).
    """

    def __init__(self, manifest: WeightManifest, into: dict[str, torch.Tensor] | None, strict: bool = True):
        self.manifest = manifest
        self.into = into
        self.buckets: list[np.ndarray] | None = None
        self._dest: dict[tuple[int, int], np.ndarray] = {}
        self._bounce: dict[int, list[tuple[Segment, np.ndarray]]] = {}
        # bucket -> sorted [(offset, nbytes, [names sharing these bytes])]
        self._regions: dict[int, list[tuple[int, int, list[str]]]] = {}
        grouped: dict[tuple[int, int, int], list[str]] = {}
        for t in manifest.tensors:
            grouped.setdefault((t.bucket, t.offset, t.nbytes), []).append(t.name)
        for (b, off, n), names in sorted(grouped.items()):
            self._regions.setdefault(b, []).append((off, n, names))
        if into is None:
            self.buckets = [alloc_bytes(b.nbytes) for b in manifest.buckets]
            for b in range(len(manifest.buckets)):
                for s in bucket_segments(manifest, b):
                    self._dest[(b, s.start)] = self.buckets[b][s.start : s.end]
            return
        check_target(manifest, into, strict=strict)
        for b in range(len(manifest.buckets)):
            regions = self._regions.get(b, [])
            offsets = [r[0] for r in regions]
            for s in bucket_segments(manifest, b):
                dest = None
                if s.direct:
                    off, _n, names = regions[bisect.bisect_right(offsets, s.start) - 1]
                    tgt = into[names[0]]
                    if tgt.device.type == "cpu" and tgt.is_contiguous():
                        dest = tensor_bytes(tgt)[s.start - off : s.end - off]
                if dest is None:
                    dest = alloc_bytes(s.nbytes)
                    self._bounce.setdefault(b, []).append((s, dest))
                self._dest[(b, s.start)] = dest

    def dest(self, seg: Segment) -> np.ndarray:
        """Writable uint8 array of exactly ``seg.nbytes`` bytes where ``seg`` must be received."""
        return self._dest[(seg.bucket, seg.start)]

    def hasher(self) -> Hasher:
        """A fresh streaming hasher of the manifest's algorithm."""
        return new_hasher(self.manifest.checksum_algo)

    def commit(self, bucket: int) -> None:
        """Copy a verified bucket's bounce bytes into the target tensors (no-op without ``into``)."""
        if self.into is None:
            return
        pieces = self._bounce.get(bucket, [])
        with torch.no_grad():
            for off, n, names in self._regions.get(bucket, []):
                first = self.into[names[0]]
                covering = [(s, a) for s, a in pieces if s.start < off + n and s.end > off]
                if covering:
                    region = np.empty(n, dtype=np.uint8)
                    for s, a in covering:
                        lo, hi = max(off, s.start), min(off + n, s.end)
                        region[lo - off : hi - off] = a[lo - s.start : hi - s.start]
                    entry = TensorEntry(names[0], dtype_name(first.dtype), tuple(first.shape), 0, 0, n)
                    first.copy_(view_tensor(region, entry))
                for other in names[1:]:
                    t = self.into[other]
                    if t.data_ptr() != first.data_ptr() or t.stride() != first.stride():
                        t.copy_(first)

    def result(self) -> dict[str, torch.Tensor]:
        """The fetched state dict (call after every bucket was committed)."""
        if self.into is not None:
            return self.into
        assert self.buckets is not None
        return unpack_into(self.manifest, self.buckets, None, verify=False)
