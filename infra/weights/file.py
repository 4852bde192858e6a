"""The ``file`` weight transport: a holder publishes buckets as files in a directory on a shared file
system; fetchers read them. No holder process, no socket.

Layout of a holder directory (one holder per directory; its address is the directory's absolute path):

- ``v{version:010d}.b{index:06d}.bucket``: the bytes of bucket ``index`` of ``version``, exactly
  ``nbytes`` of them (the same packing and checksums as ``tcp``/``ucx`` buckets);
- ``v{version:010d}.index.json``: the holder's manifest of that version (``WeightManifest.to_dict``),
  written *last*: a version is fetchable exactly while its index exists.

Holder invariants (:class:`DirectoryStore`):

- Every file is written atomically: to a hidden temporary name in the same directory, ``fsync``, then
  ``os.replace`` to its final name, so no partial file is ever visible under a final name; the
  directory is ``fsync``-ed once the index is in place. A failed publish removes what it wrote.
- ``retire`` deletes the index first (the version stops being listed at once), then the buckets. A
  fetcher that already opened a bucket file still reads it whole (POSIX unlink); one that had not
  gets ``HolderFailed`` and asks the next holder for the buckets still missing.
- ``clear`` (the holder closing) retires every version this store published.

Fetcher side (:class:`FileConn`): the connection answers the channel's control messages itself from the
directory (``status``, ``fetch``, ``bye``, as a holder session would) and reads each requested bucket
straight into the fetcher's destinations (``readinto``: no copy in user space). The fetcher then runs
the very algorithm it runs for ``tcp``/``ucx`` (``fetcher.py``): every bucket is checked against the
*announcement's* checksum, a corrupt one is refused and fetched from another holder if one is listed;
an index naming another version than asked for is refused. A bucket file whose size differs from the
index ends this holder's stream (``HolderFailed``, like a truncated socket stream).

Limits: the run token is not checked (there is no process to check it): the directory's permissions
are the access control. ``active_transfers`` is unknown (reported 0). Every fetcher reads the same
directory, so the file server's bandwidth bounds fan-out; holders listed besides it (instances
re-serving over ``tcp``/``ucx``) share the load as usual.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import re
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dora_rl.infra.storage import write_atomic

from .manifest import WeightManifest
from .protocol import PROTO, BulkConn, HolderFailed, WeightChannelError
from .store import HeldVersion

log = logging.getLogger(__name__)

_INDEX = re.compile(r"^v(\d{10})\.index\.json$")


def index_path(directory: Path, version: int) -> Path:
    """The index (manifest) file of ``version``; its presence makes the version fetchable."""
    return directory / f"v{version:010d}.index.json"


def bucket_path(directory: Path, version: int, index: int) -> Path:
    """The file holding bucket ``index`` of ``version``."""
    return directory / f"v{version:010d}.b{index:06d}.bucket"


def listed_versions(directory: Path) -> list[int]:
    """Versions whose index is in ``directory``, ascending."""
    return sorted(int(m.group(1)) for p in directory.iterdir() if (m := _INDEX.match(p.name)))


def fsync_dir(directory: Path) -> None:
    """Make the renames in ``directory`` durable (file systems that cannot fsync a directory: no-op)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
        log.debug("%s: directory fsync unsupported here (%s); renames are durable at the FS's pace", directory, e)
    finally:
        os.close(fd)


