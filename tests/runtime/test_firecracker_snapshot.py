"""How the driver maps Firecracker's snapshot files onto aenv's snapshot layout: the choice of
Full or Diff, the page runs of a diff layer, and the memory file a restore loads."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.runtime import firecracker_snapshot as fcsnap
from aenv.storage import snapshots
from aenv.storage.snapshots import PAGE_SIZE, Manifest, MemoryLayer

PAGES = 16


def layer_file(directory: Path, pages: dict[int, bytes], kind: str) -> MemoryLayer:
    directory.mkdir(parents=True)
    with open(directory / "memory", "wb") as f:
        f.truncate(PAGES * PAGE_SIZE)
        for p, data in pages.items():
            f.seek(p * PAGE_SIZE)
            f.write(data.ljust(PAGE_SIZE, b"."))
    if kind == "diff":
        snapshots.write_runs(directory / "memory.runs", [(p, 1) for p in sorted(pages)])
    return MemoryLayer(directory, kind, len(pages))  # type: ignore[arg-type]


def manifest(*layers: MemoryLayer) -> Manifest:
    return Manifest(driver="firecracker", vm={}, memory_size=PAGES * PAGE_SIZE,
                    layers=layers, drives=())


def no_reflink(src: Path, dest: Path) -> None:
    raise OSError(95, "Operation not supported")


def test_data_runs_are_the_page_runs_a_sparse_file_holds(tmp_path: Path) -> None:
    layer_file(tmp_path / "d", {1: b"a", 2: b"b", 7: b"c"}, "full")
    if not fcsnap.sparse_extents_exact(tmp_path):
        pytest.skip("this filesystem does not report page-exact data extents")
    assert fcsnap.data_runs(tmp_path / "d" / "memory") == [(1, 2), (7, 1)]


def test_a_single_full_layer_is_loaded_in_place(tmp_path: Path) -> None:
    base = layer_file(tmp_path / "s1", {0: b"base"}, "full")
    assert fcsnap.memory_for_restore(manifest(base), tmp_path / "w") == base.path
    assert not (tmp_path / "w").exists()


def test_a_diff_stack_is_merged_with_each_page_from_the_newest_layer(tmp_path: Path) -> None:
    base = layer_file(tmp_path / "s1", {0: b"base0", 1: b"base1", 2: b"base2"}, "full")
    d1 = layer_file(tmp_path / "s2", {1: b"d1-1", 5: b"d1-5"}, "diff")
    d2 = layer_file(tmp_path / "s3", {1: b"d2-1", 9: b"d2-9"}, "diff")
    (tmp_path / "w").mkdir()
    merged = fcsnap.memory_for_restore(manifest(base, d1, d2), tmp_path / "w")
    assert merged == tmp_path / "w" / "memory"
    data = merged.read_bytes()
    page = {p: data[p * PAGE_SIZE:(p + 1) * PAGE_SIZE].rstrip(b".") for p in range(PAGES)}
    assert page[0] == b"base0" and page[2] == b"base2"
    assert page[1] == b"d2-1" and page[5] == b"d1-5" and page[9] == b"d2-9"
    assert page[3] == b"\0" * PAGE_SIZE
    assert base.path.read_bytes()[PAGE_SIZE:PAGE_SIZE + 5] == b"base1"  # layers untouched


def test_the_plan_is_full_without_a_parent_or_without_dirty_tracking(tmp_path: Path) -> None:
    base = layer_file(tmp_path / "s1", {0: b"x"}, "full")
    (tmp_path / "st").mkdir()
    assert fcsnap.plan(tmp_path / "st", None, None, incremental=True,
                       track_dirty_pages=True).snapshot_type == "Full"
    assert fcsnap.plan(tmp_path / "st", manifest(base), base.directory, incremental=True,
                       track_dirty_pages=False).snapshot_type == "Full"
    assert fcsnap.plan(tmp_path / "st", manifest(base), base.directory, incremental=False,
                       track_dirty_pages=True).snapshot_type == "Full"


def test_a_stack_at_the_depth_limit_gets_a_full_snapshot(tmp_path: Path,
                                                         monkeypatch) -> None:
    monkeypatch.setattr(fcsnap, "reflink", no_reflink)
    monkeypatch.setattr(fcsnap, "MAX_DIFF_DEPTH", 1)
    base = layer_file(tmp_path / "s1", {0: b"x"}, "full")
    d1 = layer_file(tmp_path / "s2", {1: b"y"}, "diff")
    (tmp_path / "st").mkdir()
    p = fcsnap.plan(tmp_path / "st", manifest(base, d1), d1.directory, incremental=True,
                    track_dirty_pages=True)
    assert (p.snapshot_type, p.kind) == ("Full", "full")
