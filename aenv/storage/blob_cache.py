"""The registry blob cache: manifests, configs and layers by sha256 digest, shared by
every pull and template on the host, bounded in size.

Layout under ``root``: ``sha256/<hex>`` the verified blobs (read-only once there),
``tmp/`` downloads in progress, ``locks/`` one pair of lock files per blob.

Contract:
- A blob appears under its name only whole and verified: it is written to ``tmp/``,
  hashed while written, fsynced, and renamed into place (then the directory is fsynced).
  A file whose hash is not its name is never renamed: ``DigestMismatch``.
- ``writing(digest)`` holds the blob's download lock (``flock``, exclusive): two pulls of
  one blob in two processes download it once; the second finds it present.
- ``use(digest)`` pins a blob (a shared ``flock``) for as long as the caller holds it, and
  marks it used now (its mtime: least recently used is oldest mtime). ``collect()``
  deletes unpinned blobs, least recently used first, until the cache holds at most
  ``max_bytes``; it takes each victim's pin lock exclusively without waiting, so a blob
  any pull holds is never deleted. Pinned blobs may keep the cache above its bound until
  they are released. Lock files are removed with their blob; a lock taken on a file that
  was removed meanwhile is retaken on the new one (the inode is compared), so a pin is
  never held on a dead file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import re
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from .durable import fsync_dir
from .registry_errors import BadReference, DigestMismatch

_HEX = re.compile(r"[a-f0-9]{64}")


def digest_hex(digest: str) -> str:
    """The hex part of a ``sha256:<hex>`` digest; any other algorithm is refused."""
    algo, _, hexdigest = digest.partition(":")
    if algo != "sha256" or not _HEX.fullmatch(hexdigest):
        raise BadReference(f"unsupported digest {digest!r} (only sha256 is read)")
    return hexdigest


@dataclass(frozen=True)
class Collected:
    """What one ``collect()`` did: blobs and bytes removed, bytes kept, pinned skipped."""

    removed: int
    removed_bytes: int
    kept_bytes: int
    pinned: int


class BlobWriter:
    """A download in progress: bytes go to a temp file and into a sha256."""

    def __init__(self, file: BinaryIO, digest: str, size: int | None, what: str) -> None:
        self.file = file
        self.digest = digest
        self.size = size
        self.what = what
        self.written = 0
        self._hash = hashlib.sha256()

    def write(self, chunk: bytes) -> None:
        self.written += len(chunk)
        if self.size is not None and self.written > self.size:
            raise DigestMismatch(f"{self.what} {self.digest} is longer than the {self.size} "
                                 "bytes its descriptor gives")
        self._hash.update(chunk)
        self.file.write(chunk)

    def check(self) -> None:
        got = "sha256:" + self._hash.hexdigest()
        if got != self.digest:
            raise DigestMismatch(f"{self.what} {self.digest} does not match its digest: "
                                 f"the registry sent {self.written} bytes hashing to {got}")
        if self.size is not None and self.written != self.size:
            raise DigestMismatch(f"{self.what} {self.digest} has {self.written} bytes, its "
                                 f"descriptor gives {self.size}")


class BlobCache:
    """Blobs by digest under ``root``, at most ``max_bytes`` of unpinned ones kept."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.blobs = root / "sha256"
        self.tmp = root / "tmp"
        self.locks = root / "locks"
        for d in (self.blobs, self.tmp, self.locks):
            d.mkdir(parents=True, exist_ok=True)

    def path(self, digest: str) -> Path:
        return self.blobs / digest_hex(digest)

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def read(self, digest: str) -> bytes | None:
        """A cached blob's bytes (re-verified: small blobs only, manifests and configs),
        or None when it is not cached or no longer matches."""
        try:
            data = self.path(digest).read_bytes()
        except FileNotFoundError:
            return None
        if "sha256:" + hashlib.sha256(data).hexdigest() != digest:
            return None
        return data

    @contextlib.contextmanager
    def use(self, digest: str) -> Iterator[Path]:
        """Pin ``digest`` for the block (``collect`` leaves it alone) and mark it used."""
        hexdigest = digest_hex(digest)
        fd = _lock(self.locks / f"{hexdigest}.pin", fcntl.LOCK_SH)
        try:
            path = self.blobs / hexdigest
            with contextlib.suppress(FileNotFoundError):
                os.utime(path)
            yield path
        finally:
            os.close(fd)

    @contextlib.contextmanager
    def writing(self, digest: str, size: int | None = None, *, what: str = "blob"
                ) -> Iterator[BlobWriter | None]:
        """The blob's download, under its download lock: None when it is (by now)
        cached, else a writer whose bytes become the blob when the block ends without
        an error and they match ``digest`` (and ``size``)."""
        hexdigest = digest_hex(digest)
        fd = _lock(self.locks / f"{hexdigest}.download", fcntl.LOCK_EX)
        try:
            final = self.blobs / hexdigest
            if final.is_file():
                yield None
                return
            tmp_fd, tmp = tempfile.mkstemp(prefix=f"{hexdigest}.", dir=self.tmp)
            try:
                with os.fdopen(tmp_fd, "wb") as f:
                    writer = BlobWriter(f, digest, size, what)
                    yield writer
                    writer.check()
                    f.flush()
                    os.fsync(f.fileno())
                os.chmod(tmp, 0o444)
                os.rename(tmp, final)
                fsync_dir(self.blobs)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp)
        finally:
            os.close(fd)

    def put(self, digest: str, data: bytes, *, what: str = "blob") -> None:
        """Store ``data`` (already fetched, e.g. a manifest) under ``digest``."""
        with self.writing(digest, len(data), what=what) as writer:
            if writer is not None:
                writer.write(data)

    def size(self) -> int:
        """Bytes of every cached blob."""
        return sum(size for _, size, _ in self._entries())

    def _entries(self) -> list[tuple[str, int, float]]:
        """(hex, bytes, mtime) of every cached blob."""
        out = []
        with os.scandir(self.blobs) as it:
            for entry in it:
                if not _HEX.fullmatch(entry.name):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                out.append((entry.name, st.st_size, st.st_mtime))
        return out

    def collect(self) -> Collected:
        """Delete least recently used unpinned blobs until at most ``max_bytes`` remain,
        and downloads left in ``tmp/`` by a process that died."""
        self._sweep_tmp()
        entries = sorted(self._entries(), key=lambda e: e[2])
        total = sum(size for _, size, _ in entries)
        removed = removed_bytes = pinned = 0
        for hexdigest, size, _ in entries:
            if total <= self.max_bytes:
                break
            pin = self.locks / f"{hexdigest}.pin"
            try:
                fd = _lock(pin, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pinned += 1
                continue
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.blobs / hexdigest)
                    removed += 1
                    removed_bytes += size
                    total -= size
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(pin)
            finally:
                os.close(fd)
        if removed:
            fsync_dir(self.blobs)
        return Collected(removed, removed_bytes, total, pinned)

    def _sweep_tmp(self) -> None:
        with os.scandir(self.tmp) as it:
            names = [e.name for e in it]
        for name in names:
            hexdigest = name.partition(".")[0]
            if not _HEX.fullmatch(hexdigest):
                continue
            try:
                fd = _lock(self.locks / f"{hexdigest}.download",
                           fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # being downloaded right now
            try:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.tmp / name)
            finally:
                os.close(fd)


def _lock(path: Path, mode: int) -> int:
    """An open descriptor of ``path`` holding ``flock(mode)``; retaken when the file was
    replaced (removed by ``collect``) between the open and the lock."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, mode)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                raise BlockingIOError(e.errno, f"{path} is locked") from None
            raise
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)
