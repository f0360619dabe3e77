"""``write_tracking`` on a plain process that maps a file privately, as QEMU maps a restored
VM's memory: the preloaded library registers the mapping, the scan reports exactly the pages
written since the last scan, and a process without the library is reported untracked. The
snapshots of tracked VMs: tests/runtime/test_snapshot.py."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.runtime import guest_memory as gm
from aenv.runtime import write_tracking as wt

PAGES = 1024
# Maps argv[1] (argv[2] pages) privately and writable, writes page 3, then writes the pages
# named on each line of stdin (one byte each; "r<n>" reads page n) and answers "done".
CHILD = """
import mmap, os, sys
PAGES = int(sys.argv[2])
fd = os.open(sys.argv[1], os.O_RDONLY)
m = mmap.mmap(fd, PAGES * 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
m[3 * 4096] = 1
print("ready", flush=True)
for line in sys.stdin:
    for page in line.split():
        if page.startswith("r"):
            m[int(page[1:]) * 4096]
        else:
            m[int(page) * 4096] = 7
    print("done", flush=True)
"""


class Child:
    def __init__(self, memory: Path, env: dict[str, str] | None) -> None:
        self.memory = memory
        self.proc = subprocess.Popen([sys.executable, "-c", CHILD, str(memory), str(PAGES)],
                                     env={**os.environ, **(env or {})}, text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"
        self.mapping = gm.find_mapping(self.proc.pid, memory, PAGES * 4096)

    def write(self, *pages: int | str) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(" ".join(map(str, pages)) + "\n")
        self.proc.stdin.flush()
        assert self.proc.stdout.readline() == "done\n"

    def close(self) -> None:
        self.proc.kill()
        self.proc.wait()


@pytest.fixture
def memory(tmp_path: Path) -> Path:
    path = tmp_path / "memory"
    with open(path, "wb") as f:
        f.truncate(PAGES * 4096)
    return path


@pytest.fixture
def lib(tmp_path: Path) -> Path:
    built = wt.library(tmp_path / "native")
    if built is None:
        pytest.fail("the write-tracking library did not build (is a C compiler installed?)")
    return built


@pytest.fixture
def tracked(memory: Path, lib: Path) -> Iterator[Child]:
    child = Child(memory, wt.launch_env(lib, memory))
    yield child
    child.close()


def test_the_scan_reports_exactly_the_pages_written_since_the_last_one(tracked) -> None:
    pid, mapping = tracked.proc.pid, tracked.mapping
    assert wt.written_runs(pid, mapping)  # the first: everything, never protected
    assert wt.written_runs(pid, mapping) == []
    tracked.write(5, 6, 7, 900)
    assert wt.written_runs(pid, mapping) == [(5, 3), (900, 1)]
    assert wt.written_runs(pid, mapping) == []  # the scan protected them again
    tracked.write(7, 20)
    assert wt.written_runs(pid, mapping) == [(7, 1), (20, 1)]


def test_writes_through_proc_mem_are_seen_too(tracked) -> None:
    """The restore writes diff layers through /proc/PID/mem; so does nothing else, but a
    write that does not come from the process's own stores must still count."""
    pid, mapping = tracked.proc.pid, tracked.mapping
    assert wt.written_runs(pid, mapping)
    with gm.ProcessMemory(pid, mapping, write=True) as mem:
        mem.write(42, b"\x01" * 4096)
    assert wt.written_runs(pid, mapping) == [(42, 1)]


def test_a_process_without_the_library_is_untracked(memory: Path) -> None:
    child = Child(memory, None)
    try:
        assert wt.written_runs(child.proc.pid, child.mapping) is None
    finally:
        child.close()


def test_the_library_tracks_only_the_file_it_is_told(memory: Path, lib: Path,
                                                     tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.write_bytes(b"")
    child = Child(memory, wt.launch_env(lib, other))
    try:
        assert wt.written_runs(child.proc.pid, child.mapping) is None
    finally:
        child.close()


def test_the_token_is_taken_once_and_only_for_its_vmm(tmp_path: Path) -> None:
    wt.remember(tmp_path, 1234, tmp_path / "snap-a")
    assert wt.take(tmp_path, 999) is None  # another VMM's record: not ours, and gone
    assert wt.take(tmp_path, 1234) is None
    wt.remember(tmp_path, 1234, tmp_path / "snap-a")
    assert wt.take(tmp_path, 1234) == tmp_path / "snap-a"
    assert wt.take(tmp_path, 1234) is None  # a capture that fails leaves none
    (tmp_path / wt.TOKEN).write_text("{not json")
    assert wt.take(tmp_path, 1234) is None and not (tmp_path / wt.TOKEN).exists()


def test_the_library_is_built_once_per_source(tmp_path: Path) -> None:
    first = wt.library(tmp_path / "n")
    assert first is not None and first.exists()
    assert wt.library(tmp_path / "n") == first
    assert first.stat().st_mode & 0o777 == 0o755


def test_protection_markers_are_not_taken_for_written_pages(tracked) -> None:
    """Protecting a file mapping leaves a marker where no page was mapped; pagemap shows it
    as a swap entry, which ``guest_memory.private_runs`` must not count as a private page
    (it did: the first capture after the record started compared all of guest RAM)."""
    pid, mapping = tracked.proc.pid, tracked.mapping
    assert gm.private_runs(pid, mapping) == [(3, 1)]
    wt.written_runs(pid, mapping)
    assert gm.private_runs(pid, mapping) == [(3, 1)]
    tracked.write(10)
    assert gm.private_runs(pid, mapping) == [(3, 1), (10, 1)]


def test_only_mapped_pages_are_protected(tracked) -> None:
    """Protecting a page the process never mapped would leave a marker in a page table
    made for it: page tables for all of guest RAM. Such a page is left alone, and one the
    process maps by reading comes in unprotected: reported once (a superset is safe)."""
    pid, mapping = tracked.proc.pid, tracked.mapping
    assert wt.written_runs(pid, mapping) == [(3, 1)]
    with open(f"/proc/{pid}/pagemap", "rb") as f:
        f.seek((mapping.start // 4096 + 500) * 8)
        assert f.read(8) == bytes(8)  # nothing there: no marker
    tracked.write("r500")
    assert wt.written_runs(pid, mapping) == [(500, 1)]
    assert wt.written_runs(pid, mapping) == []
    tracked.write(500)
    assert wt.written_runs(pid, mapping) == [(500, 1)]


def test_runs_intersect() -> None:
    """What a tracked capture copies: the recorded pages that are also private."""
    assert gm.intersect_runs([(0, 10), (20, 5)], [(5, 20)]) == [(5, 5), (20, 5)]
    assert gm.intersect_runs([(0, 3)], [(3, 2)]) == []
    assert gm.intersect_runs([], [(1, 2)]) == []
    assert gm.intersect_runs([(0, 100)], [(1, 1), (5, 2), (99, 5)]) == [(1, 1), (5, 2),
                                                                        (99, 1)]
