"""Merging a snapshot's memory stack in the background (issue 21: heavy work off the capture).

A capture of a restored VM adds one diff layer on its parent's stack (``snapshots``'s
"Memory is a stack of layers"). It used to keep stacks short by diffing against the base
alone once the stack held ``max_chain`` diffs, comparing every page written since the
restore with the guest frozen: one capture in five was slow. Now captures always add a
plain diff, and the compaction that runs after a capture (``aenv.runtime.compaction``,
through the driver's ``prepare_compaction``) merges the stack of a snapshot whose manifest
names more than ``max_chain`` diffs into ONE diff layer of that snapshot, ``memory.merged``,
so its manifest names (base, merged). For every page that any diff holds, the merged layer
holds the copy of the topmost diff that has it (``owner_map``), so the stack gives the same
guest memory before and after, and a VM running on that lineage diffs its next capture
against either stack alike. The copy runs in the kernel (``copy_file_range``), one call per
run of pages owned by one layer. ``compacts_inline`` keeps inline compaction as a safety
valve only, for a stack that grew to ``INLINE_FACTOR * max_chain`` diffs (the background
did not keep up).

The steps (``MemoryCompaction``; the caller holds the node's snapshot lock for ``install``
and ``release``, which also serialises captures and garbage collection):

- ``prepare`` (no lock): the merged layer is written to hidden files in the snapshot
  directory (``.memory.merged.compacting`` and its runs; hidden files are never published)
  and fsynced. Leftovers of an interrupted compaction are removed first.
- ``install``: both files are renamed to ``memory.merged`` (+ ``.runs``), the directory
  fsynced, then the manifest is rewritten atomically to name (base, merged) and to list the
  old stack's layer files of *other* snapshots as ``retired``: a restore that read the old
  manifest may still be opening them, and garbage collection keeps what ``retired`` names.
  Nothing is deleted: other snapshots' layer files stay where they are (other manifests
  may name them), and so does this snapshot's own ``memory`` (its children's stacks name it).
- ``release`` (a while later): the manifest drops ``retired``; from then on collection may
  take ancestors nothing else names.

Crash safety: the manifest rewrite is the one step that changes what the snapshot is, and
it is atomic and durable (``durable.write_atomic``) and made only after the merged files
are durable under their final names. Before it the manifest names the old stack, whose
files are untouched (a crash leaves hidden files, or unnamed ``memory.merged`` files, that
the next ``prepare`` removes and writes again); after it the manifest names files already
durable, and the retired ones are still kept, so a crash before ``release`` leaves a
snapshot whose next ``prepare`` (``Compactor.recover`` at start-up) returns a release-only
job. Snapshots whose memory is pending or abandoned (a deferred pause's) are left alone:
their memory write rewrites the manifest itself.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re
from collections.abc import Sequence
from pathlib import Path

from . import durable
from . import snapshots as snap
from .errors import StorageError

MERGED = "memory.merged"
_STAGED = f".{MERGED}.compacting"  # the merged layer while it is written (hidden)
_STAGED_RUNS = f".{MERGED}.runs.compacting"
INLINE_FACTOR = 2  # a capture compacts inline only on a stack of this many times max_chain
_COPY_CHUNK = 8 << 20  # bytes per copy call (and the fallback's buffer)
_ANY_RUN = re.compile(rb"[^\x00]+")


def compacts_inline(depth: int, max_chain: int) -> bool:
    """Whether a capture on a stack of ``depth`` diff layers must compact within the
    capture: only when one more diff would pass ``INLINE_FACTOR * max_chain``, i.e. the
    background merges (which start above ``max_chain``) fell that far behind."""
    return depth >= INLINE_FACTOR * max_chain


def needs_merge(manifest: snap.Manifest, max_chain: int) -> bool:
    """More than ``max_chain`` diff layers: the background merges them."""
    return manifest.diff_depth > max_chain


def _copy(src: int, dst: int, offset: int, length: int) -> None:
    """``length`` bytes at ``offset`` from ``src`` to the same offset of ``dst``, in the
    kernel (``copy_file_range``); a read and a write where that is refused (another
    filesystem on old kernels, or one without the call)."""
    end = offset + length
    pos = offset
    while pos < end:
        try:
            n = os.copy_file_range(src, dst, min(end - pos, _COPY_CHUNK), pos, pos)
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            n = _copy_plain(src, dst, pos, min(end - pos, _COPY_CHUNK))
        if n <= 0:  # layer files are full size: only a truncated file gets here
            raise snap.SnapshotFilesError(f"short read of a memory layer at {pos:#x}")
        pos += n


def _copy_plain(src: int, dst: int, offset: int, length: int) -> int:
    buf = bytearray(length)
    n = os.preadv(src, [buf], offset)
    view = memoryview(buf)[:n]
    done = 0
    while done < n:
        done += os.pwrite(dst, view[done:], offset + done)
    return n


def merge(layers: Sequence[snap.MemoryLayer], npages: int, data: Path,
          runs: Path) -> int:
    """Write the diff layers of ``layers`` (base first) merged into one diff layer: the
    sparse file ``data`` (new, of ``npages`` pages) and its runs file ``runs``; both
    fsynced. Returns the pages it holds."""
    owners = snap.owner_map(layers, npages)
    fd = os.open(data, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        os.ftruncate(fd, npages * snap.PAGE_SIZE)
        for index in range(1, len(layers)):
            src = os.open(layers[index].path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                for start, count in snap.runs_where(owners, index):
                    off, length = start * snap.PAGE_SIZE, count * snap.PAGE_SIZE
                    _copy(src, fd, off, length)
                    durable.start_writeback(fd, off, length)
            finally:
                os.close(src)
        os.fsync(fd)
    finally:
        os.close(fd)
    merged = [(m.start(), m.end() - m.start()) for m in _ANY_RUN.finditer(owners)]
    snap.write_runs(runs, merged)
    durable.fsync_file(runs)
    return sum(n for _, n in merged)


@dataclasses.dataclass
class MemoryCompaction:
    """One snapshot's merge (module docstring): ``old`` is the stack its manifest named
    when the merge was made; ``merged`` the new layer, None when the merge was installed
    already and only the release is left (a server that stopped in between)."""

    directory: Path
    old: tuple[snap.MemoryLayer, ...]
    merged: snap.MemoryLayer | None

    def install(self) -> bool:
        """Under the snapshot lock: the merged files under their names, then the manifest
        (atomic). False, with nothing changed, when the snapshot went or its stack is no
        longer the one merged."""
        if self.merged is None:
            return True
        try:
            manifest = snap.read_manifest(self.directory)
        except StorageError:
            self.discard()
            return False
        if manifest.layers != self.old or _busy(self.directory):
            self.discard()
            return False
        os.replace(self.directory / _STAGED_RUNS, self.merged.runs_path)
        os.replace(self.directory / _STAGED, self.merged.path)
        durable.fsync_dir(self.directory)
        retired = tuple(la.path for la in self.old[1:] if la.directory != self.directory)
        snap.rewrite_manifest(self.directory, dataclasses.replace(
            manifest, layers=(self.old[0], self.merged),
            retired=tuple(dict.fromkeys((*manifest.retired, *retired))),
            sizes={**manifest.sizes, "memory_merged": snap.allocated(self.merged.path)}))
        return True

    def release(self) -> None:
        """Under the snapshot lock, a while after ``install``: the retired layers are no
        longer kept for this snapshot."""
        try:
            manifest = snap.read_manifest(self.directory)
        except StorageError:
            return  # collected meanwhile
        if manifest.retired:
            snap.rewrite_manifest(self.directory, dataclasses.replace(manifest, retired=()))

    def discard(self) -> None:
        for name in (_STAGED, _STAGED_RUNS):
            (self.directory / name).unlink(missing_ok=True)


def _busy(directory: Path) -> bool:
    """A deferred pause's snapshot: its memory write owns the manifest's layers."""
    return snap.memory_pending(directory) or snap.memory_abandoned(directory)


def prepare(directory: Path, max_chain: int) -> MemoryCompaction | None:
    """The merge of snapshot ``directory``'s stack when it has more than ``max_chain``
    diffs, written and fsynced (hidden) but not installed; a release-only job when a merge
    was installed and not released; else None. Leftovers of an interrupted merge go first.
    O(pages in the diff layers), in the kernel."""
    try:
        manifest = snap.read_manifest(directory)
    except StorageError:
        return None
    job = MemoryCompaction(directory, manifest.layers, None)
    job.discard()  # an interrupted prepare's
    if _busy(directory):
        return None
    final = snap.MemoryLayer(directory, "diff", 0, MERGED)
    if not any(la.path == final.path for la in manifest.layers):
        # Renamed by an install that died before the manifest named them: nobody reads them.
        final.path.unlink(missing_ok=True)
        final.runs_path.unlink(missing_ok=True)
    if not needs_merge(manifest, max_chain):
        return job if manifest.retired else None
    try:
        pages = merge(manifest.layers, manifest.npages, directory / _STAGED,
                      directory / _STAGED_RUNS)
    except BaseException:
        job.discard()
        raise
    job.merged = dataclasses.replace(final, pages=pages)
    return job
