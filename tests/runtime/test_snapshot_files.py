"""The pieces under VM snapshots, without VMs: the snapshot directory layout
(``aenv.storage.snapshots``) and finding and copying the pages a process wrote into a
privately mapped file (``aenv.runtime.guest_memory``), on a real child process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from aenv.runtime import guest_memory as gm
from aenv.storage import snapshots as snap

PAGE = snap.PAGE_SIZE
SIZE = 64 * PAGE


def make_snapshot(directory: Path, layers: tuple[snap.MemoryLayer, ...],
                  drives: tuple[snap.DriveImage, ...] = (), parent: Path | None = None) -> None:
    staging = snap.begin(directory)
    (staging / snap.DEVICE_STATE).write_bytes(b"state")
    own = [la for la in layers if la.directory == directory]
    if own:
        with open(staging / snap.MEMORY, "wb") as f:
            f.truncate(SIZE)
        if own[0].kind == "diff":
            snap.write_runs(staging / snap.MEMORY_RUNS, [(0, 1)])
    for d in drives:
        if d.file:
            (staging / d.file).write_bytes(b"disk")
    manifest = snap.Manifest(driver="test", vm={"shape": 1}, memory_size=SIZE, layers=layers,
                             drives=drives, parent=parent)
    snap.commit(staging, directory, manifest)


def test_a_manifest_reads_back_with_its_own_files_relative_to_the_directory(tmp_path) -> None:
    d = tmp_path / "s1"
    make_snapshot(d, (snap.MemoryLayer(d, "full", 3),),
                  (snap.DriveImage("rootfs", "qcow2", False, file="rootfs.qcow2",
                                   root=Path("/images/base.raw"), root_format="raw"),))
    raw = json.loads((d / snap.MANIFEST).read_text())
    assert raw["version"] == snap.FORMAT_VERSION and raw["memory"]["layers"][0]["dir"] is None
    m = snap.read_manifest(d)
    assert m.layers == (snap.MemoryLayer(d, "full", 3),) and m.diff_depth == 0
    assert m.drive("rootfs").root == Path("/images/base.raw") and m.vm == {"shape": 1}
    assert not list(tmp_path.glob(".s1.partial-*"))


def test_a_manifest_of_another_format_version_is_refused(tmp_path) -> None:
    d = tmp_path / "s1"
    make_snapshot(d, (snap.MemoryLayer(d, "full", 0),))
    raw = json.loads((d / snap.MANIFEST).read_text())
    raw["version"] = max(snap.READ_VERSIONS) + 1
    (d / snap.MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(snap.SnapshotFormatError, match="version"):
        snap.read_manifest(d)


def test_a_snapshot_whose_parent_layer_is_gone_is_refused(tmp_path) -> None:
    base, child = tmp_path / "base", tmp_path / "child"
    make_snapshot(base, (snap.MemoryLayer(base, "full", 0),))
    make_snapshot(child, (snap.MemoryLayer(base, "full", 0), snap.MemoryLayer(child, "diff", 1)),
                  parent=base)
    assert snap.dependencies(child) == {base}
    snap.remove(base)
    with pytest.raises(snap.SnapshotFormatError, match="missing"):
        snap.read_manifest(child)


def test_dependencies_include_drive_chains(tmp_path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    make_snapshot(a, (snap.MemoryLayer(a, "full", 0),),
                  (snap.DriveImage("rootfs", "qcow2", False, file="rootfs.qcow2"),))
    make_snapshot(b, (snap.MemoryLayer(b, "full", 0),),
                  (snap.DriveImage("rootfs", "qcow2", False, file="rootfs.qcow2",
                                   chain=(a / "rootfs.qcow2",)),), parent=a)
    assert snap.dependencies(b) == {a}
    assert snap.dependencies(a) == set()


def test_a_snapshot_directory_is_never_overwritten(tmp_path) -> None:
    d = tmp_path / "s1"
    make_snapshot(d, (snap.MemoryLayer(d, "full", 0),))
    with pytest.raises(snap.SnapshotFilesError, match="exists"):
        snap.begin(d)


def test_later_layers_own_the_pages_they_hold(tmp_path) -> None:
    layers = []
    for name, runs in (("base", None), ("l1", [(2, 3), (10, 1)]), ("l2", [(3, 1), (20, 2)])):
        d = tmp_path / name
        d.mkdir()
        if runs is not None:
            snap.write_runs(d / snap.MEMORY_RUNS, runs)
            assert snap.read_runs(d / snap.MEMORY_RUNS) == runs
        layers.append(snap.MemoryLayer(d, "full" if runs is None else "diff", 0))
    owners = snap.owner_map(layers, 32)
    assert owners[2] == 1 and owners[3] == 2 and owners[4] == 1 and owners[10] == 1
    assert owners[20] == owners[21] == 2 and owners[0] == owners[31] == 0
    assert list(snap.runs_where(owners, 1)) == [(2, 1), (4, 1), (10, 1)]
    assert list(snap.runs_where(owners, 2)) == [(3, 1), (20, 2)]


def test_a_diff_layer_is_sparse_and_records_coalesced_runs(tmp_path) -> None:
    w = snap.LayerWriter(tmp_path, 1024 * PAGE, "diff")
    w.write(5, b"a" * PAGE)
    w.write(6, b"b" * 2 * PAGE)
    w.write(100, b"c" * PAGE)
    layer = w.close()
    assert layer.pages == 4
    assert snap.read_runs(tmp_path / snap.MEMORY_RUNS) == [(5, 3), (100, 1)]
    assert os.path.getsize(tmp_path / snap.MEMORY) == 1024 * PAGE
    assert snap.allocated(tmp_path / snap.MEMORY) <= 16 * PAGE
    with open(tmp_path / snap.MEMORY, "rb") as f:
        f.seek(7 * PAGE)
        assert f.read(PAGE) == b"b" * PAGE


def test_a_full_layer_from_a_base_keeps_the_base_where_not_written(tmp_path) -> None:
    base = tmp_path / "base"
    with open(base, "wb") as f:
        f.truncate(256 * PAGE)
        f.seek(10 * PAGE)
        f.write(b"x" * 2 * PAGE)
    out = tmp_path / "out"
    out.mkdir()
    w = snap.LayerWriter(out, 256 * PAGE, "full", base=base)
    w.write(11, b"y" * PAGE)
    layer = w.close()
    data = (out / snap.MEMORY).read_bytes()
    assert data[10 * PAGE:11 * PAGE] == b"x" * PAGE and data[11 * PAGE:12 * PAGE] == b"y" * PAGE
    assert data[:10 * PAGE] == bytes(10 * PAGE)
    assert layer.pages == 2 and not (out / snap.MEMORY_RUNS).exists()


def test_copy_sparse_copies_data_and_keeps_holes(tmp_path) -> None:
    src, dest = tmp_path / "src", tmp_path / "dest"
    with open(src, "wb") as f:
        f.truncate(4096 * PAGE)
        f.seek(1000 * PAGE)
        f.write(os.urandom(3 * PAGE))
    assert snap.copy_sparse(src, dest) >= 3 * PAGE
    assert dest.read_bytes() == src.read_bytes()
    assert snap.allocated(dest) < 64 * PAGE


# -- guest_memory on a real process ----------------------------------------------------------

CHILD = """
import mmap, sys
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), int(sys.argv[2]), flags=mmap.MAP_PRIVATE)
for p in range(0, 16):          # read: stays the file's page
    m[p * 4096]
