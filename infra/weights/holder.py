"""Holder side of the weight channel: serve held versions to fetchers, one session thread each.

Where the held bytes live is the transport's choice (``Transport.holder_store``): in memory, sent by
the sessions below (``tcp``, ``ucx``), or in a directory that fetchers read themselves (``file``: no
session ever runs). Pack, serve, retire and close are the same code for every kind.

Session invariants: the token is checked before anything else (a wrong one gets a refusal and no
weight byte); a version not held is refused; segments go out only after the fetcher accepted the
reply (``go``); ``active_transfers`` counts sessions between acquire and release.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from .fetcher import check_token
from .manifest import DEFAULT_BUCKET_BYTES, WeightManifest, pack_state_dict, verify_bucket
from .plan import request_segments
from .protocol import PROTO, BulkConn, Transport, WeightChannelError, authorized
from .store import FaultInjection, HeldVersion, HolderStore


class WeightServer:
    """A holder: serves any number of versions until retired; one session thread per fetcher (none
    for ``file``, whose fetchers read the published files)."""

    def __init__(
        self,
        transport: Transport,
        token: str,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        recycle: bool = False,
        faults: FaultInjection | None = None,
        advertised_host: str | None = None,
        checksum_algo: str | None = None,
    ) -> None:
        self.kind = transport.kind
        self.checksum_algo = checksum_algo
        self._transport = transport
        self._token = check_token(token)
        self._store: HolderStore = transport.holder_store(recycle)
        self.bucket_bytes = bucket_bytes
        self.faults = faults or FaultInjection()
        self._fired: set[str] = set()
        self._lock = threading.Lock()
        self.bytes_sent = 0
        self.transfers_done = 0
        self.refusals = 0
        self._listener = transport.listen(host, port, self._session)
        self.address: str = self._listener.address
        # what fetchers connect to: the bound host:port, with advertised_host (if given) in place of the
        # bound host (infra/endpoints.py: a bound 0.0.0.0 is never announced)
        if advertised_host and self.kind != "file":
            _, port_text = self.address.rsplit(":", 1)
            host_text = f"[{advertised_host}]" if ":" in advertised_host else advertised_host
            self.address = f"{host_text}:{port_text}"

    # lifecycle ---------------------------------------------------------------------------------
    def serve(self, version: int, state_dict: Mapping[str, torch.Tensor]) -> WeightManifest:
        """Pack ``state_dict`` (one copy: the snapshot served) and hold it as ``version``; with
        ``recycle`` into the buffers of the last retired version when the layout is the same."""
        manifest, buckets = pack_state_dict(
            state_dict, self.bucket_bytes, version=version, alloc=self._store.take_spare,
            checksum_algo=self.checksum_algo,
        )
        self._store.put(HeldVersion(manifest, tuple(buckets)))
        return manifest

    def serve_packed(
        self, manifest: WeightManifest, buckets: Sequence[np.ndarray], verify: bool = False
    ) -> None:
        """Hold already-packed buckets (no copy), e.g. what this process just fetched (peer-to-peer)."""
        if len(buckets) != len(manifest.buckets):
            raise ValueError("serve_packed: bucket count does not match the manifest")
        for i, b in enumerate(buckets):
            if b.nbytes != manifest.buckets[i].nbytes or (verify and not verify_bucket(manifest, i, b)):
                raise ValueError(f"serve_packed: bucket {i} does not match the manifest")
        self._store.put(HeldVersion(manifest, tuple(buckets)))

    def retire(self, version: int) -> bool:
        """Stop serving ``version``; its memory is freed once no transfer still sends it (``file``: its
        files are deleted)."""
        return self._store.retire(version)

    @property
    def versions(self) -> list[int]:
        return self._store.versions()

    @property
    def active_transfers(self) -> int:
        """Fetches in progress now (the load fetchers compare)."""
        return self._store.active_transfers

    def close(self) -> None:
        """Stop accepting, wait (bounded) for sessions, drop every version, release the transport."""
        self._listener.close()
        self._store.clear()
        self._transport.close()

    def __enter__(self) -> WeightServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # session -----------------------------------------------------------------------------------
    def _fire(self, fault: str, bucket: int | None, buckets: list[int]) -> bool:
        with self._lock:
            if bucket is None or bucket not in buckets or fault in self._fired:
                return False
            self._fired.add(fault)
            return True

    def _session(self, conn: BulkConn) -> None:
        try:
            req = conn.recv_msg()
        except WeightChannelError:
            return
        if req.get("proto") != PROTO:
            conn.send_msg({"ok": False, "error": f"protocol {req.get('proto')!r} unsupported (want {PROTO})"})
            return
        if not authorized(self._token, req):
            with self._lock:
                self.refusals += 1
            conn.send_msg({"ok": False, "error": "unauthorized: wrong token for this run's weight channel"})
            return
        op = req.get("op")
        if op == "status":
            conn.send_msg({"ok": True, "active_transfers": self.active_transfers, "versions": self.versions})
            return
        if op == "bye":  # a fetcher leaving: drop what the transport keeps for it while it still lives
            conn.forget(req)
            conn.send_msg({"ok": True})
            return
        if op != "fetch" or not isinstance(req.get("version"), int):
            conn.send_msg({"ok": False, "error": f"bad request (op {op!r}, version {req.get('version')!r})"})
            return
        version = req["version"]
        held = self._store.acquire(version)
        if held is None:
            conn.send_msg(
                {"ok": False, "error": f"version {version} is not held here (holding {self.versions})"}
            )
            return
        try:
            self._send_version(conn, req, held)
        finally:
            self._store.release(held)

    def _send_version(self, conn: BulkConn, req: Mapping[str, Any], held: HeldVersion) -> None:
        m = held.manifest
        buckets = req.get("buckets")
        if (
            not isinstance(buckets, list)
            or not all(isinstance(b, int) and 0 <= b < len(m.buckets) for b in buckets)
            or len(set(buckets)) != len(buckets)
        ):
            conn.send_msg({"ok": False, "error": f"bad bucket list for version {m.version}"})
            return
        extras = conn.accept_extras(req)
        answer = m.version if self.faults.answer_version is None else self.faults.answer_version
        conn.send_msg({**extras, "ok": True, "version": answer, "buckets": buckets})
        try:
            go = conn.recv_msg()
        except WeightChannelError:
            return  # the fetcher refused the reply: no weight byte goes out
        if not go.get("go"):
            return
        corrupt = self._fire("corrupt", self.faults.corrupt_bucket, buckets)
        die = self._fire("die", self.faults.die_in_bucket, buckets)
        bufs: list[Any] = []
        for seg in request_segments(m, buckets):
            data = held.buckets[seg.bucket][seg.start : seg.end]
            if corrupt and seg.bucket == self.faults.corrupt_bucket:
                data = data.copy()
                data[data.nbytes // 2] ^= 0xFF
                corrupt = False
            if die and seg.bucket == self.faults.die_in_bucket:
                bufs.append(data[: max(data.nbytes // 2, 1)])
                break
            bufs.append(data)
        sent = conn.send_segments(bufs)
        with self._lock:
            self.bytes_sent += sent
        if die:
            conn.abort()
            return
        with self._lock:
            self.transfers_done += 1
        conn.send_msg({"done": True, "bytes": sent})
