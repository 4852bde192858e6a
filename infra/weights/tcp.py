"""Plain-TCP weight transport: control messages and bulk segments on one socket per fetch.

Holder: one listening socket, an accept thread, and a thread per connection running the channel's
session handler. Bulk: ``sendall`` of each segment straight from the bucket buffer (no copy in user
space); the fetcher ``recv_into`` s each segment straight into its destination (the target tensor's
memory for direct segments). Every socket has ``TCP_NODELAY`` and an I/O timeout (no progress for
``io_timeout`` seconds -> ``HolderFailed``).

This transport is also the control channel of the UCX transport (see ``ucx.py``).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import struct
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from .protocol import (
    MAX_CONTROL,
    MAX_REQUEST,
    MAX_SESSIONS,
    REQUEST_DEADLINE_S,
    BulkConn,
    HolderFailed,
    WeightChannelError,
    parse_address,
    recv_control,
    recv_exact,
    send_control,
)
from .store import VersionStore

log = logging.getLogger(__name__)

ACCEPT_POLL_S = 0.2
"""How often the accept loop re-checks for ``close`` (bounds shutdown latency)."""


class TcpConn:
    """A connected socket speaking the channel's framing; bulk segments travel in-band."""

    def __init__(self, sock: socket.socket, peer: str, io_timeout: float, *, limit: int = MAX_CONTROL,
                 within_s: float | None = None) -> None:
        self.sock = sock
        self.peer = peer
        self.limit, self.within_s = limit, within_s  # for each message received (a holder's are bounded)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(io_timeout)

    def route(self) -> str:
        """``tcp <local> -> <peer>`` (the addresses the kernel chose: which interface carried it)."""
        try:
            host, port = self.sock.getsockname()[:2]
        except OSError:
            return f"tcp -> {self.peer}"
        return f"tcp {host}:{port} -> {self.peer}"

    def send_msg(self, msg: Mapping[str, Any]) -> None:
        send_control(self.sock, msg)

    def recv_msg(self) -> dict[str, Any]:
        return recv_control(self.sock, self.limit, self.within_s)

    def request_extras(self) -> dict[str, Any]:
        return {}

    def accept_extras(self, request: Mapping[str, Any]) -> dict[str, Any]:
        return {}

    def forget(self, request: Mapping[str, Any]) -> None:
        return None

    def send_segments(self, bufs: Sequence[Any]) -> int:
        sent = 0
        for b in bufs:
            mv = memoryview(b).cast("B")
            try:
                self.sock.sendall(mv)
            except OSError as e:
                raise HolderFailed(f"fetcher {self.peer} went away after {sent} bytes: {e}") from None
            sent += mv.nbytes
        return sent

    def recv_segments(self, dests: Sequence[np.ndarray], on_done: Callable[[int], None]) -> None:
        for i, d in enumerate(dests):
            recv_exact(self.sock, d.data.cast("B"))
            on_done(i)

    def abort(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def tcp_connect(address: str, connect_timeout: float, io_timeout: float) -> TcpConn:
    """Connect to a holder; ``HolderFailed`` when nobody answers."""
    host, port = parse_address(address)
    try:
        sock = socket.create_connection((host, port), timeout=connect_timeout)
    except OSError as e:
        raise HolderFailed(f"cannot connect to {address}: {e}") from None
    return TcpConn(sock, address, io_timeout)


class TcpListener:
    """Accept loop on ``host:port``; each connection gets a daemon thread running ``handler``.

    Bounded: at most ``max_sessions`` sessions at once (the accept loop waits for a free one), and each
    message a session receives is at most ``MAX_REQUEST`` bytes, whole within ``request_deadline_s``; so
    idle or hostile peers cost at most ``max_sessions`` threads and ``max_sessions * MAX_REQUEST`` bytes."""

    def __init__(
        self,
        host: str,
        port: int,
        handler: Callable[[TcpConn], None],
        io_timeout: float,
        name: str = "weights-tcp",
        *,
        max_sessions: int = MAX_SESSIONS,
        request_deadline_s: float = REQUEST_DEADLINE_S,
    ) -> None:
        self._slots = threading.BoundedSemaphore(max_sessions)
        self._request_deadline_s = request_deadline_s
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((host, port))
        self._sock.listen(64)
        self._sock.settimeout(ACCEPT_POLL_S)
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._handler = handler
        self._io_timeout = io_timeout
        self._stop = threading.Event()
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        self._accept = threading.Thread(target=self._loop, name=f"{name}-accept", daemon=True)
        self._name = name
        self._accept.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            if not self._slots.acquire(timeout=ACCEPT_POLL_S):
                continue
            try:
                sock, addr = self._sock.accept()
            except TimeoutError:
                self._slots.release()
                continue
            except OSError:
                self._slots.release()
                break
            conn = TcpConn(sock, f"{addr[0]}:{addr[1]}", self._io_timeout, limit=MAX_REQUEST,
                           within_s=self._request_deadline_s)
            t = threading.Thread(target=self._run, args=(conn,), name=f"{self._name}-conn", daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()

    def _run(self, conn: TcpConn) -> None:
        try:
            self._handler(conn)
        except WeightChannelError as e:  # a fetcher that went away, a garbled request: expected
            log.warning("weight session with %s ended: %s", conn.peer, e)
        except Exception:
            log.exception("weight session with %s failed", conn.peer)
        finally:
            conn.close()
            with self._lock:
                self._threads.discard(threading.current_thread())
            self._slots.release()

    def close(self, join_timeout: float = 5.0) -> None:
        """Stop accepting; wait (bounded) for running sessions."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.close()
        self._accept.join(timeout=join_timeout)
        with self._lock:
            threads = list(self._threads)
        for t in threads:
            t.join(timeout=join_timeout)


class TcpTransport:
    """The ``tcp`` kind: every byte on plain sockets."""

    kind = "tcp"

    def __init__(self, connect_timeout: float = 5.0, io_timeout: float = 30.0, *, max_sessions: int = MAX_SESSIONS,
                 request_deadline_s: float = REQUEST_DEADLINE_S) -> None:
        self.connect_timeout = connect_timeout
        self.io_timeout = io_timeout
        self.max_sessions, self.request_deadline_s = max_sessions, request_deadline_s

    def holder_store(self, recycle: bool) -> VersionStore:
        """Versions are held in memory and streamed by the holder's sessions."""
        return VersionStore(recycle=recycle)

    def listen(self, host: str, port: int, handler: Callable[[BulkConn], None]) -> TcpListener:
        return TcpListener(host, port, handler, self.io_timeout, max_sessions=self.max_sessions,
                           request_deadline_s=self.request_deadline_s)

    def connect(self, address: str) -> TcpConn:
        return tcp_connect(address, self.connect_timeout, self.io_timeout)

    def close(self) -> None:
        return None
