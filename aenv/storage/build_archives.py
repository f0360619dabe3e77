"""The server side of a template's COPY archives: storing an upload, checking what an
archive holds, and checking it against the step's ``filesHash``.

Storing (``store_upload``): the body streams into a temporary file of its own beside
the final one (written from the event loop into the page cache, never held whole in
memory), is fsync'ed in a thread, checked (``inspect_archive``), then linked into place,
which fails rather than replaces when another upload got there first; the directory is
fsync'ed after. An archive already stored for a hash is never rewritten, so a finished
archive is the first complete upload and nothing else. What was uploaded is checked
against ``filesHash`` only at build start, because the hash covers the COPY step's
``src`` and ``dest``, which an upload does not carry.

``filesHash`` (E2B SDK ``calculate_files_hash``; the JS SDK's ``calculateFilesHash`` and
aenv's ``client/build_files.py`` follow it): sha256 of ``"COPY <src> <dest>"``, then for
each selected path in sorted order its path relative to the context, ``str(st_mode)``,
``str(st_size)`` (Python: not for directories), then its link target (a symlink kept
as a link) or its content (a regular file). The SDK's archive holds exactly those paths
(relative names, the permission bits, the type, the size, the content or link target),
so the hash can be recomputed from it (``verify_files_hash``) except:

* the JS SDK hashes directories' ``st_size`` too, a property of the uploader's
  filesystem that no archive carries: an archive with directories that fails the
  Python rule is ``UNVERIFIABLE``, not ``MISMATCH``;
* the Python SDK on Windows joins relative paths with ``\\``: tried as a second rule.

An archive without directories that matches neither rule is a ``MISMATCH``.
``check_before_copy`` is that check as a build runs it: a mismatching archive is deleted
and the step fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import hashlib
import os
import stat
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO

from . import durable

_CHUNK = 1 << 20
# Leftovers of uploads that died with the server; a live upload is never this old.
STALE_PART_S = 24 * 3600
_TYPE_BITS = {
    tarfile.REGTYPE: stat.S_IFREG, tarfile.AREGTYPE: stat.S_IFREG,
    tarfile.CONTTYPE: stat.S_IFREG, tarfile.LNKTYPE: stat.S_IFREG,
    tarfile.DIRTYPE: stat.S_IFDIR, tarfile.SYMTYPE: stat.S_IFLNK,
    tarfile.FIFOTYPE: stat.S_IFIFO, tarfile.CHRTYPE: stat.S_IFCHR,
    tarfile.BLKTYPE: stat.S_IFBLK,
}


class ArchiveError(Exception):
    """The upload is not an archive a COPY step can use; the message says why."""


class HashCheck(enum.Enum):
    MATCH = "match"
    MISMATCH = "mismatch"
    UNVERIFIABLE = "unverifiable"


class FilesHashMismatch(Exception):
    """A COPY step's archive does not hold what its ``filesHash`` names; the message
    says so in the build log's words."""


def inspect_archive(path: Path) -> list[tarfile.TarInfo]:
    """The members of a (possibly gzip'ed) tar, or ArchiveError when it is not one, has
    no members, or has a member outside the archive's root or of an unknown type."""
    try:
        with tarfile.open(path, "r:*") as tar:
            return _members(tar)
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ArchiveError(f"not a readable tar archive: {e}") from None


def _members(tar: tarfile.TarFile) -> list[tarfile.TarInfo]:
    members = tar.getmembers()
    if not members:
        raise ArchiveError("the archive is empty")
    for m in members:
        if m.name.startswith("/") or ".." in m.name.split("/"):
            raise ArchiveError(f"archive member '{m.name}' is outside the archive's root")
        if m.type not in _TYPE_BITS:
            raise ArchiveError(f"archive member '{m.name}' has an unsupported type")
    return members


def verify_files_hash(path: Path, *, src: str, dest: str, files_hash: str) -> HashCheck:
    """Recompute ``filesHash`` of COPY ``src`` ``dest`` from the archive at ``path``.

    Reads the whole archive (twice when it is gzip'ed, once for the member list and once
    for the content); call it off the event loop. Raises ArchiveError when the archive
    is not usable at all.
    """
    try:
        with tarfile.open(path, "r:*") as tar:
            members = _members(tar)
            digests = _digests(tar, members, f"COPY {src} {dest}".encode())
    except (tarfile.TarError, EOFError, OSError) as e:
        raise ArchiveError(f"not a readable tar archive: {e}") from None
    if files_hash.lower() in digests:
        return HashCheck.MATCH
    if any(m.isdir() for m in members):
        return HashCheck.UNVERIFIABLE
    return HashCheck.MISMATCH