for p in (20, 21, 22, 40):      # write: private copies
    m[p * 4096:(p + 1) * 4096] = bytes([p]) * 4096
print("ready", flush=True)
sys.stdin.read()
"""


@pytest.fixture
def mapped(tmp_path) -> Iterator[tuple[subprocess.Popen, Path]]:
    path = tmp_path / "ram"
    with open(path, "wb") as f:
        f.write(b"\x01" * SIZE)
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), str(SIZE)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        yield child, path
    finally:
        child.kill()
        child.wait()


def test_the_pages_a_process_wrote_into_a_private_mapping_are_found(mapped) -> None:
    child, path = mapped
    mapping = gm.find_mapping(child.pid, path, SIZE)
    assert gm.private_runs(child.pid, mapping) == [(20, 3), (40, 1)]
    with gm.ProcessMemory(child.pid, mapping) as mem:
        assert mem.read(21, 1) == bytes([21]) * PAGE
        assert mem.read(5, 1) == b"\x01" * PAGE


def test_writing_process_memory_makes_private_copies_and_leaves_the_file_alone(mapped) -> None:
    child, path = mapped
    mapping = gm.find_mapping(child.pid, path, SIZE)
    with gm.ProcessMemory(child.pid, mapping, write=True) as mem:
        mem.write(50, b"\x07" * 2 * PAGE)
        assert mem.read(51, 1) == b"\x07" * PAGE
    assert gm.private_runs(child.pid, mapping) == [(20, 3), (40, 1), (50, 2)]
    assert path.read_bytes() == b"\x01" * SIZE


def test_a_file_the_process_does_not_map_is_reported(mapped, tmp_path) -> None:
    child, _ = mapped
    other = tmp_path / "other"
    other.write_bytes(b"")
    with pytest.raises(gm.GuestMemoryError, match="does not map"):
        gm.find_mapping(child.pid, other, SIZE)


# -- what a capture writes of a restored VM's memory (qemu_snapshot._write_changed) -----------

WRITER_CHILD = """
import mmap, sys
f = open(sys.argv[1], "r+b")
m = mmap.mmap(f.fileno(), int(sys.argv[2]), flags=mmap.MAP_PRIVATE)
m[2 * 4096:3 * 4096] = b"\\x01" * 4096              # written, but as the file has it
m[3 * 4096:5 * 4096] = b"\\x02" * 8192              # changed
m[9 * 4096 + 4000] = 9                              # changed far from the page's start
m[10 * 4096:11 * 4096] = b"\\x01" * 4096            # as the file again
m[11 * 4096] = 11                                   # changed
m[12 * 4096:20 * 4096] = b"\x01" * 8 * 4096        # as the file: two whole blocks of 4
for p in range(30, 64):                              # changed, a run across chunks
    m[p * 4096:(p + 1) * 4096] = bytes([p]) * 4096
