"""A migrating trajectory's KV rows between two instances of one version (decision 0065): both ends.

The exporting instance (:class:`KvOutbox`) serves the rows its engine exported on its own weight holder,
under a negative transfer id (never a policy version), and names them in the :class:`KvTransfer` of the
aborted chunk, signed with the run's token; the orchestrator copies that into the resume request. The importing instance
(:func:`fetch_rows`) fetches them over the weight channel (the run's token, per-bucket checksums
against the record's manifest, any transport) and hands them to its engine, or says why it will prefill.

Invariants:

- rows are exported by an instance holding the trajectory's version (C1) and named on a resume only under
  that same version (the orchestrator's rule), so they are the KV the importer's weights would compute
  (in the partial baseline too: its exporter had prefilled the older tokens under the version it holds);
- they are fetched only through a reference signed with the run's token (:func:`kv_signature`): a
  record written outside the run makes no connection, whatever address it names;
- a transfer stays served ``KV_HOLD_S`` seconds after it was exported, and at most ``KV_HOLD_MAX``
  transfers and ``KV_HOLD_BYTES`` bytes are held (the oldest retired first): a resume fetched later, or
  from a holder that died, falls back to a prefill, never waits;
- every fallback has one reason: ``signature`` (missing or wrong), ``fetch`` (refused, gone, corrupt),
  ``format`` (not this trajectory's KV rows); the engine adds its own (:func:`.kv_rows.unfit`).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from dora_rl.infra.crashpoints import crash_point
from dora_rl.infra.kafka.signing import mac, signature_problem, signed
from dora_rl.schemas.records import KvTransfer, RolloutRequest

from .engine import GenRequest

if TYPE_CHECKING:  # torch only where rows move: an instance that moves none never imports it
    import torch

    from dora_rl.infra.weights.holder import WeightServer

    from .kv_rows import KvRows

log = logging.getLogger(__name__)

KV_HOLD_S = 120.0
"""Seconds an exported transfer stays served (a resume is dispatched at the orchestrator's next poll)."""
KV_HOLD_MAX = 1024
"""Transfers held at most per instance (the oldest retired first)."""
KV_HOLD_BYTES = 4 << 30
"""Bytes of rows held at most per instance (a long context of a 1B model is ~100 MB of KV)."""


_rows_import: threading.Thread | None = None
_rows_import_lock = threading.Lock()


def load_rows_module() -> threading.Thread:
    """Start importing :mod:`.kv_rows` (torch and transformers: seconds on a CPU) on a daemon thread, once per
    process, and return that thread. The outbox and the inbox call this when they are built, at the instance's
    start. Imported at the first export instead, it stalled the generation thread for ~4 s mid-step, and the first
    moves of every run with it (decision 0077); imported before the instance serves, it added those seconds to
    every restart (decision 0078). A move that comes before the import ends waits for the rest of it (Python's
    per-module import lock); an import that failed fails again, with its error, at that move."""
    global _rows_import
    with _rows_import_lock:
        if _rows_import is None:
            _rows_import = threading.Thread(target=importlib.import_module, args=(f"{__package__}.kv_rows",),
                                            name="kv-rows-import", daemon=True)
            _rows_import.start()
        return _rows_import


def kv_signature(kv: KvTransfer, token: str) -> str:
    """The run's signature of ``kv`` (``infra/kafka/signing.mac`` over ``KvTransfer.unsigned_encoding``)."""
    return mac(kv, token)


class KvOutbox:
    """Exported rows served by this instance's holder until they expire (thread-safe: the generation thread
    puts, the main loop expires)."""

    def __init__(self, server: WeightServer, token: str, clock: Callable[[], float] = time.monotonic) -> None:
        load_rows_module()
        self._server, self._token, self._clock = server, token, clock
        self._held: deque[tuple[float, int, int]] = deque()  # (served at, transfer id, bytes), oldest first
        self._bytes = 0
        self._next = -1
        self._lock = threading.Lock()

    def put(self, request_id: str, rows: KvRows) -> KvTransfer:
        """Serve ``rows`` of ``request_id``; the record naming them."""
        from .kv_rows import to_tensors

        with self._lock:
            self._expire(rows.nbytes)
            transfer, self._next = self._next, self._next - 1
            m = self._server.serve(transfer, to_tensors({request_id: rows}))
            self._held.append((self._clock(), transfer, m.total_bytes))
            self._bytes += m.total_bytes
        kv = KvTransfer(holder=self._server.address, transfer=transfer, total_bytes=m.total_bytes,
                        checksum_algo=m.checksum_algo, tensors=m.tensors, buckets=m.buckets)
        return signed(kv, self._token)

    def expire(self) -> None:
        """Retire the transfers older than ``KV_HOLD_S``."""
        with self._lock:
            self._expire(0)

    def _expire(self, incoming: int) -> None:
        """Retire the transfers older than ``KV_HOLD_S``, then the oldest until ``incoming`` more bytes and one
        more transfer fit the caps (``incoming = 0``: only the age rule)."""
        now = self._clock()
        while self._held and (now - self._held[0][0] > KV_HOLD_S or (incoming and (
                len(self._held) >= KV_HOLD_MAX or self._bytes + incoming > KV_HOLD_BYTES))):
            _, transfer, nbytes = self._held.popleft()
            self._server.retire(transfer)
            self._bytes -= nbytes

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def held_bytes(self) -> int:
        return self._bytes


Fetch = Callable[[KvTransfer], Mapping[str, "torch.Tensor"]]
"""Fetches the tensors a :class:`KvTransfer` names (raises on any failure)."""


def fetch_rows(req: RolloutRequest, kv: KvTransfer, token: str, fetch: Fetch) -> tuple[KvRows | None, str]:
    """The KV rows ``kv`` (named by ``req``) holds, or None and the reason ``req`` is prefilled (module
    docstring); ``token``: the run's weight token, which signed ``kv``."""
    if signature_problem(kv, token, f"the KV reference of {req.trajectory_id}") is not None:
        return None, "signature"
    try:
        tensors = fetch(kv)
    except Exception as exc:  # the exporter died, expired the rows, or sent bytes that fail their checksum
        log.warning("%s: KV rows not fetched from %s (transfer %d), prefilling instead: %s",
                    req.trajectory_id, kv.holder, kv.transfer, exc)
        return None, "fetch"
    from .kv_rows import from_tensors

    try:
        rows = from_tensors(tensors)
    except ValueError:
        return None, "format"
    got = rows.get(req.trajectory_id)
    if got is None or len(rows) != 1:
        return None, "format"
    return got, ""


class KvInbox:
    """The importing side: a resume's engine request with the KV rows it names, fetched one at a time.

    ``count(name, version, reason)``: the metric of each request naming rows (``kv_moves`` when they came,
    ``kv_fallback`` with the reason when not).
    """

    def __init__(self, fetch: Fetch, token: str, count: Callable[[str, int, str], None]) -> None:
        load_rows_module()
        self._fetch, self._token, self._count = fetch, token, count
        self._lock = threading.Lock()  # the main loop (joins) and the generation thread (new calls) both ask

    def with_rows(self, r: RolloutRequest, req: GenRequest) -> GenRequest:
        """``req`` (the engine request of ``r``) carrying the rows ``r`` names, when they can be had."""
        if r.kv is None:
            return req
        v = int(r.policy_version)
        with self._lock:
            rows, why = fetch_rows(r, r.kv, self._token, self._fetch)
        if rows is not None:  # the bytes moved, the engine has not taken them: a restart fetches them again
            crash_point("rollout.kv_transfer")
        self._count("kv_moves" if rows is not None else "kv_fallback", v, why)
        return dataclasses.replace(req, kv=rows) if rows is not None else req
