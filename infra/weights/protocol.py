"""Wire protocol of the weight channel: control messages, errors, and the transport interface.

Every connection starts with one *request* from the fetcher and one *reply* from the holder, both
small JSON control messages framed as ``MAGIC(4) | length(4, big-endian) | UTF-8 JSON``
(``length <= MAX_CONTROL``) on a plain TCP socket. The two *active* transports use this control
socket; they differ in how the bulk segments move (in-band on the same socket for ``tcp``, UCX tag
messages for ``ucx``). The *passive* ``file`` transport has no holder process: its connection object
answers the same messages itself from the holder's directory and reads the segments from the
holder's files (``file.py``), so the fetcher runs one algorithm for every kind.

Request ``{"proto": 2, "nonce": str, "proof": str, "op": "status" | "fetch" | "bye", "version": int,
"buckets": [int], ...transport fields}`` (``proof = HMAC-SHA256(run token, nonce)``, :func:`credentials`:
the token itself never travels; ``bye``: a fetcher leaving, so the holder drops what it
caches for it). Reply ``{"ok": false, "error": str}`` (nothing else follows), or for
``status`` ``{"ok": true, "active_transfers": int, "versions": [int]}``, or for ``fetch``
``{"ok": true, "version": int, "buckets": [int]}``; the fetcher checks that reply and answers
``{"go": true}`` (or hangs up: it refused), then the holder sends the segments of those buckets in
order and a trailer ``{"done": true, "bytes": int}``. A holder checks the proof before anything else
and sends no weight byte without a valid one, nor before ``go``. A recorded request can be replayed (it
reads weights the wire shows anyway); it cannot be turned into a valid request for anything else.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import select
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from .store import HolderStore

PROTO = 2
MAGIC = b"DWC1"
MAX_CONTROL = 16 << 20
MAX_REQUEST = 64 << 10
"""The largest message a holder reads from a fetcher (request, ``go``, ``bye``): a holder allocates no more
than this for a peer whose token it has not checked."""
REQUEST_DEADLINE_S = 10.0
"""A holder's deadline for each whole message from a fetcher (not per ``recv``: a trickle cannot hold it)."""
MAX_SESSIONS = 64
"""Sessions a holder runs at once; further connections wait in the listen backlog."""


class WeightChannelError(RuntimeError):
    """Base class of every weight-channel failure."""


class TransportUnavailableError(WeightChannelError):
    """The configured transport cannot be used in this environment."""


class HolderRefused(WeightChannelError):
    """A holder answered but refused the request (wrong token, version not held, ...)."""


class HolderFailed(WeightChannelError):
    """A holder could not be reached, died or sent a truncated stream mid-transfer."""


class WeightFetchError(WeightChannelError):
    """No holder could deliver every bucket of a version intact."""


def _proof(token: str, nonce: str) -> str:
    """``HMAC-SHA256(token, nonce)`` in hex."""
    return hmac.new(token.encode(), nonce.encode(), hashlib.sha256).hexdigest()


def credentials(token: str) -> dict[str, str]:
    """The request fields that show knowledge of ``token`` without sending it: a fresh nonce and its proof."""
    nonce = secrets.token_hex(16)
    return {"nonce": nonce, "proof": _proof(token, nonce)}


def authorized(token: str, request: Mapping[str, Any]) -> bool:
    """Whether ``request`` carries a valid proof of ``token`` (constant-time comparison)."""
    nonce, proof = request.get("nonce"), request.get("proof")
    if not isinstance(nonce, str) or not isinstance(proof, str) or not 16 <= len(nonce) <= 128:
        return False
    return hmac.compare_digest(proof.encode(), _proof(token, nonce).encode())


