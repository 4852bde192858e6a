"""UCX weight transport (``ucxx``): control on a small TCP socket, bulk segments as UCX tag messages.

Design (measured on the 2-core loopback box; figures in bench/weights.py's output):

- *Control*: the same framed JSON socket as the ``tcp`` transport (``tcp.py``). The holder checks the
  token there before any UCX endpoint exists, so a wrong token never gets a UCX byte, and the
  listener stays on the configured host (ucxx's own listener binds every interface).
- *Bulk*: the fetch request carries the fetcher's UCX worker addresses (one per profile: the lane
  this connection receives on) and a random 40-bit tag base;
  the holder creates an endpoint to one of them and sends segment ``i`` as one tag message with tag
  ``base << 24 | i`` straight from the bucket buffer; the fetcher posts ``tag_recv`` straight into the
  destination (the target tensor's memory for direct segments). The holder keeps ``window`` sends in
  flight; the fetcher posts every receive up front (so no offer is ever unmatched), and only after it
  accepted the reply (``go``). Tags are unique per fetch, so concurrent fetches never mix.
- *Two profiles*, each its own context + worker: ``net`` (``tls`` = tcp, rendezvous ``put_zcopy``)
  for peers on other hosts, and ``local`` (``same_host_tls`` = tcp,cma, rendezvous ``get_zcopy``)
  when both ends report the same host id (boot id + PID and network namespaces): cross-memory attach, one copy
  made by the *fetcher*, so a holder feeding several fetchers is not the bottleneck.
- *Progress*: each worker runs ucxx's C++ progress thread in blocking mode (epoll: no GIL, no core
  burnt when idle) with *delayed submission* (callers only enqueue, the progress thread posts, so they
  never contend for the worker lock: about -25% CPU per GB measured). A holder spreads its ``net``
  sessions over ``holder_workers`` workers (lanes), so concurrent fetchers do not queue behind one
  progress thread doing every socket send; a fetcher likewise spreads its connections (the parallel
  streams of a fetch) over ``fetcher_workers`` lanes of each profile, round robin, each connection
  receiving only on its lane's worker (two streams: two progress threads receiving, or making cma
  copies, at once). Callers use a sync API and wait
  by polling request completion with an exponential back-off (10 us .. 1 ms), watching the control
  socket so a dead peer is noticed at once, plus an I/O timeout (no segment done for ``io_timeout`` s).
- *Why these settings*: UCX's cost model sees ``lo`` at ~12 MB/s (no link speed), so for messages
  > 16 KB it picks "rendezvous fragmented copy-in copy-out" through 8 KB bounce fragments (0.5-1.3
  GB/s); ``put_zcopy`` forces the zero-copy rendezvous where the TCP transport writes straight into
  the receiver's buffer (about the plain-socket limit). Endpoints created from a worker address with
  UCX's peer-failure error handling get *no* rendezvous lanes (multi-frag eager copy-in copy-out,
  ~1 GB/s), hence ``error_handling=False``: peer death is seen on the control socket instead.
"""

from __future__ import annotations

import base64
import itertools
import logging
import secrets
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .protocol import BulkConn, HolderFailed
from .store import VersionStore
from .tcp import TcpConn, TcpListener, tcp_connect
from .ucx_config import UcxOptions, host_id, import_ucxx
from .ucx_engine import UcxEngine, b64, close_endpoint, leak, wait_request

log = logging.getLogger(__name__)

_TAG_SHIFT = 24
MAX_CACHED_ENDPOINTS = 64
ABORT_SETTLE_S = 0.5
_MAX_SEGMENTS = 1 << _TAG_SHIFT


