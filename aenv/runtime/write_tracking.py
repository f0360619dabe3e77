"""Which guest pages a restored VM wrote since a chosen moment, from the kernel's own record:
userfaultfd write protection in asynchronous mode, read and re-armed in one step by the
``PAGEMAP_SCAN`` ioctl of ``/proc/PID/pagemap`` (both Linux 6.7+).

Why: a restored VM's snapshot (``qemu_snapshot._capture_private``) otherwise compares every
page the guest wrote since its restore with the layer stack, with the guest frozen, so each
snapshot of a long-lived VM costs more than the last (issue 21: snapshots while the guest
writes, p99 150 ms). With the pages written since the parent snapshot known, it compares
only those. This kernel has neither soft-dirty bits nor idle-page tracking; write
protection also sees writes that bypass the page tables' dirty bits (``O_DIRECT`` and
io_uring into guest RAM take the write fault like the guest does).

How: a userfaultfd belongs to the process that creates it, so QEMU makes it —
``track_writes.c``, preloaded (``launch_env``), registers the guest RAM mapping as soon as
QEMU maps it. The server never reads the descriptor. ``written_runs`` asks the kernel for
the pages whose protection a write removed and protects them again, atomically, while the
vCPUs are stopped.

The record is only as good as its start, so the VM's working directory keeps a token
(``TOKEN``: the VMM's pid and the snapshot the record starts at). A capture takes the token
away before it re-arms (``take``) and writes the new one only once its snapshot is
committed (``remember``); a capture that fails in between leaves no token, and the next one
compares every written page, as without tracking. A restore starts the record once its
layers are written and names the snapshot it restored (the layers it wrote are that
snapshot's). Only mapped pages are protected (``_MAPPED``), so the record costs no page
tables beyond those the guest's own pages need.

The library is compiled on first use with the host's C compiler into the artifacts
directory (``library``); without a compiler, or on an older kernel, nothing is tracked and
snapshots work as before (logged once).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import struct
import subprocess
import threading
from pathlib import Path

from .guest_memory import PAGE_SIZE, GuestMemoryError, Mapping

log = logging.getLogger("aenv.runtime")

SOURCE = Path(__file__).with_name("track_writes.c")
ENV_TARGET = "AENV_TRACK_WRITES"  # the memory file the library registers (track_writes.c)
TOKEN = "memory.tracking"  # in the VM's working directory: {"pid", "since"}

# <linux/fs.h>: PAGEMAP_SCAN = _IOWR('f', 16, struct pm_scan_arg), 96 bytes.
_PAGEMAP_SCAN = (3 << 30) | (96 << 16) | (ord("f") << 8) | 16
_PM_SCAN_WP_MATCHING = 1 << 0  # write-protect the pages that matched
_PM_SCAN_CHECK_WPASYNC = 1 << 1  # fail (EPERM) on a range not registered for async WP
_PAGE_IS_WRITTEN = 1 << 1
_PAGE_IS_PRESENT = 1 << 3
_PAGE_IS_SWAPPED = 1 << 4
# Only pages that are there (present or swapped) are reported and protected. To the kernel
# a never-mapped page is "written" (it is not protected), and protecting it would leave a
# marker in its page table entry, making page tables for all of guest RAM (~2 KiB per MiB).
# Such a page, when the guest first maps it, comes in unprotected and is reported then.
_MAPPED = _PAGE_IS_PRESENT | _PAGE_IS_SWAPPED
_REGION = struct.Struct("<QQQ")  # struct page_region: start, end, categories
_REGIONS = 16384  # per ioctl call; the scan resumes at walk_end when they run out

_build_lock = threading.Lock()
_built: dict[Path, Path | None] = {}


def library(directory: Path) -> Path | None:
    """The compiled ``track_writes.c`` in ``directory`` (named by the source's digest, so a
    changed source builds anew), compiled now if missing. None when it cannot be built
    (no C compiler): the caller runs VMMs without it."""
    with _build_lock:
        if directory in _built:
            return _built[directory]
        source = SOURCE.read_bytes()
        target = directory / f"track-writes-{hashlib.sha256(source).hexdigest()[:16]}.so"
        built = target if target.exists() else _compile(target)
        _built[directory] = built
        return built


def _compile(target: Path) -> Path | None:
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.warning("no C compiler: VMMs run without write tracking, and each snapshot of a "
                    "restored VM compares every page it wrote since its restore")
        return None
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}")
    try:
        subprocess.run([cc, "-shared", "-fPIC", "-O2", "-Wall", "-o", str(partial),
                        str(SOURCE)], check=True, capture_output=True, timeout=120)
        os.chmod(partial, 0o755)  # loaded by QEMU before it drops to its own uid
        os.replace(partial, target)
    except (OSError, subprocess.SubprocessError) as e:
        partial.unlink(missing_ok=True)
        detail = getattr(e, "stderr", b"") or b""
        log.warning("cannot build the write-tracking library (%s%s): snapshots compare "
                    "every written page", e, f": {detail.decode(errors='replace')[:500]}"
                    if detail else "")
        return None
    return target


def launch_env(lib: Path, memory_file: Path) -> dict[str, str]:
    """What to add to QEMU's environment so that ``lib`` tracks its mapping of
    ``memory_file``."""
    return {"LD_PRELOAD": str(lib), ENV_TARGET: str(memory_file)}


def written_runs(pid: int, mapping: Mapping) -> list[tuple[int, int]] | None:
    """Runs ``(first_page, count)`` (file page numbers) of the pages written since the last
    call, which protects them, and every other mapped page, again: the record starts anew.
    The first call reports every mapped page, and later calls also report a page the guest
    mapped by reading it since (it came in unprotected): a superset of the written ones.
    None when the mapping is not tracked (the caller must then compare every written
    page). The vCPUs must be stopped."""
    try:
        fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    except OSError as e:
        raise GuestMemoryError(f"cannot open the pagemap of pid {pid}: {e}") from e
    vec = (ctypes.c_uint64 * (3 * _REGIONS))()
    first = mapping.offset // PAGE_SIZE
    runs: list[tuple[int, int]] = []
    start, end = mapping.start, mapping.start + mapping.length
    try:
        while start < end:
            arg = bytearray(struct.pack(
                "<12Q", 96, _PM_SCAN_WP_MATCHING | _PM_SCAN_CHECK_WPASYNC, start, end, 0,
                ctypes.addressof(vec), _REGIONS, 0, 0, _PAGE_IS_WRITTEN, _MAPPED,
                _PAGE_IS_WRITTEN))
            try:
                n = fcntl.ioctl(fd, _PAGEMAP_SCAN, arg, True)
            except OSError as e:
                if e.errno in (errno.EPERM, errno.EINVAL, errno.ENOTTY):
                    return None  # not registered, or a kernel without PAGEMAP_SCAN
                raise GuestMemoryError(f"PAGEMAP_SCAN of pid {pid} failed: {e}") from e
            raw = bytes(memoryview(vec).cast("B")[:n * _REGION.size])
            for lo, hi, _ in _REGION.iter_unpack(raw):
                runs.append((first + (lo - mapping.start) // PAGE_SIZE, (hi - lo) // PAGE_SIZE))
            walk_end = struct.unpack_from("<Q", arg, 32)[0]
            if n < _REGIONS or walk_end <= start:
                break
            start = walk_end
    finally:
        os.close(fd)
    return runs


def remember(workdir: Path, pid: int, since: Path) -> None:
    """Record that VMM ``pid``'s written pages are tracked since snapshot ``since``."""
    tmp = workdir / f".{TOKEN}"
    tmp.write_text(json.dumps({"pid": pid, "since": str(since)}))
    os.replace(tmp, workdir / TOKEN)


def take(workdir: Path, pid: int) -> Path | None:
    """Remove the token and return the snapshot VMM ``pid``'s record starts at (None: no
    token, or another VMM's). Called before a capture re-arms."""
    path = workdir / TOKEN
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        data = None
    path.unlink(missing_ok=True)
    if not isinstance(data, dict) or data.get("pid") != pid or not data.get("since"):
        return None
    return Path(str(data["since"]))
