"""Guest RAM of a live VMM, seen from the host through procfs: where the VMM maps it, which
pages the guest has written, and reading and writing those pages.

This is what makes snapshots of *restored* VMs incremental without help from the VMM. A
restored VM maps its memory file ``MAP_PRIVATE``: a page the guest only reads stays the
shared page-cache page of the file, and the first write to a page gives the process a
private anonymous copy. ``/proc/<pid>/pagemap`` tells the two apart per page (bit 63
present, bit 62 swapped, bit 61 file-backed or shared), so the pages that are present (or
swapped) and not file-backed are exactly the ones written since the mapping was made. No
dirty logging, no write protection, no VMM cooperation; it works the same under TCG and KVM
(KVM's writes go through the same host page tables) and for any VMM that maps a memory file
privately. The scan reads 8 bytes per guest page (4 MiB for 2 GiB) in a few milliseconds.

Needs root (or ptrace rights over the VMM) for pagemap flags and ``/proc/<pid>/mem``.
Callers must stop the vCPUs first; pages written while a scan or a copy runs are missed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from .base import VMError

PAGE_SIZE = 4096
_PM_ENTRY = 8
# The top byte of a little-endian pagemap entry: 0x80 present, 0x40 swapped, 0x20 file/shared.
# Classes: 1 present and private, 2 swapped and not file-backed, else 0.
_TOP_CLASS = bytes(1 if (b & 0xA0) == 0x80 else 2 if (b & 0x60) == 0x40 else 0
                   for b in range(256))
# The low byte of a swapped entry holds the swap type (bits 0-4, readable by root):
# 31 (SWP_PTE_MARKER) is no page at all but a marker, which userfaultfd write protection
# (``write_tracking``) leaves where a file-backed page was never mapped.
_MARKER_TYPE = bytes(1 if (b & 0x1F) == 0x1F else 0 for b in range(256))
# class + 3 * marker-type, per entry: private if present (1, 4: a present page's low byte
# is its frame number's, not a type) or swapped and not a marker (2).
_PRIVATE = bytes((0, 1, 1, 0, 1, 0) + (0,) * 250)
_RUN = re.compile(rb"\x01+")
_IO_CHUNK = 8 << 20  # bytes per read/write system call on process memory


class GuestMemoryError(VMError):
    """The VMM's guest-RAM mapping could not be found, scanned, read or written."""


@dataclass(frozen=True)
class Mapping:
    """Where a VMM maps a memory file: host virtual address ``start`` holds file offset
    ``offset``; ``length`` bytes."""

    start: int
    offset: int
    length: int


def find_mapping(pid: int, path: Path, size: int) -> Mapping:
    """The VMM's mapping of the whole of ``path`` (``size`` bytes, one contiguous range)."""
    target = str(path.resolve())
    found: list[Mapping] = []
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].rstrip("\n") == target:
                    lo, hi = (int(x, 16) for x in parts[0].split("-"))
                    found.append(Mapping(lo, int(parts[2], 16), hi - lo))
    except OSError as e:
        raise GuestMemoryError(f"cannot read the mappings of pid {pid}: {e}") from e
    if not found:
        raise GuestMemoryError(f"pid {pid} does not map {target}")
    found.sort(key=lambda m: m.offset)
    first = found[0]
    # The kernel may split one mmap into several VMAs (madvise); they must stay contiguous.
    end = first.offset
    for m in found:
        if m.offset != end or m.start - first.start != m.offset - first.offset:
            raise GuestMemoryError(f"pid {pid} maps {target} in pieces")
        end += m.length
    if first.offset != 0 or end < size:
        raise GuestMemoryError(f"pid {pid} maps only [{first.offset:#x}, {end:#x}) of {target}")
    return Mapping(first.start, 0, size)