class UcxConn:
    """One fetch connection: control on ``ctrl`` (TCP), bulk as UCX tag messages."""

    def __init__(self, ctrl: TcpConn, transport: UcxTransport) -> None:
        self.ctrl = ctrl
        self.peer = ctrl.peer
        self.transport = transport
        self.io_timeout = transport.io_timeout
        self.profile = "net"
        self._ep: Any = None
        self._engine: UcxEngine | None = None
        self._lanes: dict[str, int] = {}  # fetcher side: profile -> the lane (worker) receiving here
        self._tag_base = 0
        self._pending_msg: dict[str, Any] | None = None

    def route(self) -> str:
        """``ucx/<profile> TLS=.. NET_DEVICES=.. RNDV_SCHEME=..``: the UCX configuration the bytes moved
        under (the profile is the holder's choice: ``net`` unless both ends share a host id)."""
        cfg = self.transport.options.config(self.profile)
        return f"ucx/{self.profile} " + " ".join(f"{k}={cfg[k]}" for k in ("TLS", "NET_DEVICES", "RNDV_SCHEME"))

    def send_msg(self, msg: Mapping[str, Any]) -> None:
        self.ctrl.send_msg(msg)

    def recv_msg(self) -> dict[str, Any]:
        if self._pending_msg is not None:
            msg, self._pending_msg = self._pending_msg, None
        else:
            msg = self.ctrl.recv_msg()
        if msg.get("ucx_profile") in self.transport.options.profiles:
            self.profile = str(msg["ucx_profile"])  # the holder's choice, in its fetch reply
        return msg

    # fetcher side ------------------------------------------------------------------------------
    def request_extras(self) -> dict[str, Any]:
        """The address of this connection's lane of each profile (the holder picks the profile), and
        every fetcher lane's address (``ucx_lanes``: what a holder forgets on ``bye``)."""
        self._tag_base = secrets.randbits(40) << _TAG_SHIFT
        engines = self.transport.fetcher_engines()
        self._lanes = self.transport.next_fetcher_lanes()
        return {
            "ucx_addresses": {p: b64(engines[(p, lane)].address) for p, lane in self._lanes.items()},
            "ucx_lanes": [b64(e.address) for e in engines.values()],
            "ucx_host": self.transport.host,
            "ucx_tag": self._tag_base,
        }

    def _ctrl_event_fetcher(self) -> None:
        """Control socket readable mid-transfer: EOF (holder died), or an early trailer / error."""
        if self._pending_msg is not None:
            return
        msg = self.ctrl.recv_msg()  # HolderFailed on EOF
        if not msg.get("done"):
            raise HolderFailed(f"holder aborted the transfer: {msg.get('error', msg)}")
        self._pending_msg = msg

    def recv_segments(self, dests: Sequence[np.ndarray], on_done: Callable[[int], None]) -> None:
        if len(dests) >= _MAX_SEGMENTS:
            raise ValueError("too many segments for one fetch")
        engine = self.transport.engine(self.profile, self._lanes.get(self.profile, 0))
        api, worker, arr = engine.api, engine.worker, engine.Array
        # every receive is posted up front, so each rendezvous offer of the holder (which keeps
        # ``window`` sends in flight) is expected: an aborted fetch leaves no unmatched message
        pending: deque[tuple[int, Any]] = deque(
            (i, worker.tag_recv(arr(d), engine.tag(self._tag_base | i), api.UCXXTagMaskFull))
            for i, d in enumerate(dests)
        )
        try:
            while pending:
                i, req = pending[0]
                wait_request(req, time.monotonic() + self.io_timeout, self.ctrl, self._ctrl_event_fetcher)
                pending.popleft()
                on_done(i)
        finally:
            if pending:  # aborted: stop the holder, let matched rendezvous finish (bounded), then
                self.ctrl.close()  # dropping the unmatched receives cancels them
                self.transport.park([(req, dests[i]) for i, req in pending], settle=ABORT_SETTLE_S)

    # holder side -------------------------------------------------------------------------------
    def accept_extras(self, request: Mapping[str, Any]) -> dict[str, Any]:
        try:
            addrs = dict(request["ucx_addresses"])
            self._tag_base = int(request["ucx_tag"])
            same_host = request.get("ucx_host") == self.transport.host
            self.profile = (
                "local" if same_host and "local" in addrs and "local" in self.transport.profiles else "net"
            )
            address = base64.b64decode(str(addrs[self.profile]))
        except (KeyError, ValueError, TypeError) as e:
            raise HolderFailed(f"fetch request lacks the UCX fields: {e!r}") from None
        lane = self.transport.next_lane(self.profile)
        self._engine = self.transport.engine(self.profile, lane)
        self._ep = self.transport.endpoint(self.profile, lane, address)
        return {"ucx_profile": self.profile}

    def forget(self, request: Mapping[str, Any]) -> None:
        try:
            named = [*dict(request["ucx_addresses"]).values(), *list(request.get("ucx_lanes", []))]
            addrs = [base64.b64decode(str(a)) for a in named]
        except (KeyError, ValueError, TypeError):
            return
        self.transport.forget(addrs)

    def _ctrl_event_holder(self) -> None:
        raise HolderFailed(f"fetcher {self.peer} went away mid-transfer")

    def send_segments(self, bufs: Sequence[Any]) -> int:
        if self._ep is None or self._engine is None:
            raise HolderFailed("no UCX endpoint (accept_extras was not called)")
        engine = self._engine
        window = max(1, engine.options.window)
        pending: deque[tuple[Any, Any]] = deque()
        sent = 0
        try:
            for i, b in enumerate(bufs):
                a = engine.Array(b)
                pending.append((a, self._ep.tag_send(a, engine.tag(self._tag_base | i))))
                while len(pending) >= window or (i + 1 == len(bufs) and pending):
                    a0, req = pending[0]
                    wait_request(req, time.monotonic() + self.io_timeout, self.ctrl, self._ctrl_event_holder)
                    pending.popleft()
                    sent += a0.nbytes
        finally:
            if pending:  # aborted: UCX may still read these buffers; keep them alive until done
                self.transport.park([(req, a) for a, req in pending], settle=0.0)
        return sent

    def abort(self) -> None:
        self.close()

    def close(self) -> None:
        self._ep = None  # endpoints are cached by the transport (wire-up costs ms per fetch)
        self.ctrl.close()


