"""The shared snapshot store with real files and qcow2 images: a snapshot published from one
node's home is fetched, verified, into another's with its closure and its paths moved;
corrupt blobs and incompatible snapshots are refused without installing anything."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path

import pytest

from aenv.storage import snapshot_store
from aenv.storage import snapshots as snap
from aenv.storage.shared_store import (
    BLOBS,
    Incompatible,
    LocalRoots,
    NotPublished,
    SharedStore,
    SharedStoreError,
    digest,
    incompatibilities,
    node_capabilities,
)

MEM = 1 << 20
World = tuple[LocalRoots, LocalRoots, SharedStore]


def _qcow2(path: Path, backing: Path | None = None, fmt: str = "raw") -> None:
    cmd = ["qemu-img", "create", "-q", "-f", "qcow2"]
    if backing is not None:
        cmd += ["-u", "-b", str(backing), "-F", fmt]
    subprocess.run([*cmd, str(path), "1M"], check=True)


def _backing(image: Path) -> str:
    out = subprocess.run(["qemu-img", "info", "--output=json", "-U", str(image)],
                         check=True, capture_output=True, text=True).stdout
    return str(json.loads(out).get("backing-filename"))


def _home(root: Path) -> LocalRoots:
    local = LocalRoots(root / "snapshots", root / "layers")
    local.snapshots.mkdir(parents=True)
    local.layers.mkdir(parents=True)
    return local


def _node_a(tmp_path: Path, kernel: Path, base: Path) -> LocalRoots:
    """x: full memory, drive on template layer L (on the shared base image); y: memory a
    diff on x's, its drive on x's drive."""
    a = _home(tmp_path / "a")
    layer = a.layers / "L.qcow2"
    _qcow2(layer, base)
    (a.layers / "L.json").write_text("{}")
    table: list[tuple[str, list[tuple[str, snap.LayerKind]], list[str], Path]] = [
        ("x", [("x", "full")], [], layer),
        ("y", [("x", "full"), ("y", "diff")], ["x"], a.snapshots / "x/rootfs.qcow2")]
    for name, layers, chain, backing in table:
        d = a.snapshots / name
        d.mkdir()
        (d / snap.DEVICE_STATE).write_bytes(b"state of " + name.encode())
        with open(d / snap.MEMORY, "wb") as f:   # sparse: one page of data
            f.truncate(MEM)
            f.seek(MEM // 2)
            f.write(name.encode() * 4096)
        _qcow2(d / "rootfs.qcow2", backing, "qcow2")
        m = snap.Manifest(
            driver="qemu", vm={"accel": "tcg", "kernel": str(kernel), "version": 1},
            memory_size=MEM,
            layers=tuple(snap.MemoryLayer(a.snapshots / n, k, 1) for n, k in layers),
            drives=(snap.DriveImage("rootfs", "qcow2", False, file="rootfs.qcow2",
                                    chain=tuple(a.snapshots / c / "rootfs.qcow2"
                                                for c in chain),
                                    root=layer, root_format="qcow2"),))
        (d / snap.MANIFEST).write_text(json.dumps(m.to_json(d)))
    (a.snapshots / "unrelated").mkdir()
    return a


@pytest.fixture
def world(tmp_path: Path) -> World:
    kernel = tmp_path / "cache/kernels/k1/vmlinux"
    kernel.parent.mkdir(parents=True)
    kernel.write_bytes(b"kernel")
    base = tmp_path / "cache/images/base.raw"
    base.parent.mkdir(parents=True)
    base.write_bytes(b"\0" * MEM)
    return _node_a(tmp_path, kernel, base), _home(tmp_path / "b"), \
        SharedStore(tmp_path / "shared")


def test_a_published_snapshot_is_fetched_whole_with_its_paths_moved(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    a, b, store = world
    bundle = store.publish(a, "y")
    assert bundle.requires["driver"] == "qemu" and bundle.requires["accel"] == "tcg"
    assert bundle.requires["kernel"] == "k1"
    assert {f.path.split("/")[1] for f in bundle.files if f.path.startswith("snapshots/")} \
        == {"x", "y"}                               # its closure, not "unrelated"
    assert {f.path for f in bundle.files if f.path.startswith("layers/")} == \
        {"layers/L.qcow2", "layers/L.json"}
    # content-addressed: every blob's name is its digest, and a republish copies nothing
    for f in bundle.files:
        assert digest(store.root / BLOBS / f.digest) == f.digest
    blobs = sorted(os.listdir(store.root / BLOBS))
    assert store.publish(a, "y") == bundle and sorted(os.listdir(store.root / BLOBS)) == blobs
    # y's dependency x, published on its own, is taken from its bundle, not hashed again
    store.publish(a, "x")
    hashed: list[Path] = []

    def counting(p: Path) -> str:
        hashed.append(p)
        return digest(p)

    monkeypatch.setattr("aenv.storage.shared_store.digest", counting)
    assert store.publish(a, "y") == bundle
    monkeypatch.undo()
    # (only its few-KiB manifest is, to tell a snapshot compacted since it was published)
    assert not [p for p in hashed if p.parent.name == "x" and p.name != snap.MANIFEST] \
        and hashed
    # once x's manifest changed (a background compaction shortened its chain), its files
    # are hashed again: its bundle's drive file may read through a chain y no longer has
    m = snap.read_manifest(a.snapshots / "x")
    snap.rewrite_manifest(a.snapshots / "x", dataclasses.replace(m, sizes={"changed": 1}))
    hashed.clear()
    monkeypatch.setattr("aenv.storage.shared_store.digest", counting)
    store.publish(a, "y")
    monkeypatch.undo()
    assert {p.name for p in hashed if p.parent.name == "x"} >= {"rootfs.qcow2", snap.MEMORY}
    # holes stay holes in the store
    mem = store.root / BLOBS / digest(a.snapshots / "y" / snap.MEMORY)
    assert snap.allocated(mem) < MEM

    store.fetch(b, "y")
    m = snap.read_manifest(b.snapshots / "y")
    assert [la.directory for la in m.layers] == [b.snapshots / "x", b.snapshots / "y"]
    assert m.drives[0].chain == (b.snapshots / "x/rootfs.qcow2",)
    assert m.drives[0].root == b.layers / "L.qcow2"
    assert _backing(b.snapshots / "y/rootfs.qcow2") == str(b.snapshots / "x/rootfs.qcow2")
    assert _backing(b.snapshots / "x/rootfs.qcow2") == str(b.layers / "L.qcow2")
    assert _backing(b.layers / "L.qcow2") == _backing(a.layers / "L.qcow2")  # shared image
    assert (b.snapshots / "y" / snap.MEMORY).read_bytes() == \
        (a.snapshots / "y" / snap.MEMORY).read_bytes()
    assert snapshot_store.reachable(b.snapshots, b.layers, ["snapshot:y"]) == {
        b.snapshots / "x", b.snapshots / "y", b.layers / "L.qcow2"}
    assert not [p for p in b.snapshots.iterdir() if p.name.startswith(".")]
    store.fetch(b, "y")  # already there: kept as is


def test_a_corrupt_blob_is_refused_and_nothing_is_installed(world: World) -> None:
    a, b, store = world
    bundle = store.publish(a, "y")
    mem = next(f for f in bundle.files if f.path == "snapshots/y/memory")
    blob = store.root / BLOBS / mem.digest
    with open(blob, "r+b") as f:
        f.seek(MEM // 2)
        f.write(b"Z")
    with pytest.raises(SharedStoreError, match="does not match its digest"):
        store.fetch(b, "y")
    assert not (b.snapshots / "y").exists()
    assert not [p for p in b.snapshots.iterdir() if p.name.startswith(".")]


def test_an_incompatible_snapshot_is_refused_before_any_copy(world: World) -> None:
    a, b, store = world
    store.publish(a, "y")
    here = node_capabilities("qemu", "tcg", ["k1"])
    assert incompatibilities(store.bundle("y").requires, here) == []
    with pytest.raises(Incompatible, match="needs the tcg accelerator, this node has kvm"):
        store.fetch(b, "y", node_capabilities("qemu", "kvm", ["k1"]))
    with pytest.raises(Incompatible, match="firecracker"):
        store.fetch(b, "y", node_capabilities("firecracker", "tcg", ["k1"]))
    with pytest.raises(Incompatible, match="guest kernel k1"):
        store.fetch(b, "y", node_capabilities("qemu", "tcg", ["k2"]))
    assert list(b.snapshots.iterdir()) == [] and list(b.layers.iterdir()) == []
    with pytest.raises(NotPublished):
        store.fetch(b, "nope")


def test_collection_keeps_every_blob_a_published_snapshot_names(world: World) -> None:
    a, _, store = world
    store.publish(a, "x")
    store.publish(a, "y")
    assert store.collect() == []
    store.unpublish("y")
    removed = store.collect()
    x = store.bundle("x")
    assert removed and all(p.name not in {f.digest for f in x.files} for p in removed)
    assert all((store.root / BLOBS / f.digest).is_file() for f in x.files)


def _image(cache: Path, digest_name: str, name: str) -> Path:
    """An image as ``aenv.storage.images`` lays it: ``images/<digest>/rootfs.ext4`` and
    its ``image.json``."""
    d = cache / "images" / digest_name
    d.mkdir(parents=True)
    with open(d / "rootfs.ext4", "wb") as f:   # sparse, a little data
        f.truncate(MEM)
        f.write(name.encode() * 100)
    (d / "image.json").write_text(json.dumps({"name": name, "digest": digest_name}))
    return d / "rootfs.ext4"


def _template_on(a: LocalRoots, name: str, layer_backing: Path, kernel: Path) -> None:
    """Snapshot ``name``: its drive on template layer ``<name>.qcow2`` over
    ``layer_backing`` (raw), as a template build leaves it."""
    layer = a.layers / f"{name}.qcow2"
    _qcow2(layer, layer_backing, "raw")
    (a.layers / f"{name}.json").write_text("{}")
    d = a.snapshots / name
    d.mkdir()
    (d / snap.DEVICE_STATE).write_bytes(b"state")
    (d / snap.MEMORY).write_bytes(b"m" * 4096)
    _qcow2(d / "rootfs.qcow2", layer, "qcow2")
    m = snap.Manifest(
        driver="qemu", vm={"accel": "tcg", "kernel": str(kernel), "version": 1},
        memory_size=4096, layers=(snap.MemoryLayer(d, "full", 1),),
        drives=(snap.DriveImage("rootfs", "qcow2", False, file="rootfs.qcow2", chain=(),
                                root=layer, root_format="qcow2"),))
    (d / snap.MANIFEST).write_text(json.dumps(m.to_json(d)))


def test_a_host_laid_image_is_published_with_the_template_and_fetched_where_it_belongs(
        world: World, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fromImage template's layer sits on an image laid on node a's host: node b, with
    its own images directory, gets that image (verified) and the layer pointed at it; the
    ``base`` image, which every node builds, stays external and is not copied."""
    a, _, store = world
    kernel = tmp_path / "cache/kernels/k1/vmlinux"
    pulled = _image(tmp_path / "cache-a", "d1gest", "python:3.12")
    base = _image(tmp_path / "cache-a", "ba5e", "base")
    _template_on(a, "fromimage", pulled, kernel)
    _template_on(a, "onbase", base, kernel)
    b = _home(tmp_path / "b2")
    b = LocalRoots(b.snapshots, b.layers, images=tmp_path / "cache-b/images")

    bundle = store.publish(a, "fromimage")
    assert bundle.images == {"d1gest": str(pulled.parent)}
    assert str(pulled) not in bundle.external and str(kernel) in bundle.external
    assert (store.root / "images/d1gest.json").is_file()
    # published once: a second template on the same image does not hash it again
    hashed: list[Path] = []

    def counting(p: Path) -> str:
        hashed.append(p)
        return digest(p)

    monkeypatch.setattr("aenv.storage.shared_store.digest", counting)
    assert store.publish(a, "fromimage").images == bundle.images
    monkeypatch.undo()
    assert pulled not in hashed

    store.fetch(b, "fromimage")
    here = tmp_path / "cache-b/images/d1gest"
    assert (here / "rootfs.ext4").read_bytes() == pulled.read_bytes()
    assert json.loads((here / "image.json").read_text())["name"] == "python:3.12"
    assert _backing(b.layers / "fromimage.qcow2") == str(here / "rootfs.ext4")
    assert not [p for p in here.parent.iterdir() if p.name.startswith(".")]

    # base: not copied, named as external; a node without it cannot restore the template
    on_base = store.publish(a, "onbase")
    assert on_base.images == {} and str(base) in on_base.external
    assert not (store.root / "images/ba5e.json").exists()
    base.unlink()
    with pytest.raises(Incompatible, match="lacks"):
        store.fetch(b, "onbase")


def test_a_corrupt_image_blob_is_refused_and_no_image_is_installed(
        world: World, tmp_path: Path) -> None:
    a, _, store = world
    kernel = tmp_path / "cache/kernels/k1/vmlinux"
    pulled = _image(tmp_path / "cache-a", "d2gest", "node:22")
    _template_on(a, "fromimage", pulled, kernel)
    store.publish(a, "fromimage")
    (store.root / BLOBS / digest(pulled)).write_bytes(b"not the image")
    b = _home(tmp_path / "b3")
    b = LocalRoots(b.snapshots, b.layers, images=tmp_path / "cache-c/images")
    with pytest.raises(SharedStoreError, match="does not match"):
        store.fetch(b, "fromimage")
    images = tmp_path / "cache-c/images"
    assert not images.exists() or list(images.iterdir()) == []
    assert list(b.snapshots.iterdir()) == []