print("ready", flush=True)
sys.stdin.read()
"""


def test_a_capture_writes_exactly_the_pages_that_differ_from_the_stack(
        tmp_path, monkeypatch) -> None:
    from aenv.runtime import qemu_snapshot

    monkeypatch.setattr(qemu_snapshot, "_CHUNK_PAGES", 16)  # runs cut into several chunks
    path = tmp_path / "ram"
    path.write_bytes(b"\x01" * SIZE)
    child = subprocess.Popen([sys.executable, "-c", WRITER_CHILD, str(path), str(SIZE)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        mapping = gm.find_mapping(child.pid, path, SIZE)
        runs = gm.private_runs(child.pid, mapping)
        out = tmp_path / "layer"
        out.mkdir()
        writer = snap.LayerWriter(out, SIZE, "diff")
        fd = os.open(path, os.O_RDONLY)
        try:
            with gm.ProcessMemory(child.pid, mapping) as mem:
                qemu_snapshot._write_changed(mem, writer, runs, bytearray(SIZE // PAGE), [fd])
        finally:
            os.close(fd)
        layer = writer.close()
    finally:
        child.kill()
        child.wait()
    assert snap.read_runs(out / snap.MEMORY_RUNS) == [(3, 2), (9, 1), (11, 1), (30, 34)]
    assert layer.pages == 38
    data = (out / snap.MEMORY).read_bytes()
    assert data[3 * PAGE:5 * PAGE] == b"\x02" * 2 * PAGE
    assert data[9 * PAGE + 4000] == 9 and data[9 * PAGE] == 1
    assert data[11 * PAGE] == 11
    assert all(data[p * PAGE:(p + 1) * PAGE] == bytes([p]) * PAGE for p in range(30, 64))



def test_differing_pages_agrees_with_a_page_by_page_comparison() -> None:
    """Sampled first, then in full: pages that differ only between the samples, runs of
    equal pages around a lone changed one, and pages that differ at a sample."""
    import mmap
    import random

    from aenv.runtime import qemu_snapshot

    rng = random.Random(7)
    n = 300
    data, ref = mmap.mmap(-1, (n + 3) * PAGE), mmap.mmap(-1, n * PAGE)
    ref[:] = rng.randbytes(n * PAGE)
    off = 3 * PAGE  # the run starts inside the chunk
    data[off:] = ref[:]
    for p in rng.sample(range(n), 60):
        at = p * PAGE + rng.randrange(PAGE)
        data[off + at] = (ref[at] + 1) % 256
    want = bytearray(int(data[off + p * PAGE:off + (p + 1) * PAGE] != ref[p * PAGE:(p + 1) * PAGE])
                     for p in range(n))
    assert qemu_snapshot._differing_pages(data, off, ref, n) == want