class UcxTransport:
    """The ``ucx`` kind. Engines (one per profile and lane) are made lazily and shared by all
    connections: a holder's ``lanes(profile)``, a fetcher's ``fetcher_lanes(profile)``."""

    kind = "ucx"
    stateful_holders = True  # holders cache an endpoint per fetcher: fetchers say ``bye`` on close

    def __init__(
        self,
        connect_timeout: float = 5.0,
        io_timeout: float = 30.0,
        options: UcxOptions | None = None,
    ) -> None:
        import_ucxx()  # fail at construction, with the remedy, when ucxx is missing
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout
        self.options = options or UcxOptions()
        self.profiles = self.options.profiles
        self.host = host_id()
        self._engines: dict[tuple[str, int], UcxEngine] = {}
        self._eps: OrderedDict[tuple[str, int, bytes], Any] = OrderedDict()
        self._sessions = itertools.count()
        self._fetcher_conns = itertools.count()
        self._parked: list[tuple[Any, Any]] = []  # (request, buffer) of aborted transfers
        self._lock = threading.Lock()

    def engine(self, profile: str, lane: int = 0) -> UcxEngine:
        """The worker of lane ``lane`` of ``profile`` (made on first use)."""
        with self._lock:
            if (profile, lane) not in self._engines:
                self._engines[(profile, lane)] = UcxEngine(self.options, profile)
            return self._engines[(profile, lane)]

    def lanes(self, profile: str) -> int:
        """Holder workers of ``profile``: ``holder_workers`` for ``net`` (the holder's progress thread
        does the socket sends), 1 for ``local`` (there the fetchers do the copying)."""
        return max(1, self.options.holder_workers) if profile == "net" else 1

    def next_lane(self, profile: str) -> int:
        """Holder side: the lane (worker) of a new session, round robin."""
        return next(self._sessions) % self.lanes(profile)

    def fetcher_lanes(self, profile: str) -> int:
        """Fetcher workers of ``profile``: ``fetcher_workers`` for both (``net``: their progress
        threads do the socket receives; ``local``: they make the cma copies)."""
        return max(1, self.options.fetcher_workers)

    def next_fetcher_lanes(self) -> dict[str, int]:
        """Fetcher side: the lane of each profile a new connection receives on, round robin."""
        n = next(self._fetcher_conns)
        return {p: n % self.fetcher_lanes(p) for p in self.profiles}

    def fetcher_engines(self) -> dict[tuple[str, int], UcxEngine]:
        """Fetcher side: every lane of every profile, all made on the first request, so the worker
        addresses a holder may cache are fixed from then on (and ``bye`` names them all)."""
        return {(p, i): self.engine(p, i) for p in self.profiles for i in range(self.fetcher_lanes(p))}

    def endpoint(self, profile: str, lane: int, address: bytes) -> Any:
        """Holder side: the (cached, LRU of ``MAX_CACHED_ENDPOINTS``) endpoint to a fetcher's worker."""
        engine = self.engine(profile, lane)
        evicted: list[Any] = []
        with self._lock:
            key = (profile, lane, address)
            ep = self._eps.get(key)
            if ep is None:
                ep = self._eps[key] = engine.endpoint(address)
                while len(self._eps) > MAX_CACHED_ENDPOINTS:
                    evicted.append(self._eps.popitem(last=False)[1])
            self._eps.move_to_end(key)
        for old in evicted:
            close_endpoint(old)
        return ep

    def forget(self, addresses: list[bytes]) -> None:
        """Holder side: close the cached endpoints to these fetcher workers (they said ``bye``)."""
        with self._lock:
            gone = [k for k in self._eps if k[2] in addresses]
            eps = [self._eps.pop(k) for k in gone]
        for ep in eps:
            close_endpoint(ep)

    def park(self, items: list[tuple[Any, Any]], settle: float) -> None:
        """Keep requests of an aborted transfer (and the buffers UCX may still touch) alive; first
        wait up to ``settle`` seconds for them to finish (a live peer completes matched ones)."""
        deadline = time.monotonic() + settle
        while any(not r.completed for r, _ in items) and time.monotonic() < deadline:
            time.sleep(1e-3)
        with self._lock:
            self._parked = [(r, b) for r, b in self._parked + items if not r.completed]

    def holder_store(self, recycle: bool) -> VersionStore:
        """Versions are held in memory and streamed by the holder's sessions."""
        return VersionStore(recycle=recycle)

    def listen(self, host: str, port: int, handler: Callable[[BulkConn], None]) -> TcpListener:
        for p in self.profiles:
            for lane in range(self.lanes(p)):
                self.engine(p, lane)

        def session(ctrl: TcpConn) -> None:
            conn = UcxConn(ctrl, self)
            try:
                handler(conn)
            finally:
                conn.close()

        return TcpListener(host, port, session, self.io_timeout, name="weights-ucx")

    def connect(self, address: str) -> UcxConn:
        return UcxConn(tcp_connect(address, self.connect_timeout, self.io_timeout), self)

    def close(self) -> None:
        with self._lock:
            engines, self._engines = list(self._engines.values()), {}
            eps = list(self._eps.values())
            self._eps.clear()
            parked = [(r, b) for r, b in self._parked if not r.completed]
            self._parked = []
        for ep in eps:
            close_endpoint(ep)
        if parked:
            leak(parked)
        for e in engines:
            e.close(parked=bool(parked))


__all__ = ["UcxEngine", "UcxOptions", "UcxTransport", "host_id", "import_ucxx"]
