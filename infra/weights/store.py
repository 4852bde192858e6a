"""Holder-side lifecycle of policy versions: hold (serve), count transfers, retire; fault hooks.

A holder keeps its versions in a :class:`HolderStore` chosen by its transport
(``Transport.holder_store``): :class:`VersionStore` here (memory, streamed to fetchers by session
threads: ``tcp``, ``ucx``) or ``file.DirectoryStore`` (files the fetchers read themselves: ``file``).

Invariants of :class:`VersionStore`:

- A version is either held (fetchable) or not; ``retire`` makes it unfetchable at once. Its buffers
  are released when the last transfer still sending them finishes (transfers hold a reference).
- ``active_transfers`` = fetch sessions between ``acquire`` and ``release`` (all versions): the load
  figure fetchers use to pick the least-loaded holder.
- With ``recycle``, a retired version's bucket buffers are kept (one spare set) and reused by the
  next ``pack`` of identical bucket sizes instead of fresh memory; they are recycled only once no
  transfer still reads them, so a fetcher never sees bytes change under its feet.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .manifest import WeightManifest


@dataclass(frozen=True)
class FaultInjection:
    """Test hooks of a holder. ``corrupt_bucket`` / ``die_in_bucket`` fire once each.

    - ``corrupt_bucket``: flip one byte in the copy of that bucket sent on the wire (the held bytes
      stay intact), so the fetcher's checksum fails;
    - ``die_in_bucket``: send half of that bucket's first segment, then drop the connection (a holder
      dying mid-stream / a truncated bucket);
    - ``answer_version``: claim to serve this version whatever was asked (a confused holder).
    """

    corrupt_bucket: int | None = None
    die_in_bucket: int | None = None
    answer_version: int | None = None


@dataclass(frozen=True)
class HeldVersion:
    """The bytes of one held version: its manifest and one uint8 buffer per bucket."""

    manifest: WeightManifest
    buckets: tuple[np.ndarray, ...]


class HolderStore(Protocol):
    """Where a holder keeps the versions it serves (``WeightServer`` calls only these).

    ``put`` makes a version fetchable (``ValueError`` if it is already held), ``retire`` makes it
    unfetchable at once, ``versions`` lists the fetchable ones; ``acquire``/``release`` bracket one
    session's transfer (stores that no session reads return None from ``acquire``); ``take_spare``
    hands back earlier buffers of exactly ``sizes`` to pack into (or None); ``clear`` retires all.
    """

    def put(self, held: HeldVersion) -> None: ...

    def take_spare(self, sizes: list[int]) -> list[np.ndarray] | None: ...

    def acquire(self, version: int) -> HeldVersion | None: ...

    def release(self, held: HeldVersion) -> None: ...

    def retire(self, version: int) -> bool: ...

    def versions(self) -> list[int]: ...

    @property
    def active_transfers(self) -> int: ...

    def clear(self) -> None: ...


class VersionStore:
    """Thread-safe map version -> :class:`HeldVersion` with transfer counting and buffer recycling."""

    def __init__(self, recycle: bool = False) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, HeldVersion] = {}
        self._users: dict[int, int] = {}
        self._retired_busy: dict[int, HeldVersion] = {}
        self._spare: list[np.ndarray] | None = None
        self._active = 0
        self.recycle = recycle

    def put(self, held: HeldVersion) -> None:
        """Hold a version; ``ValueError`` if that version is already held."""
        v = held.manifest.version
        with self._lock:
            if v in self._held:
                raise ValueError(f"version {v} is already served here; retire it first")
            self._held[v] = held

    def take_spare(self, sizes: list[int]) -> list[np.ndarray] | None:
        """Recycled buffers of exactly ``sizes`` (then no longer spare), or None."""
        if not self.recycle:
            return None
        with self._lock:
            spare = self._spare
            if spare is None or [b.nbytes for b in spare] != sizes:
                return None
            self._spare = None
            return spare

    def acquire(self, version: int) -> HeldVersion | None:
        """Start a transfer of ``version`` (None if not held)."""
        with self._lock:
            held = self._held.get(version)
            if held is None:
                return None
            self._users[version] = self._users.get(version, 0) + 1
            self._active += 1
            return held

    def release(self, held: HeldVersion) -> None:
        """End a transfer started by :meth:`acquire`."""
        v = held.manifest.version
        with self._lock:
            self._active -= 1
            self._users[v] -= 1
            if self._users[v] == 0:
                del self._users[v]
                retired = self._retired_busy.pop(v, None)
                if retired is not None and self.recycle:
                    self._spare = list(retired.buckets)

    def retire(self, version: int) -> bool:
        """Stop serving ``version``; True if it was held."""
        with self._lock:
            held = self._held.pop(version, None)
            if held is None:
                return False
            if self._users.get(version):
                self._retired_busy[version] = held
            elif self.recycle:
                self._spare = list(held.buckets)
            return True

    def versions(self) -> list[int]:
        """Versions held now, ascending."""
        with self._lock:
            return sorted(self._held)

    @property
    def active_transfers(self) -> int:
        with self._lock:
            return self._active

    def clear(self) -> None:
        """Drop every version and the spare buffers."""
        with self._lock:
            self._held.clear()
            self._retired_busy.clear()
            self._spare = None