def _digests(tar: tarfile.TarFile, members: list[tarfile.TarInfo], head: bytes) -> set[str]:
    """The hash under each path-separator rule (one for archives without subdirectories)."""
    by_name = {m.name: m for m in members}
    files = [m for m in members if m.name]
    # The SDK sorts absolute paths; with the context directory itself ("." as a member)
    # first, that is the order of the relative names.
    rules: list[tuple[str, list[tarfile.TarInfo]]] = [
        ("/", sorted(files, key=lambda m: (m.name != ".", m.name)))]
    if any("/" in m.name for m in files):
        rules.append(("\\", sorted(files, key=lambda m: (m.name != ".",
                                                          m.name.replace("/", "\\")))))
    if len(rules) == 2 and rules[0][1] == rules[1][1]:
        passes = [[("/", hashlib.sha256(head)), ("\\", hashlib.sha256(head))]]
        orders = [rules[0][1]]
    else:
        passes = [[(sep, hashlib.sha256(head))] for sep, _ in rules]
        orders = [order for _, order in rules]
    for order, hashers in zip(orders, passes, strict=True):
        for m in order:
            _hash_member(tar, m, by_name, hashers)
    return {h.hexdigest() for hashers in passes for _, h in hashers}


def _hash_member(tar: tarfile.TarFile, m: tarfile.TarInfo, by_name: dict[str, tarfile.TarInfo],
                 hashers: list[tuple[str, hashlib._Hash]]) -> None:
    def update(data: bytes) -> None:
        for _, h in hashers:
            h.update(data)

    for sep, h in hashers:
        h.update(m.name.replace("/", sep).encode("utf-8", "surrogateescape"))
    update(str(_TYPE_BITS[m.type] | (m.mode & 0o7777)).encode())
    if m.isdir():
        return
    if m.issym():
        target = os.fsencode(m.linkname)
        update(str(len(target)).encode())
        update(target)
        return
    size = m.size
    if m.islnk():  # a hard link: the SDK hashed the file it names
        linked = by_name.get(m.linkname)
        size = linked.size if linked is not None else 0
    update(str(size).encode())
    if m.isreg() or m.islnk():
        f = tar.extractfile(m)
        if f is None:
            raise ArchiveError(f"archive member '{m.name}' has no content")
        with f:
            while chunk := f.read(_CHUNK):
                update(chunk)


async def check_before_copy(path: Path, *, src: str, dest: str, files_hash: str) -> HashCheck:
    """What a build runs before a COPY step sends ``path`` to the VM. ``src`` and
    ``dest`` are the step's ``args[0]`` and ``args[1]`` as the client sent them.

    Runs ``verify_files_hash`` in a thread. On a MISMATCH, or an archive that cannot be
    read, the archive is deleted (so that the next upload link says ``present:false``
    and a correct upload can take its place) and FilesHashMismatch is raised. MATCH and
    UNVERIFIABLE are returned; the caller should log the latter.
    """
    try:
        verdict = await asyncio.to_thread(verify_files_hash, path, src=src, dest=dest,
                                          files_hash=files_hash)
        problem = "do not match" if verdict is HashCheck.MISMATCH else None
    except ArchiveError as e:
        verdict, problem = HashCheck.MISMATCH, f"cannot be read ({e}) and so do not match"
    if problem is None:
        return verdict
    path.unlink(missing_ok=True)
    raise FilesHashMismatch(
        f"the files uploaded for COPY {src} {dest} {problem} their hash {files_hash}; "
        "they were discarded, build again to upload them anew")


class UploadTooLarge(Exception):
    """More than the upload limit arrived."""


async def store_upload(chunks: AsyncIterator[bytes], final: Path, *, limit: int) -> bool:
    """Stream ``chunks`` into ``final`` (see the module docstring). True when this upload
    is the one stored; False when an archive for that name already was, in which case
    the body is read to its end (so the client gets its answer) and dropped.

    Raises UploadTooLarge past ``limit`` bytes, ArchiveError for a body that is not a
    usable archive; nothing of this upload is left behind either way.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    await asyncio.to_thread(remove_stale_parts, final.parent)
    if final.exists():
        await _drain(chunks, limit)
        return False
    fd, tmp_name = tempfile.mkstemp(dir=final.parent, prefix=f".{final.name}.", suffix=".part")
    tmp = Path(tmp_name)
    try:
        size = 0
        with os.fdopen(fd, "wb") as f:
            async for chunk in chunks:
                size += len(chunk)
                if size > limit:
                    raise UploadTooLarge()
                f.write(chunk)
            await asyncio.to_thread(_flush_and_sync, f)
        await asyncio.to_thread(inspect_archive, tmp)
        return await asyncio.to_thread(_link_into_place, tmp, final)
    finally:
        tmp.unlink(missing_ok=True)


async def _drain(chunks: AsyncIterator[bytes], limit: int) -> None:
    size = 0
    async for chunk in chunks:
        size += len(chunk)
        if size > limit:
            raise UploadTooLarge()


def _flush_and_sync(f: IO[bytes]) -> None:
    f.flush()
    os.fsync(f.fileno())


def _link_into_place(tmp: Path, final: Path) -> bool:
    """Atomically give ``tmp``'s (synced) content the name ``final`` unless it exists."""
    try:
        os.link(tmp, final)
    except FileExistsError:
        return False
    durable.fsync_dir(final.parent)
    return True


def remove_stale_parts(directory: Path, older_than: float = STALE_PART_S) -> None:
    """Delete temporary files of uploads that stopped more than ``older_than`` s ago."""
    cutoff = time.time() - older_than
    for part in directory.glob(".*.part"):
        with contextlib.suppress(FileNotFoundError):
            if part.stat().st_mtime < cutoff:
                part.unlink()
