"""Fetcher side of the weight channel: pull a version from the least-loaded holders, over parallel streams.

See ``channel.py`` for the algorithm and its invariants; this module implements it, ``streams.py`` runs
each connection. A fetch cuts the buckets into ``streams`` byte-balanced groups (fewer when there are
fewer buckets) and fetches them at once, one connection each (one connection keeps one core busy
over veth / loopback, where the kernel's receive path runs on the sender's core). Smaller groups
taken in rounds, to even out the streams' ends, were measured no faster (bench/weights_netns.py
machinery, 500 MB and 2 GB), so a group is a stream's whole share.

- the first streams go to the least-loaded holders (with ``probe_load``: every holder tied at the
  lowest ``active_transfers``, round robin; without it: the caller's first holder);
- a stream that fails (unreachable, refused, died, truncated, or any bucket failing its checksum)
  drops its holder from this fetch: the buckets it did not deliver intact are cut into groups again
  and queued, and every group started afterwards goes to the first holder (least loaded first) not
  dropped, while at most ``streams`` run. So a bucket is never asked again of a holder that failed
  it, and the fetch ends once every bucket was verified or every holder dropped;
- concurrency: streams share no mutable state (each returns a ``StreamResult``); only the caller's
  thread merges them (``done``, notes, routes, CPU, contacted holders), and a bucket belongs to at
  most one running stream, so no two streams write the same destination;
- ``FetchStats``: ``holders`` = holders that delivered a verified bucket, in the order they were first
  given a stream; ``refetched_buckets`` = buckets verified after an earlier stream that had started
  sending them failed them; ``bytes_received`` = bytes of the streams that completed.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .manifest import WeightManifest
from .plan import ReceivePlan
from .protocol import (
    PROTO,
    HolderRefused,
    Transport,
    WeightChannelError,
    WeightFetchError,
    credentials,
)
from .streams import StreamResult, run_stream, split_buckets

log = logging.getLogger(__name__)

DEFAULT_STREAMS = 2
"""Connections per fetch (measured: bench/weights_netns.py; one connection keeps one core busy)."""


@dataclass(frozen=True)
class FetchStats:
    """Figures of one fetch. ``gbps = payload_bytes / seconds / 1e9`` (effective, refetches included)."""

    version: int
    kind: str
    payload_bytes: int
    bytes_received: int
    seconds: float
    holders: tuple[str, ...]
    refused: tuple[str, ...]
    refetched_buckets: int
    verify_cpu_seconds: float = 0.0
    routes: tuple[str, ...] = ()
    """How the bytes moved from each holder used (``BulkConn.route``), in the order of ``holders``."""

    @property
    def gbps(self) -> float:
        return self.payload_bytes / max(self.seconds, 1e-12) / 1e9


def check_token(token: str) -> str:
    if not isinstance(token, str) or not token:
        raise ValueError("the weight channel needs the run's shared token (a non-empty string)")
    return token


class WeightClient:
    """A fetcher: pulls versions from holders over up to ``streams`` connections per fetch (see the
    module docstring for the algorithm). One fetch at a time per client."""

    def __init__(self, transport: Transport, token: str, streams: int = DEFAULT_STREAMS) -> None:
        if isinstance(streams, bool) or not isinstance(streams, int) or streams < 1:
            raise ValueError(f"streams must be an int >= 1, got {streams!r}")
        self.kind = transport.kind
        self.streams = streams
        self._transport = transport
        self._token = check_token(token)
        self.last_stats: FetchStats | None = None
        self._contacted: set[str] = set()

    def status(self, holder: str) -> dict[str, Any]:
        """A holder's ``{"active_transfers": int, "versions": [int]}``."""
        conn = self._transport.connect(holder)
        try:
            conn.send_msg({"proto": PROTO, **credentials(self._token), "op": "status"})
            reply = conn.recv_msg()
        finally:
            conn.close()
        if not reply.get("ok"):
            raise HolderRefused(f"refused: {reply.get('error')}")
        return reply

    def _loads(self, holders: Sequence[str], version: int) -> tuple[list[tuple[int, str]], list[str]]:
        """``(active_transfers, holder)`` of the holders holding ``version``, least loaded first (ties:
        the caller's order); plus a note per holder skipped."""
        notes: list[str] = []
        scored: list[tuple[int, int, str]] = []
        for i, h in enumerate(dict.fromkeys(holders)):
            try:
                st = self.status(h)
            except WeightChannelError as e:
                notes.append(f"{h}: {e}")
                continue
            if version not in st.get("versions", []):
                notes.append(f"{h}: does not hold version {version} (holds {st.get('versions')})")
                continue
            scored.append((int(st.get("active_transfers", 0)), i, h))
        return [(load, h) for load, _, h in sorted(scored)], notes

    def rank(self, holders: Sequence[str], version: int) -> tuple[list[str], list[str]]:
        """Holders holding ``version``, least loaded first; plus a note per holder skipped."""
        loads, notes = self._loads(holders, version)
        return [h for _, h in loads], notes

    def fetch(
        self,
        manifest: WeightManifest,
        holders: Sequence[str],
        into: dict[str, torch.Tensor] | None = None,
        *,
        probe_load: bool = True,
        on_stats: Callable[[FetchStats], None] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Fetch ``manifest.version``; returns ``into`` (overwritten) or fresh zero-copy tensors."""
        return self._fetch(manifest, holders, ReceivePlan(manifest, into), probe_load, on_stats).result()

    def fetch_packed(
        self, manifest: WeightManifest, holders: Sequence[str], *, probe_load: bool = True
    ) -> tuple[dict[str, torch.Tensor], list[np.ndarray]]:
        """Fetch into fresh buckets; returns the state dict (views) and the buckets (to ``serve_packed``)."""
        plan = self._fetch(manifest, holders, ReceivePlan(manifest, None), probe_load, None)
        assert plan.buckets is not None
        return plan.result(), plan.buckets

    def _fetch(
        self,
        manifest: WeightManifest,
        holders: Sequence[str],
        plan: ReceivePlan,
        probe_load: bool,
        on_stats: Callable[[FetchStats], None] | None,
    ) -> ReceivePlan:
        t0 = time.perf_counter()
        v = manifest.version
        if probe_load:
            loads, notes = self._loads(holders, v)
            order = [h for _, h in loads]
            first = [h for load, h in loads if load == loads[0][0]]
        else:
            order, notes = list(dict.fromkeys(holders)), []
            first = order[:1]
        run = _Merge(order, notes)
        queue = deque(split_buckets(manifest, list(range(len(manifest.buckets))), self.streams))
        running: set[Future[StreamResult]] = set()
        try:
            with ThreadPoolExecutor(max_workers=self.streams, thread_name_prefix="weights-stream") as pool:

                def start(holder: str) -> None:
                    run.given(holder)
                    group = queue.popleft()
                    running.add(pool.submit(run_stream, self._transport, self._token, holder, manifest, plan, group))

                for j in range(min(self.streams, len(queue)) if first else 0):
                    start(first[j % len(first)])
                while running:
                    finished, _ = wait(running, return_when=FIRST_COMPLETED)
                    for fut in finished:
                        running.discard(fut)
                        # a non-channel error propagates here, once the other streams have ended
                        queue.extend(split_buckets(manifest, run.merge(fut.result()), self.streams))
                    while queue and len(running) < self.streams and (h := run.alive()) is not None:
                        start(h)
        finally:
            self._contacted |= run.contacted
        missing = [b for b in range(len(manifest.buckets)) if b not in run.done]
        if missing:
            raise WeightFetchError(
                f"version {v}: buckets {missing[:8]}{'...' if len(missing) > 8 else ''} could not be fetched "
                f"intact from any holder of {list(holders)}: " + "; ".join(notes or ["no holder tried"])
            )
        for n in notes:
            log.warning("weight fetch v%d: %s", v, n)
        used = run.used()
        stats = FetchStats(
            version=v,
            kind=self.kind,
            payload_bytes=manifest.total_bytes,
            bytes_received=run.received,
            seconds=time.perf_counter() - t0,
            holders=tuple(used),
            refused=tuple(notes),
            refetched_buckets=run.refetched,
            verify_cpu_seconds=run.cpu,
            routes=tuple(run.routes.get(h, "") for h in used),
        )
        self.last_stats = stats
        if on_stats is not None:
            on_stats(stats)
        return plan

    def close(self) -> None:
        """Say goodbye to every holder fetched from (best effort: lets a UCX holder close its cached
        endpoint to us while we still answer), then release the transport."""
        if getattr(self._transport, "stateful_holders", False):
            for h in sorted(self._contacted):
                try:
                    conn = self._transport.connect(h)
                    try:
                        conn.send_msg(
                            {"proto": PROTO, **credentials(self._token), "op": "bye", **conn.request_extras()}
                        )
                        conn.recv_msg()
                    finally:
                        conn.close()
                except WeightChannelError as e:
                    log.debug("goodbye to %s failed: %s", h, e)
        self._contacted.clear()
        self._transport.close()

    def __enter__(self) -> WeightClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Merge:
    """The state of one fetch, touched only by its coordinating thread: merges each finished stream
    and says where the buckets it did not deliver go next (the first holder of ``order`` not dropped)."""

    def __init__(self, order: list[str], notes: list[str]) -> None:
        self.order, self.notes = order, notes
        self.done: set[int] = set()
        self.attempted: set[int] = set()  # buckets a started stream failed to deliver intact
        self.dropped: set[str] = set()
        self.dispatched: list[str] = []  # holders in the order they were first given a stream
        self.delivered: set[str] = set()
        self.routes: dict[str, str] = {}
        self.contacted: set[str] = set()
        self.received = self.refetched = 0
        self.cpu = 0.0

    def given(self, holder: str) -> None:
        if holder not in self.dispatched:
            self.dispatched.append(holder)

    def merge(self, r: StreamResult) -> list[int]:
        """Account for ``r``; returns its leftover buckets (to fetch elsewhere). A stream that leaves
        buckets behind drops its holder from this fetch."""
        if r.contacted:
            self.contacted.add(r.holder)
        self.cpu += r.verify_cpu_seconds
        self.received += r.bytes_received
        self.refetched += sum(b in self.attempted for b in r.verified)
        self.done.update(r.verified)
        if r.verified:
            self.delivered.add(r.holder)
            self.routes.setdefault(r.holder, r.route)
        if r.error is not None:
            self.notes.append(f"{r.holder}: {r.error}")
        if r.bad:
            self.notes.append(f"{r.holder}: buckets {r.bad} failed their checksum (refused, fetching them elsewhere)")
        left = r.leftover
        if not left:
            return []
        if r.error is None and not r.bad:
            self.notes.append(f"{r.holder}: buckets {left} did not arrive")
        if r.started:
            self.attempted.update(left)
        self.dropped.add(r.holder)
        return left

    def alive(self) -> str | None:
        """The first holder of ``order`` (least loaded first) not dropped; None: every holder failed."""
        return next((h for h in self.order if h not in self.dropped), None)

    def used(self) -> list[str]:
        """Holders that delivered at least one verified bucket, in the order they were first used."""
        return [h for h in self.dispatched if h in self.delivered]
