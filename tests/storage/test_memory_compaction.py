"""Background merge of a snapshot's memory stack (``aenv.storage.memory_compaction``, run by
``aenv.runtime.compaction`` through the qemu driver's ``prepare_compaction``), on small
synthetic stacks and no VM: the guest memory a stack gives is the same before, during and
after, for a reader that holds the old manifest too; a server that dies at any step leaves
a snapshot that restores and a compaction that is finished at the next start; garbage
collection frees the old layers only after the release.

A "snapshot" here is a directory in the ``aenv.storage.snapshots`` layout: s0 holds a full
base layer, each later one a diff layer on the previous one's stack, as captures of a
restored VM leave them; generation ``g`` writes its own pattern into pages that overlap
the earlier generations' (so the topmost copy must win).
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from aenv.runtime import qemu_snapshot
from aenv.runtime.compaction import Compactor
from aenv.runtime.qemu import QemuRuntime
from aenv.storage import memory_compaction as mc
from aenv.storage import snapshot_store
from aenv.storage import snapshots as snap

PAGE = snap.PAGE_SIZE
NPAGES = 64
MAX_CHAIN = 2


def _page(gen: int, page: int) -> bytes:
    return bytes([gen + 1, page]) * (PAGE // 2)


def _pages_of(gen: int) -> list[int]:
    """Which pages generation ``gen`` writes: a moving window that overlaps the last ones,
    plus a page of its own far away."""
    return [*range(gen * 3, gen * 3 + 6), 40 + gen]


def _write(d: Path, manifest: snap.Manifest) -> None:
    (d / snap.DEVICE_STATE).write_bytes(b"state")
    (d / snap.MANIFEST).write_text(json.dumps(manifest.to_json(d)))


def _stack(tmp_path: Path, depth: int) -> tuple[Path, list[Path]]:
    """The snapshots root and s0 (a full base) .. s{depth} (each a diff on the last)."""
    root = tmp_path / "snapshots"
    root.mkdir()
    base = root / "s0"
    base.mkdir()
    with open(base / snap.MEMORY, "wb") as f:
        f.write(b"".join(_page(0, p) for p in range(NPAGES)))
    layers: tuple[snap.MemoryLayer, ...] = (snap.MemoryLayer(base, "full", NPAGES),)
    _write(base, snap.Manifest("qemu", {}, NPAGES * PAGE, layers, ()))
    dirs = [base]
    for gen in range(1, depth + 1):
        d = root / f"s{gen}"
        d.mkdir()
        writer = snap.LayerWriter(d, NPAGES * PAGE, "diff")
        for p in _pages_of(gen):
            writer.write(p, _page(gen, p))
        layers = (*layers, writer.close())
        _write(d, snap.Manifest("qemu", {}, NPAGES * PAGE, layers, (), parent=dirs[-1]))
        dirs.append(d)
    return root, dirs


def _memory(manifest: snap.Manifest) -> bytes:
    """The guest memory a stack gives, applied layer by layer (not through ``owner_map``,
    which the merge itself uses)."""
    mem = bytearray(manifest.layers[0].path.read_bytes())
    for layer in manifest.layers[1:]:
        data = layer.path.read_bytes()
        for start, count in snap.read_runs(layer.runs_path):
            mem[start * PAGE:(start + count) * PAGE] = data[start * PAGE:(start + count) * PAGE]
    return bytes(mem)


def _expected(depth: int) -> bytes:
    pages = [_page(0, p) for p in range(NPAGES)]
    for gen in range(1, depth + 1):
        for p in _pages_of(gen):
            pages[p] = _page(gen, p)
    return b"".join(pages)


def _hidden(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.startswith("."))


def test_a_stack_within_the_limit_is_not_merged(tmp_path: Path) -> None:
    _, dirs = _stack(tmp_path, MAX_CHAIN)
    assert mc.prepare(dirs[-1], MAX_CHAIN) is None
    assert qemu_snapshot.prepare_compaction(dirs[-1], MAX_CHAIN) is None


def test_captures_compact_inline_only_past_twice_the_limit() -> None:
    assert not mc.compacts_inline(MAX_CHAIN, MAX_CHAIN)
    assert not mc.compacts_inline(2 * MAX_CHAIN - 1, MAX_CHAIN)
    assert mc.compacts_inline(2 * MAX_CHAIN, MAX_CHAIN)


def test_a_merge_gives_the_same_memory_on_a_stack_of_two(tmp_path: Path) -> None:
    _, dirs = _stack(tmp_path, 5)
    top = dirs[-1]
    before = snap.read_manifest(top)
    assert _memory(before) == _expected(5)
    job = mc.prepare(top, MAX_CHAIN)
    assert job is not None and job.merged is not None
    # Made, not installed: hidden files only, the manifest unchanged.
    assert _hidden(top) == [".memory.merged.compacting", ".memory.merged.runs.compacting"]
    assert snap.read_manifest(top) == before
    assert job.install()
    after = snap.read_manifest(top)
    assert [(la.directory, la.name) for la in after.layers] == [
        (dirs[0], "memory"), (top, mc.MERGED)]
    assert _memory(after) == _expected(5)
    union = {p for gen in range(1, 6) for p in _pages_of(gen)}
    assert after.layers[1].pages == len(union)
    assert sum(n for _, n in snap.read_runs(after.layers[1].runs_path)) == len(union)
    assert _hidden(top) == []
    # Other snapshots' layers stay, kept for readers of the old manifest until the release.
    assert set(after.retired) == {d / snap.MEMORY for d in dirs[1:-1]}
    assert all((d / snap.MEMORY).is_file() for d in dirs)
    job.release()
    assert snap.read_manifest(top).retired == ()
    # The merged layer is sparse: it holds the union's pages, not the guest's size.
    assert snap.allocated(after.layers[1].path) <= len(union) * PAGE + (1 << 16)


def test_the_next_capture_on_a_merged_stack_compares_with_the_same_pages(
        tmp_path: Path) -> None:
    """A VM running on the lineage diffs its next capture against the parent's stack by
    ``owner_map``: the old and the merged stack name the same copy of every page."""
    _, dirs = _stack(tmp_path, 5)
    top = dirs[-1]
    old = snap.read_manifest(top)
    job = mc.prepare(top, MAX_CHAIN)
    assert job is not None and job.install()
    new = snap.read_manifest(top)

    def copies(m: snap.Manifest) -> list[bytes]:
        owners = snap.owner_map(m.layers, NPAGES)
        data = [la.path.read_bytes() for la in m.layers]
        return [data[owners[p]][p * PAGE:(p + 1) * PAGE] for p in range(NPAGES)]

    assert copies(new) == copies(old)


def test_a_reader_holding_the_old_manifest_reads_the_same_memory_until_collection_may_take_it(
        tmp_path: Path) -> None:
    root, dirs = _stack(tmp_path, 5)
    top = dirs[-1]
    held = snap.read_manifest(top)  # e.g. a restore between reading and opening its layers
    job = mc.prepare(top, MAX_CHAIN)
    assert job is not None and job.install()
    assert _memory(held) == _expected(5)
    layers = tmp_path / "layers"
    assert snapshot_store.collect(root, layers, [snapshot_store.ref(top.name)]) == []
    assert _memory(held) == _expected(5)
    assert snap.dependencies(top) == set(dirs[:-1])
    job.release()
    assert snap.dependencies(top) == {dirs[0]}
    assert sorted(snapshot_store.collect(root, layers, [snapshot_store.ref(top.name)])) \
        == dirs[1:-1]
    assert _memory(snap.read_manifest(top)) == _expected(5)


def test_collection_keeps_layers_a_merged_snapshot_shares_with_another(tmp_path: Path) -> None:
    root, dirs = _stack(tmp_path, 5)
    job = mc.prepare(dirs[-1], MAX_CHAIN)
    assert job is not None and job.install()
    job.release()
    roots = [snapshot_store.ref(dirs[-1].name), snapshot_store.ref(dirs[3].name)]
    assert sorted(snapshot_store.collect(root, tmp_path / "layers", roots)) == [dirs[4]]
    assert _memory(snap.read_manifest(dirs[3])) == _expected(3)
    assert _memory(snap.read_manifest(dirs[-1])) == _expected(5)


def test_a_server_that_died_while_merging_leaves_a_snapshot_that_merges_again(
        tmp_path: Path) -> None:
    _, dirs = _stack(tmp_path, 4)
    top = dirs[-1]
    (top / ".memory.merged.compacting").write_bytes(b"died while merging")
    (top / ".memory.merged.runs.compacting").write_bytes(b"\1")
    assert _memory(snap.read_manifest(top)) == _expected(4)
    job = mc.prepare(top, MAX_CHAIN)
    assert job is not None and job.install()
    assert _memory(snap.read_manifest(top)) == _expected(4)


def test_a_server_that_died_between_the_renames_and_the_manifest_merges_again(
        tmp_path: Path) -> None:
    _, dirs = _stack(tmp_path, 4)
    top = dirs[-1]
    job = mc.prepare(top, MAX_CHAIN)
    assert job is not None and job.merged is not None
    os.replace(top / ".memory.merged.runs.compacting", job.merged.runs_path)
    os.replace(top / ".memory.merged.compacting", job.merged.path)
    # The crash: the manifest still names the old stack, which is whole.
    m = snap.read_manifest(top)
    assert len(m.layers) == 5 and _memory(m) == _expected(4)
    again = mc.prepare(top, MAX_CHAIN)
    assert again is not None and again.install()
    assert _memory(snap.read_manifest(top)) == _expected(4)
    assert _hidden(top) == []


def test_a_server_that_died_between_install_and_release_only_releases(tmp_path: Path) -> None:
    _, dirs = _stack(tmp_path, 4)
    top = dirs[-1]
    job = mc.prepare(top, MAX_CHAIN)
    assert job is not None and job.install()
    installed = snap.read_manifest(top)
    again = mc.prepare(top, MAX_CHAIN)
    assert again is not None and again.merged is None
    assert again.install()
    assert snap.read_manifest(top) == installed  # the merged layer is never redone
    again.release()
    assert snap.read_manifest(top).retired == ()
    assert mc.prepare(top, MAX_CHAIN) is None
    assert _memory(snap.read_manifest(top)) == _expected(4)


def test_a_snapshot_collected_before_the_install_is_left_alone(tmp_path: Path) -> None:
    _, dirs = _stack(tmp_path, 4)
    top = dirs[-1]
    job = mc.prepare(top, MAX_CHAIN)
    assert job is not None
    (top / snap.MANIFEST).unlink()
    assert not job.install()
    assert _hidden(top) == []


def test_a_deferred_pause_whose_memory_is_pending_is_not_merged(tmp_path: Path) -> None:
    _, dirs = _stack(tmp_path, 4)
    top = dirs[-1]
    (top / snap.MEMORY_PENDING).write_text("{}")
    assert mc.prepare(top, MAX_CHAIN) is None
    # Nor installed when the marker appeared after the merge was made.
    (top / snap.MEMORY_PENDING).unlink()
    job = mc.prepare(top, MAX_CHAIN)
    assert job is not None
    (top / snap.MEMORY_ABANDONED).write_text("{}")
    assert not job.install()
    assert len(snap.read_manifest(top).layers) == 5


def test_a_merged_manifest_is_version_2_and_older_ones_stay_version_1(tmp_path: Path) -> None:
    _, dirs = _stack(tmp_path, 3)
    top = dirs[-1]
    assert json.loads((top / snap.MANIFEST).read_text())["version"] == 1
    job = mc.prepare(top, MAX_CHAIN)
    assert job is not None and job.install()
    raw = json.loads((top / snap.MANIFEST).read_text())
    assert raw["version"] == 2
    assert raw["memory"]["layers"][1]["file"] == mc.MERGED
    raw["version"] = 3
    (top / snap.MANIFEST).write_text(json.dumps(raw))
    with pytest.raises(snap.SnapshotFormatError):
        snap.read_manifest(top)


async def test_the_compactor_merges_memory_with_the_drives_step_and_recovers(
        tmp_path: Path) -> None:
    root, dirs = _stack(tmp_path, 5)
    # s4: installed, not released when the server stopped; s5: died while merging.
    job = qemu_snapshot.prepare_compaction(dirs[4], MAX_CHAIN)
    assert job is not None and job.install()
    (dirs[5] / ".memory.merged.compacting").write_bytes(b"died while merging")
    compactor = Compactor(QemuRuntime(max_chain=MAX_CHAIN), asyncio.Lock(),
                          release_after_s=0.0)
    try:
        assert compactor.recover(root) == 6
        await asyncio.wait_for(compactor.settle(), 60)
    finally:
        await compactor.close()
    assert len(compactor.history) == 3  # s3 merged, s4 released, s5 merged
    for gen, d in enumerate(dirs):
        m = snap.read_manifest(d)
        assert m.diff_depth <= MAX_CHAIN and m.retired == ()
        assert _memory(m) == _expected(gen)
        assert _hidden(d) == []
