"""Fetcher side of the weight channel: pull a version from the least-loaded holder, bucket by bucket.

See ``channel.py`` for the algorithm and its invariants; this module implements it.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .manifest import WeightManifest
from .plan import ReceivePlan, Segment, request_segments
from .protocol import (
    PROTO,
    HolderFailed,
    HolderRefused,
    Transport,
    WeightChannelError,
    WeightFetchError,
)

log = logging.getLogger(__name__)


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


class _Verifier:
    """Hashes received segments on a thread of its own (overlapping the next receive), in order;
    commits each bucket whose checksum matches the manifest, records the others as bad."""

    def __init__(self, plan: ReceivePlan, segs: list[Segment], done: set[int], bad: list[int]) -> None:
        self._plan, self._segs, self._done, self._bad = plan, segs, done, bad
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
                        self._done.add(seg.bucket)
                    else:
                        self._bad.append(seg.bucket)
                    h = self._plan.hasher()
        except BaseException as e:  # surfaced by finish()
            self._error = e
        self.cpu_seconds = time.thread_time() - t0

    def finish(self, timeout: float = 60.0) -> None:
        self._q.put(None)
        self._thread.join(timeout)
        if self._error is not None:
            raise self._error


class WeightClient:
    """A fetcher: pulls versions from holders (see the module docstring for the algorithm)."""

    def __init__(self, transport: Transport, token: str) -> None:
        self.kind = transport.kind
        self._transport = transport
        self._token = check_token(token)
        self.last_stats: FetchStats | None = None
        self._contacted: set[str] = set()
        self._routes: dict[str, str] = {}

    def status(self, holder: str) -> dict[str, Any]:
        """A holder's ``{"active_transfers": int, "versions": [int]}``."""
        conn = self._transport.connect(holder)
        try:
            conn.send_msg({"proto": PROTO, "token": self._token, "op": "status"})
            reply = conn.recv_msg()
        finally:
            conn.close()
        if not reply.get("ok"):
            raise HolderRefused(f"refused: {reply.get('error')}")
        return reply

    def rank(self, holders: Sequence[str], version: int) -> tuple[list[str], list[str]]:
        """Holders holding ``version``, least loaded first; plus a note per holder skipped."""
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
        return [h for _, _, h in sorted(scored)], notes

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
            order, notes = self.rank(holders, v)
        else:
            order, notes = list(dict.fromkeys(holders)), []
        done: set[int] = set()
        used: list[str] = []
        received = refetched = 0
        cpu: list[float] = []
        for h in order:
            remaining = [b for b in range(len(manifest.buckets)) if b not in done]
            if not remaining:
                break
            bad: list[int] = []
            before = len(done)
            try:
                received += self._fetch_from(h, manifest, plan, remaining, done, bad, cpu)
            except WeightChannelError as e:
                notes.append(f"{h}: {e}")
            if len(done) > before:
                used.append(h)
                if len(used) > 1:
                    refetched += len(done) - before
            if bad:
                notes.append(f"{h}: buckets {bad} failed their checksum (refused, fetching them elsewhere)")
        missing = [b for b in range(len(manifest.buckets)) if b not in done]
        if missing:
            raise WeightFetchError(
                f"version {v}: buckets {missing[:8]}{'...' if len(missing) > 8 else ''} could not be fetched "
                f"intact from any holder of {list(holders)}: " + "; ".join(notes or ["no holder tried"])
            )
        for n in notes:
            log.warning("weight fetch v%d: %s", v, n)
        stats = FetchStats(
            version=v,
            kind=self.kind,
            payload_bytes=manifest.total_bytes,
            bytes_received=received,
            seconds=time.perf_counter() - t0,
            holders=tuple(used),
            refused=tuple(notes),
            refetched_buckets=refetched,
            verify_cpu_seconds=sum(cpu),
            routes=tuple(self._routes.get(h, "") for h in used),
        )
        self.last_stats = stats
        if on_stats is not None:
            on_stats(stats)
        return plan

    def _fetch_from(
        self,
        holder: str,
        manifest: WeightManifest,
        plan: ReceivePlan,
        buckets: list[int],
        done: set[int],
        bad: list[int],
        cpu: list[float],
    ) -> int:
        """Fetch ``buckets`` from ``holder``; verified ones go to ``done``, corrupt ones to ``bad``;
        appends the verifier's CPU seconds to ``cpu``. Returns the bytes received."""
        conn = self._transport.connect(holder)
        verifier: _Verifier | None = None
        try:
            req = {"proto": PROTO, "token": self._token, "op": "fetch", "version": manifest.version}
            conn.send_msg({**req, "buckets": buckets, **conn.request_extras()})
            self._contacted.add(holder)
            reply = conn.recv_msg()
            if not reply.get("ok"):
                raise HolderRefused(f"refused: {reply.get('error')}")
            if reply.get("version") != manifest.version:
                raise HolderRefused(
                    f"answered with version {reply.get('version')!r} but version {manifest.version} "
                    "was asked for; refused"
                )
            if reply.get("buckets") != buckets:
                raise HolderRefused("answered with other buckets than asked for; refused")
            self._routes[holder] = conn.route()
            segs = request_segments(manifest, buckets)
            verifier = _Verifier(plan, segs, done, bad)
            conn.send_msg({"go": True})
            conn.recv_segments([plan.dest(s) for s in segs], verifier.push)
            trailer = conn.recv_msg()
            if not trailer.get("done"):
                raise HolderFailed(f"transfer failed on the holder: {trailer.get('error', trailer)}")
            return sum(s.nbytes for s in segs)
        finally:
            if verifier is not None:
                verifier.finish()
                cpu.append(verifier.cpu_seconds)
            conn.close()

    def close(self) -> None:
        """Say goodbye to every holder fetched from (best effort: lets a UCX holder close its cached
        endpoint to us while we still answer), then release the transport."""
        if getattr(self._transport, "stateful_holders", False):
            for h in sorted(self._contacted):
                try:
                    conn = self._transport.connect(h)
                    try:
                        conn.send_msg(
                            {"proto": PROTO, "token": self._token, "op": "bye", **conn.request_extras()}
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