class DirectoryStore:
    """A file holder's :class:`~.store.HolderStore`: versions published as files (module docstring)."""

    def __init__(self, directory: Path, recycle: bool = False) -> None:
        self.directory = directory
        self.recycle = recycle
        directory.mkdir(parents=True, exist_ok=True)
        directory.chmod(0o700)  # the transport's access control: only the run's owner reads the weights
        self._lock = threading.Lock()
        self._published: dict[int, int] = {}  # version -> bucket count
        self._writing: set[int] = set()  # versions being published (not listed yet)
        self._spare: list[np.ndarray] | None = None

    def put(self, held: HeldVersion) -> None:
        """Publish ``held``: buckets first, then its index (each atomically), then ``fsync`` the directory.

        With ``recycle`` the written buffers are kept as the spare for the next pack."""
        m = held.manifest
        if m.version < 0:
            raise ValueError(f"version {m.version}: a file holder publishes versions >= 0 only")
        with self._lock:
            if m.version in self._published or m.version in self._writing:
                raise ValueError(f"version {m.version} is already served here; retire it first")
            self._writing.add(m.version)
        try:
            self._remove(m.version, None)  # leftovers of an earlier process under these names
            for i, buf in enumerate(held.buckets):
                write_atomic(bucket_path(self.directory, m.version, i), buf)
            write_atomic(index_path(self.directory, m.version), json.dumps(m.to_dict()).encode())
            fsync_dir(self.directory)
        except BaseException:
            self._remove(m.version, len(held.buckets))
            raise
        finally:
            with self._lock:
                self._writing.discard(m.version)
        with self._lock:
            self._published[m.version] = len(held.buckets)
            if self.recycle:
                self._spare = list(held.buckets)

    def _remove(self, version: int, buckets: int | None) -> None:
        """Delete the index of ``version``, then its bucket files (all found when ``buckets`` is None)."""
        index_path(self.directory, version).unlink(missing_ok=True)
        if buckets is None:
            paths = list(self.directory.glob(f"v{version:010d}.b*.bucket"))
        else:
            paths = [bucket_path(self.directory, version, i) for i in range(buckets)]
        for p in paths:
            p.unlink(missing_ok=True)

    def take_spare(self, sizes: list[int]) -> list[np.ndarray] | None:
        """The buffers of the last published version if they have exactly ``sizes`` (then no longer spare)."""
        with self._lock:
            spare = self._spare
            if spare is None or [b.nbytes for b in spare] != sizes:
                return None
            self._spare = None
            return spare

    def acquire(self, version: int) -> HeldVersion | None:
        """No session reads a directory store (fetchers open the files): always None."""
        return None

    def release(self, held: HeldVersion) -> None:
        """Nothing is ever acquired here."""
        raise RuntimeError("a file holder runs no sessions: nothing to release")

    def retire(self, version: int) -> bool:
        """Unpublish ``version`` (index first, then buckets); True if this store had published it."""
        with self._lock:
            n = self._published.pop(version, None)
        if n is None:
            return False
        self._remove(version, n)
        return True

    def versions(self) -> list[int]:
        """Versions this store published and did not retire, ascending."""
        with self._lock:
            return sorted(self._published)

    @property
    def active_transfers(self) -> int:
        """Unknown for files (fetchers do not announce themselves): 0."""
        return 0

    def clear(self) -> None:
        """Retire every version published here and drop the spare buffers."""
        for v in self.versions():
            self.retire(v)
        with self._lock:
            self._spare = None


class DirectoryListener:
    """A file holder's listener: its address is the directory; it accepts nothing."""

    def __init__(self, directory: Path) -> None:
        self.address = os.path.abspath(directory)

    def close(self) -> None:
        return None