def private_runs(pid: int, mapping: Mapping) -> list[tuple[int, int]]:
    """Runs ``(first_page, count)`` (file page numbers) of pages the process holds as
    private copies: for a ``MAP_PRIVATE`` file mapping, the pages written since mapping."""
    npages = mapping.length // PAGE_SIZE
    try:
        fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    except OSError as e:
        raise GuestMemoryError(f"cannot open the pagemap of pid {pid}: {e}") from e
    try:
        want = npages * _PM_ENTRY
        base = mapping.start // PAGE_SIZE * _PM_ENTRY
        chunks = []
        got = 0
        while got < want:
            chunk = os.pread(fd, want - got, base + got)
            if not chunk:
                raise GuestMemoryError(f"short pagemap read for pid {pid}")
            chunks.append(chunk)
            got += len(chunk)
    finally:
        os.close(fd)
    entries = b"".join(chunks)
    top = entries[_PM_ENTRY - 1::_PM_ENTRY].translate(_TOP_CLASS)
    marker = entries[0::_PM_ENTRY].translate(_MARKER_TYPE)
    # Per byte at most 2 + 3: the sum of the two as integers has no carries.
    combined = (int.from_bytes(top, "little") + 3 * int.from_bytes(marker, "little"))
    flags = combined.to_bytes(npages, "little").translate(_PRIVATE)
    first = mapping.offset // PAGE_SIZE
    return [(first + m.start(), m.end() - m.start()) for m in _RUN.finditer(flags)]


class ProcessMemory:
    """Read and write a VMM's guest RAM by file page number (``/proc/<pid>/mem``).

    Writing into a ``MAP_PRIVATE`` mapping makes private copies of the pages, exactly as a
    guest write would; the file underneath is never modified.
    """

    def __init__(self, pid: int, mapping: Mapping, *, write: bool = False) -> None:
        self.mapping = mapping
        try:
            self._fd = os.open(f"/proc/{pid}/mem", os.O_RDWR if write else os.O_RDONLY)
        except OSError as e:
            raise GuestMemoryError(f"cannot open the memory of pid {pid}: {e}") from e

    def _addr(self, page: int) -> int:
        return self.mapping.start + page * PAGE_SIZE - self.mapping.offset

    def read(self, page: int, count: int) -> bytes:
        want = count * PAGE_SIZE
        parts = []
        pos = 0
        while pos < want:
            chunk = os.pread(self._fd, min(_IO_CHUNK, want - pos), self._addr(page) + pos)
            if not chunk:
                raise GuestMemoryError(f"short read of guest page {page + pos // PAGE_SIZE}")
            parts.append(chunk)
            pos += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def read_into(self, page: int, view: memoryview) -> None:
        """Fill ``view`` from guest page ``page`` on (no allocation: the caller's buffer)."""
        pos = 0
        while pos < len(view):
            n = os.preadv(self._fd, [view[pos:pos + _IO_CHUNK]], self._addr(page) + pos)
            if n <= 0:
                raise GuestMemoryError(f"short read of guest page {page + pos // PAGE_SIZE}")
            pos += n

    def write(self, page: int, data: bytes | memoryview) -> None:
        view = memoryview(data)
        pos = 0
        while pos < len(view):
            n = os.pwrite(self._fd, view[pos:pos + _IO_CHUNK], self._addr(page) + pos)
            if n <= 0:
                raise GuestMemoryError(f"short write of guest page {page + pos // PAGE_SIZE}")
            pos += n

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> ProcessMemory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def intersect_runs(a: list[tuple[int, int]],
                   b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The pages in both ``a`` and ``b`` (each sorted runs ``(first_page, count)`` that do
    not overlap), as runs."""
    out: list[tuple[int, int]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        a_end, b_end = a[i][0] + a[i][1], b[j][0] + b[j][1]
        hi = min(a_end, b_end)
        if lo < hi:
            out.append((lo, hi - lo))
        if a_end <= b_end:
            i += 1
        else:
            j += 1
    return out


def split_runs(runs: list[tuple[int, int]], max_pages: int) -> Iterator[tuple[int, int]]:
    """``runs`` cut into pieces of at most ``max_pages`` (bounded buffers)."""
    for start, count in runs:
        while count > 0:
            n = min(count, max_pages)
            yield start, n
            start += n
            count -= n
