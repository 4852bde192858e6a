"""A checkpoint root on local disk or on shared storage (any fsspec URL: ``s3://``, ``gs://``, ``memory://``...).

A :class:`StorageRoot` writes *entries*: a named set of files a reader sees whole or not at all.

- **Local disk** (a path or ``file://``): the files go to a temporary sibling, each is fsync'd, the sibling is
  renamed into place and the parent fsync'd (POSIX rename is atomic).
- **Anything else** (object stores have no rename): the files go straight under the entry's own prefix, the
  marker :data:`COMPLETE` last. A reader treats an entry without its marker as absent. Writers never share a
  prefix: a caller names each entry uniquely (the trainer: version and incarnation), so a zombie writer
  can at worst leave an unmarked entry of its own, never change a marked one of another writer.

Every read goes through :meth:`StorageRoot.within`: an entry URI a record names is read only when it lies under
this root (no ``..``, same scheme and bucket), whatever the record says. Credentials and endpoints never
appear in a URL or a record: fsspec reads them from the environment (for S3: ``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``FSSPEC_S3_ENDPOINT_URL``).
"""

from __future__ import annotations

import os
import posixpath
import secrets
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

COMPLETE = "COMPLETE"


def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


class StorageRoot:
    """The root ``url`` (a local path or an fsspec URL); entries are its direct children."""

    def __init__(self, url: str | Path) -> None:
        text = str(url)
        self.local = _is_local(text)
        self.fs: Any
        if self.local:
            self.url = str(Path(text.removeprefix("file://")).resolve())
            self.fs = LocalFiles()
        else:
            import fsspec  # only for shared storage: a local root (a GPU box without fsspec) needs none

            self.fs, path = fsspec.core.url_to_fs(text)
            self.url = f"{text.split('://', 1)[0]}://{posixpath.normpath(path).strip('/')}"

    def _path(self, uri: str) -> str:
        """The filesystem path of ``uri`` (one of this root's URIs)."""
        return uri if self.local else uri.split("://", 1)[1]

    def entry(self, name: str) -> str:
        """The URI of entry ``name`` (a single path segment)."""
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"entry name {name!r} is not one path segment")
        return posixpath.join(self.url, name) if not self.local else str(Path(self.url) / name)

    def within(self, uri: str | Path) -> str:
        """``uri`` normalised, if it names an entry (or a file in one) under this root; ValueError otherwise."""
        text = str(uri)
        if self.local:
            if not _is_local(text):
                raise ValueError(f"checkpoint {text} is outside this run's checkpoint root {self.url}: not read")
            path = Path(text.removeprefix("file://")).resolve()
            if not path.is_relative_to(Path(self.url)):
                raise ValueError(f"checkpoint {text} is outside this run's checkpoint root {self.url}: not read")
            return str(path)
        scheme, _, rest = text.partition("://")
        norm = f"{scheme}://{posixpath.normpath(rest).strip('/')}" if rest else text
        if ".." in rest.split("/") or not norm.startswith(self.url + "/"):
            raise ValueError(f"checkpoint {text} is outside this run's checkpoint root {self.url}: not read")
        return norm

    def write(self, name: str, files: Mapping[str, bytes]) -> str:
        """Write entry ``name`` holding ``files`` (file name -> bytes) whole; returns its URI."""
        if COMPLETE in files:
            raise ValueError(f"{COMPLETE} is the marker this root writes itself")
        final = self.entry(name)
        if self.local:
            _write_local(Path(final), files)
        else:
            for fname, data in files.items():
                self.fs.pipe_file(posixpath.join(self._path(final), fname), data)
            self.fs.pipe_file(posixpath.join(self._path(final), COMPLETE), name.encode())
        return final

    def complete(self, uri: str) -> bool:
        """Whether the entry at ``uri`` (checked by :meth:`within`) carries its marker (asked of the store, not
        of a listing this process cached: another process may have written it since)."""
        marker = posixpath.join(self._path(self.within(uri)), COMPLETE)
        self.fs.invalidate_cache(posixpath.dirname(marker))
        return bool(self.fs.exists(marker))

    def read(self, uri: str, fname: str) -> bytes:
        """File ``fname`` of the complete entry at ``uri``; FileNotFoundError when the entry is incomplete."""
        if not self.complete(uri):
            raise FileNotFoundError(f"checkpoint {uri} is incomplete or missing (no {COMPLETE} marker)")
        return bytes(self.fs.cat_file(posixpath.join(self._path(self.within(uri)), fname)))

    def names(self) -> list[str]:
        """The entries under the root, complete or not (temporary siblings excluded)."""
        self.fs.invalidate_cache(self._path(self.url))
        if not self.fs.exists(self._path(self.url)):
            return []
        found = [posixpath.basename(p.rstrip("/")) for p in self.fs.ls(self._path(self.url), detail=False)]
        return sorted(n for n in found if not n.startswith(".tmp-"))

    def delete(self, name: str) -> None:
        """Remove entry ``name``, its marker first (a reader never sees a marked entry losing files), one object
        at a time (bulk deletes need checksum headers not every S3-compatible server takes)."""
        path = self._path(self.entry(name))
        marker = posixpath.join(path, COMPLETE)
        if self.fs.exists(marker):
            self.fs.rm_file(marker)
        for f in self.fs.find(path):
            self.fs.rm_file(f)
        if self.local and self.fs.exists(path):
            self.fs.rm(path, recursive=True)
        self.fs.invalidate_cache(self._path(self.url))


class LocalFiles:
    """The few filesystem calls :class:`StorageRoot` makes, on local disk, with the standard library."""

    def exists(self, path: str) -> bool:
        return os.path.exists(path)

    def invalidate_cache(self, path: str | None = None) -> None:
        """Nothing is cached locally."""

    def cat_file(self, path: str) -> bytes:
        return Path(path).read_bytes()

    def pipe_file(self, path: str, data: bytes) -> None:
        Path(path).write_bytes(data)

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def ls(self, path: str, detail: bool = False) -> list[str]:
        return [str(p) for p in Path(path).iterdir()]

    def find(self, path: str) -> list[str]:
        return [str(p) for p in Path(path).rglob("*") if p.is_file()] if os.path.isdir(path) else []

    def rm_file(self, path: str) -> None:
        os.unlink(path)

    def rm(self, path: str, recursive: bool = False) -> None:
        shutil.rmtree(path)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: Any) -> None:
    """Write the buffer ``data`` to ``path`` atomically: temporary name, ``fsync``, ``os.replace``.

    Raises ``OSError`` (with the path) on failure, after removing the temporary file.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.tmp")
    view = memoryview(data).cast("B")
    try:
        with open(tmp, "wb", buffering=0) as fh:
            done = 0
            while done < view.nbytes:
                done += fh.write(view[done:])
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise OSError(e.errno, f"cannot write {path}: {e.strerror or e}") from e
        raise


def local_tmp(final: Path) -> Path:
    """A fresh temporary sibling of ``final`` to fill and then :func:`commit_local`."""
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def _write_local(final: Path, files: Mapping[str, bytes]) -> None:
    tmp = local_tmp(final)
    for fname, data in files.items():
        (tmp / fname).write_bytes(data)
    commit_local(tmp, final)


def commit_local(tmp: Path, final: Path) -> None:
    """Mark ``tmp`` complete, make it durable and rename it to ``final``: a crash leaves all of it or none."""
    (tmp / COMPLETE).write_text(final.name)
    for f in tmp.iterdir():
        _fsync(f)
    _fsync(tmp)
    if final.exists():  # the same writer saving the same entry again: same bytes
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync(final.parent)