class FileConn:
    """Fetcher side of a file holder: answers the channel's requests from the directory, reads buckets."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.peer = str(directory)
        self._replies: deque[dict[str, Any]] = deque()
        self._fetch: tuple[int, list[int], list[int]] | None = None  # version, buckets, their sizes
        self._go = False
        self._fh: io.FileIO | None = None

    def route(self) -> str:
        return f"file {self.directory}"

    # the holder's half, answered locally ---------------------------------------------------------
    def _answer(self, req: Mapping[str, Any]) -> dict[str, Any]:
        if req.get("proto") != PROTO:
            return {"ok": False, "error": f"protocol {req.get('proto')!r} unsupported (want {PROTO})"}
        op = req.get("op")
        try:
            held = listed_versions(self.directory)
        except OSError as e:
            raise HolderFailed(f"cannot list the file holder {self.directory}: {e}") from None
        if op == "status":
            return {"ok": True, "active_transfers": 0, "versions": held}
        if op == "bye":
            return {"ok": True}
        version = req.get("version")
        if op != "fetch" or not isinstance(version, int):
            return {"ok": False, "error": f"bad request (op {op!r}, version {version!r})"}
        if version not in held:
            return {"ok": False, "error": f"version {version} is not held here (holding {held})"}
        index = self._read_index(version)
        buckets = req.get("buckets")
        if (
            not isinstance(buckets, list)
            or not all(isinstance(b, int) and 0 <= b < len(index.buckets) for b in buckets)
            or len(set(buckets)) != len(buckets)
        ):
            return {"ok": False, "error": f"bad bucket list for version {version}"}
        self._fetch = (index.version, buckets, [index.buckets[b].nbytes for b in buckets])
        return {"ok": True, "version": index.version, "buckets": buckets}

    def _read_index(self, version: int) -> WeightManifest:
        path = index_path(self.directory, version)
        try:
            return WeightManifest.from_dict(json.loads(path.read_bytes()))
        except FileNotFoundError:
            raise HolderFailed(f"version {version} was retired from {self.directory} meanwhile") from None
        except (OSError, ValueError) as e:
            raise HolderFailed(f"unreadable index {path}: {e}") from None

    # BulkConn ------------------------------------------------------------------------------------
    def send_msg(self, msg: Mapping[str, Any]) -> None:
        if "op" in msg:
            self._replies.append(self._answer(msg))
        elif msg.get("go") and self._fetch is not None:
            self._go = True
        else:
            raise HolderFailed(f"file holder {self.directory}: unexpected message {dict(msg)!r}")

    def recv_msg(self) -> dict[str, Any]:
        if not self._replies:
            raise HolderFailed(f"file holder {self.directory}: no reply pending")
        return self._replies.popleft()

    def request_extras(self) -> dict[str, Any]:
        return {}

    def accept_extras(self, request: Mapping[str, Any]) -> dict[str, Any]:
        raise WeightChannelError("a file holder runs no sessions (accept_extras is holder-side)")

    def forget(self, request: Mapping[str, Any]) -> None:
        return None

    def send_segments(self, bufs: Sequence[Any]) -> int:
        raise WeightChannelError("a file holder runs no sessions (send_segments is holder-side)")

    def recv_segments(self, dests: Sequence[np.ndarray], on_done: Callable[[int], None]) -> None:
        """Read the requested buckets, in order, as one stream: segment ``i`` into ``dests[i]``."""
        if not self._go or self._fetch is None:
            raise HolderFailed(f"file holder {self.directory}: segments asked for before 'go'")
        version, buckets, sizes = self._fetch
        pending = deque(zip(buckets, sizes, strict=True))
        left = 0
        path = self.directory
        total = 0
        for i, dest in enumerate(dests):
            view = dest.data.cast("B")
            got = 0
            while got < view.nbytes:
                while left == 0:  # next bucket (an empty one is only checked)
                    if not pending:
                        raise HolderFailed(f"{self.directory}: segments go beyond the buckets asked for")
                    bucket, left = pending.popleft()
                    path = bucket_path(self.directory, version, bucket)
                    self._open(path, version, left)
                assert self._fh is not None
                k = self._fh.readinto(view[got : got + min(view.nbytes - got, left)])
                if not k:
                    raise HolderFailed(f"{path}: truncated while reading ({left} bytes missing)")
                got, left, total = got + k, left - k, total + k
            on_done(i)
        self._close_file()
        self._replies.append({"done": True, "bytes": total})

    def _open(self, path: Path, version: int, nbytes: int) -> None:
        self._close_file()
        try:
            self._fh = open(path, "rb", buffering=0)  # closed by _close_file
            size = os.fstat(self._fh.fileno()).st_size
        except FileNotFoundError:
            raise HolderFailed(f"{path}: gone (version {version} retired meanwhile)") from None
        except OSError as e:
            raise HolderFailed(f"{path}: cannot read: {e}") from None
        if size != nbytes:
            raise HolderFailed(f"{path}: {size} bytes on disk, the holder's index says {nbytes}")

    def _close_file(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None

    def abort(self) -> None:
        self.close()

    def close(self) -> None:
        self._close_file()
        self._replies.clear()
        self._fetch, self._go = None, False


class FileTransport:
    """The ``file`` kind. ``directory``: where a holder publishes (required to hold, unused to fetch)."""

    kind = "file"

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = Path(directory) if directory is not None else None

    def _holder_dir(self) -> Path:
        if self.directory is None:
            raise ValueError('a "file" weight holder needs a directory (make_weight_server(..., directory=...))')
        return self.directory

    def holder_store(self, recycle: bool) -> DirectoryStore:
        return DirectoryStore(self._holder_dir(), recycle=recycle)

    def listen(self, host: str, port: int, handler: Callable[[BulkConn], None]) -> DirectoryListener:
        return DirectoryListener(self._holder_dir())

    def connect(self, address: str) -> FileConn:
        directory = Path(address)
        if not directory.is_dir():
            raise HolderFailed(f"file holder {address}: not a directory here (is the shared file system mounted?)")
        return FileConn(directory)

    def close(self) -> None:
        return None


__all__ = ["DirectoryStore", "FileConn", "FileTransport", "bucket_path", "index_path", "write_atomic"]
