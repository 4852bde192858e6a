"""Streams of a fetch: how its buckets are split, and one stream = one connection to one holder.

A fetch (``fetcher.py``) runs up to ``streams`` of these at once, each over a connection of its own
(over veth / loopback the kernel's receive path runs on the sender's core, so one connection keeps
one core busy; two keep two). Invariants:

- :func:`split_buckets` partitions the buckets asked for into byte-balanced groups (each bucket in
  exactly one group, each group in ascending order, no empty group);
- a stream writes only into the destinations of its own buckets (``ReceivePlan.dest``), and the
  fetch gives a bucket to at most one running stream at a time, so streams never write the same memory;
- a stream shares no mutable state with the others: what it verified, refused, received and spent
  comes back in its :class:`StreamResult`, merged by the fetch's one coordinating thread;
- a bucket is in ``verified`` only if its bytes hashed to the *manifest's* checksum and were committed
  into the plan's destinations.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from .manifest import WeightManifest
from .plan import ReceivePlan, Segment, request_segments
from .protocol import PROTO, HolderFailed, HolderRefused, Transport, WeightChannelError, credentials


def split_buckets(manifest: WeightManifest, buckets: list[int], groups: int) -> list[list[int]]:
    """``buckets`` in ``min(groups, len(buckets))`` groups of about equal bytes (largest bucket first
    to the lightest group; ties: the lower group), each group ascending, groups ordered by first bucket."""
    k = max(1, min(groups, len(buckets)))
    out: list[list[int]] = [[] for _ in range(k)]
    load = [0] * k
    for b in sorted(buckets, key=lambda b: (-manifest.buckets[b].nbytes, b)):
        j = min(range(k), key=lambda j: (load[j], j))
        out[j].append(b)
        load[j] += manifest.buckets[b].nbytes
    return sorted((sorted(g) for g in out if g), key=lambda g: g[0])


@dataclass
class StreamResult:
    """What one stream did. ``started``: the holder accepted the request and segments were asked for
    (its buckets were attempted); ``error``: why the stream ended early (None: it completed)."""

    holder: str
    buckets: list[int]
    verified: list[int] = field(default_factory=list)
    bad: list[int] = field(default_factory=list)
    bytes_received: int = 0
    verify_cpu_seconds: float = 0.0
    contacted: bool = False
    started: bool = False
    route: str = ""
    error: WeightChannelError | None = None

    @property
    def leftover(self) -> list[int]:
        """Buckets of this stream that did not arrive intact (to be fetched elsewhere)."""
        ok = set(self.verified)
        return [b for b in self.buckets if b not in ok]


class _Verifier:
    """Hashes received segments on a thread of its own (overlapping the next receive), in order;
    commits each bucket whose checksum matches the manifest into ``verified``, the others to ``bad``."""

    def __init__(self, plan: ReceivePlan, segs: list[Segment], verified: list[int], bad: list[int]) -> None:
        self._plan, self._segs, self._verified, self._bad = plan, segs, verified, bad
        self._q: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._error: BaseException | None = None
        self.cpu_seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="weights-verify", daemon=True)
        self._thread.start()

    def push(self, i: int) -> None:
        self._q.put(i)

    def _run(self) -> None:
        m = self._plan.manifest
        h = self._plan.hasher()
        t0 = time.thread_time()
        try:
            while (i := self._q.get()) is not None:
                seg = self._segs[i]
                h.update(self._plan.dest(seg))
                last = i + 1 == len(self._segs) or self._segs[i + 1].bucket != seg.bucket
                if last:
                    if h.hexdigest() == m.buckets[seg.bucket].checksum:
                        self._plan.commit(seg.bucket)
                        self._verified.append(seg.bucket)
                    else:
                        self._bad.append(seg.bucket)
                    h = self._plan.hasher()
        except BaseException as e:  # surfaced by finish()
            self._error = e
        self.cpu_seconds = time.thread_time() - t0

    def finish(self, timeout: float = 60.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():
            raise RuntimeError(f"bucket verification did not finish within {timeout}s")
        if self._error is not None:
            raise self._error


def run_stream(
    transport: Transport, token: str, holder: str, manifest: WeightManifest, plan: ReceivePlan, buckets: list[int]
) -> StreamResult:
    """Fetch ``buckets`` from ``holder`` over one connection (request, version check, ``go``, segments
    verified on the way, trailer). Channel failures end up in ``result.error``; anything else raises
    (after the verifier stopped, so nothing writes into ``plan`` any more)."""
    r = StreamResult(holder, list(buckets))
    try:
        conn = transport.connect(holder)
    except WeightChannelError as e:
        r.error = e
        return r
    verifier: _Verifier | None = None
    try:
        req = {"proto": PROTO, **credentials(token), "op": "fetch", "version": manifest.version}
        conn.send_msg({**req, "buckets": r.buckets, **conn.request_extras()})
        r.contacted = True
        reply = conn.recv_msg()
        if not reply.get("ok"):
            raise HolderRefused(f"refused: {reply.get('error')}")
        if reply.get("version") != manifest.version:
            raise HolderRefused(
                f"answered with version {reply.get('version')!r} but version {manifest.version} "
                "was asked for; refused"
            )
        if reply.get("buckets") != r.buckets:
            raise HolderRefused("answered with other buckets than asked for; refused")
        r.route = conn.route()
        segs = request_segments(manifest, r.buckets)
        verifier = _Verifier(plan, segs, r.verified, r.bad)
        conn.send_msg({"go": True})
        r.started = True
        conn.recv_segments([plan.dest(s) for s in segs], verifier.push)
        trailer = conn.recv_msg()
        if not trailer.get("done"):
            raise HolderFailed(f"transfer failed on the holder: {trailer.get('error', trailer)}")
        r.bytes_received = sum(s.nbytes for s in segs)
    except WeightChannelError as e:
        r.error = e
    finally:
        try:
            if verifier is not None:
                verifier.finish()
                r.verify_cpu_seconds = verifier.cpu_seconds
        finally:
            conn.close()
    return r


__all__ = ["StreamResult", "run_stream", "split_buckets"]
