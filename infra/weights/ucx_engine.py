"""One UCX worker of the weight channel (context + worker + progress thread), and how callers wait.

Invariants (``ucx.py`` says why each setting was chosen):

- a :class:`UcxEngine` owns one UCX context and one worker whose C++ progress thread runs in blocking
  (epoll) mode; callers never progress the worker themselves, they enqueue (delayed submission) and
  wait on their requests with :func:`wait_request`;
- :func:`wait_request` returns only once its request completed without error; it raises
  ``HolderFailed`` when the request failed, when no progress was made before the deadline, or
  through ``on_ctrl`` when the peer's control socket turns readable (peer gone / early message);
- a worker that may still be touched by UCX (requests parked after an aborted transfer, or an
  unmatched message waiting) is never destroyed: it is kept alive until the process exits.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Any

from .protocol import HolderFailed, peer_gone
from .tcp import TcpConn
from .ucx_config import UcxOptions, import_ucxx

log = logging.getLogger(__name__)


class UcxEngine:
    """One UCX context + worker + C++ progress thread (blocking mode): one lane of one profile."""

    def __init__(self, options: UcxOptions, profile: str) -> None:
        api = self.api = import_ucxx()
        from ucxx._lib.arr import Array

        self.Array = Array
        self.options = options
        self.profile = profile
        self._ctx = api.UCXContext(
            options.config(profile), feature_flags=(api.Feature.TAG, api.Feature.WAKEUP)
        )
        self.worker = api.UCXWorker(self._ctx, enable_delayed_submission=options.delayed_submission)
        self.worker.start_progress_thread(polling_mode=False, epoll_timeout=options.epoll_timeout_ms)
        self.address = bytes(self.worker.address)
        self._closed = False

    def endpoint(self, peer_address: bytes) -> Any:
        addr = self.api.UCXAddress.create_from_buffer(peer_address)
        return self.api.UCXEndpoint.create_from_worker_address(self.worker, addr, self.options.error_handling)

    def tag(self, value: int) -> Any:
        return self.api.UCXXTag(value)

    def has_unexpected(self) -> bool:
        """True if an unmatched tag message waits in the worker (an aborted fetch's offer)."""
        probe = self.worker.tag_probe(self.api.UCXXTag(0), self.api.UCXXTagMask(0), False)
        return bool(probe.matched)

    def close(self, parked: bool = False) -> None:
        """Stop the progress thread and release the worker.

        With ``parked`` requests still in flight, or an unmatched message waiting, the worker is kept
        (leaked) until the process exits: ucxx's worker destructor receives every unmatched message
        with no time bound and spins forever, holding the GIL, when its sender died mid-rendezvous.
        """
        if self._closed:
            return
        self._closed = True
        clean = False
        with contextlib.suppress(Exception):
            clean = not parked and not self.has_unexpected()
        with contextlib.suppress(Exception):
            self.worker.stop_progress_thread()
        if not clean:
            log.warning("UCX %s worker kept until exit: a transfer was aborted mid-rendezvous", self.profile)
            leak(self)


_PARKED: list[Any] = []


def leak(obj: Any) -> None:
    """Keep ``obj`` alive for the life of the process, even through interpreter finalization."""
    import ctypes

    _PARKED.append(obj)
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))


def wait_request(req: Any, deadline: float, ctrl: TcpConn, on_ctrl: Callable[[], None]) -> None:
    """Block until ``req`` completes; call ``on_ctrl`` when the control socket turns readable."""
    pause = 1e-5
    last_ctrl = 0.0
    while not req.completed:
        now = time.monotonic()
        if now - last_ctrl > 0.005:
            last_ctrl = now
            if peer_gone(ctrl.sock):
                on_ctrl()
        if now > deadline:
            raise HolderFailed("UCX transfer made no progress before the I/O timeout")
        time.sleep(pause)
        pause = min(pause * 2, 1e-3)
    try:
        req.check_error()
    except Exception as e:  # ucxx raises its own exception types (e.g. a peer that died mid-copy)
        raise HolderFailed(f"UCX transfer failed: {e}") from None


def b64(address: bytes) -> str:
    return base64.b64encode(address).decode()


def close_endpoint(ep: Any) -> None:
    with contextlib.suppress(Exception):
        ep.close_blocking(period=10**9, max_attempts=1)


__all__ = ["UcxEngine", "b64", "close_endpoint", "leak", "wait_request"]