# ---------------------------------------------------------------------------------------- framing


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; ``HolderFailed`` if the peer closes first (truncated stream) or, with a
    ``deadline`` (``time.monotonic()``), has not sent it all by then."""
    got, n = 0, view.nbytes
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise HolderFailed(f"deadline passed after {got} of {n} bytes")
            sock.settimeout(left)
        try:
            k = sock.recv_into(view[got:], n - got)
        except TimeoutError:
            raise HolderFailed(f"timed out after {got} of {n} bytes") from None
        except OSError as e:
            raise HolderFailed(f"connection failed after {got} of {n} bytes: {e}") from None
        if k == 0:
            raise HolderFailed(f"peer closed the connection: truncated after {got} of {n} bytes")
        got += k


def send_control(sock: socket.socket, msg: Mapping[str, Any]) -> None:
    """Send one framed JSON control message."""
    payload = json.dumps(msg, separators=(",", ":")).encode()
    if len(payload) > MAX_CONTROL:
        raise ValueError(f"control message of {len(payload)} bytes exceeds {MAX_CONTROL}")
    try:
        sock.sendall(MAGIC + len(payload).to_bytes(4, "big") + payload)
    except OSError as e:
        raise HolderFailed(f"could not send a control message: {e}") from None


def recv_control(sock: socket.socket, limit: int = MAX_CONTROL, within_s: float | None = None) -> dict[str, Any]:
    """Receive one framed JSON control message (a JSON object) of at most ``limit`` bytes, whole within
    ``within_s`` seconds when given, or raise ``HolderFailed``."""
    deadline = None if within_s is None else time.monotonic() + within_s
    previous = sock.gettimeout()
    try:
        head = bytearray(8)
        recv_exact(sock, memoryview(head), deadline)
        if head[:4] != MAGIC:
            raise HolderFailed(f"not a weight-channel peer (got {bytes(head[:4])!r} instead of {MAGIC!r})")
        n = int.from_bytes(head[4:], "big")
        if n > limit:
            raise HolderFailed(f"control message of {n} bytes exceeds {limit}")
        body = bytearray(n)
        recv_exact(sock, memoryview(body), deadline)
    finally:
        if deadline is not None:
            sock.settimeout(previous)
    try:
        msg = json.loads(body)
    except ValueError as e:
        raise HolderFailed(f"malformed control message: {e}") from None
    if not isinstance(msg, dict):
        raise HolderFailed("control message is not a JSON object")
    return msg


def peer_gone(sock: socket.socket) -> bool:
    """True when ``sock`` is readable while no message is expected: the peer closed or broke the link."""
    try:
        readable, _, errored = select.select([sock], [], [sock], 0)
    except (OSError, ValueError):
        return True
    return bool(readable or errored)


def parse_address(address: str) -> tuple[str, int]:
    """``"host:port"`` -> ``(host, port)``."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"weight holder address must be host:port, got {address!r}")
    return host.strip("[]"), int(port)


# ----------------------------------------------------------------------------------- transport API


class BulkConn(Protocol):
    """One connection between a fetcher and a holder (control messages + bulk segments)."""

    peer: str

    def send_msg(self, msg: Mapping[str, Any]) -> None:
        """Send a control message."""

    def recv_msg(self) -> dict[str, Any]:
        """Receive a control message (``HolderFailed`` on EOF, garbage or timeout)."""

    def request_extras(self) -> dict[str, Any]:
        """Fetcher side: transport fields to add to a fetch request (how the holder reaches us)."""

    def accept_extras(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Holder side, after the token check: set up the bulk path; returns fields for the reply."""

    def forget(self, request: Mapping[str, Any]) -> None:
        """Holder side: drop per-fetcher state (cached endpoints) of the fetcher saying ``bye``."""

    def send_segments(self, bufs: Sequence[Any]) -> int:
        """Holder side: send the buffers in order; returns the bytes sent."""

    def recv_segments(self, dests: Sequence[np.ndarray], on_done: Callable[[int], None]) -> None:
        """Fetcher side: receive segment ``i`` into ``dests[i]``, in order; ``on_done(i)`` after each."""

    def route(self) -> str:
        """How the bulk bytes of this connection move (after the reply), recorded with each fetch."""

    def abort(self) -> None:
        """Drop the connection at once (a holder dying mid-stream, in tests)."""

    def close(self) -> None:
        """Close the connection."""


class Listener(Protocol):
    """How fetchers reach a holder; ``address`` is what announcements name as its holder.

    Active transports (``tcp``, ``ucx``): an accept loop calling the handler with each new connection
    on a thread of its own. Passive ones (``file``): the address of the holder's store; nothing is
    accepted and the handler is never called (fetchers read the store through their ``connect``).
    """

    address: str

    def close(self) -> None:
        """Stop accepting and release the port (passive: nothing to release)."""


class Transport(Protocol):
    """One transport kind (``tcp``, ``ucx`` or ``file``)."""

    kind: str

    def holder_store(self, recycle: bool) -> HolderStore:
        """Holder side: where the versions it serves are kept (memory for active transports, files
        for ``file``); ``recycle`` lets a store hand back a retired version's buffers to pack into."""

    def listen(self, host: str, port: int, handler: Callable[[BulkConn], None]) -> Listener:
        """Start accepting on ``host:port`` (0: any free port); passive transports ignore both."""

    def connect(self, address: str) -> BulkConn:
        """Open a connection to the holder at ``address`` (``HolderFailed`` if unreachable)."""

    def close(self) -> None:
        """Release transport resources (UCX worker, progress thread)."""
