"""Image references: what a template's ``image`` text names, parsed in one place."""

from __future__ import annotations

from pathlib import Path

import pytest

from aenv.orchestrator.ids import new_layer_ref, new_snapshot_ref
from aenv.storage import disk_layers, snapshot_store
from aenv.storage.image_ref import BASE_IMAGE, BadImageRef, ImageKind, ImageRef


@pytest.mark.parametrize(("text", "kind", "ident"), [
    (None, ImageKind.BASE, ""),
    ("", ImageKind.BASE, ""),
    ("layer:abc123", ImageKind.LAYER, "abc123"),
    ("snapshot:abc123", ImageKind.SNAPSHOT, "abc123"),
])
def test_parse_reads_the_kind_and_id(text, kind, ident) -> None:
    assert ImageRef.parse(text) == ImageRef(kind, ident)


@pytest.mark.parametrize("text", ["layer:abc", "snapshot:abc"])
def test_the_text_form_round_trips(text) -> None:
    assert str(ImageRef.parse(text)) == text


def test_the_base_image_is_stored_as_no_text() -> None:
    assert ImageRef.parse(None) is BASE_IMAGE and str(BASE_IMAGE) == ""
    assert BASE_IMAGE.is_base and not BASE_IMAGE.is_layer and not BASE_IMAGE.is_snapshot


@pytest.mark.parametrize("text", ["img", "base", "layer", "Snapshot:abc", " snapshot:abc"])
def test_text_of_no_known_kind_is_refused(text) -> None:
    with pytest.raises(BadImageRef, match="not an image reference"):
        ImageRef.parse(text)


@pytest.mark.parametrize("text", ["layer:", "snapshot:", "snapshot:a/b", "layer:../x",
                                  "snapshot:.partial"])
def test_an_id_that_cannot_be_a_file_name_is_refused(text) -> None:
    with pytest.raises(BadImageRef, match=r"bad (layer|snapshot) reference"):
        ImageRef.parse(text)


def test_a_bad_reference_is_a_storage_error_and_a_value_error() -> None:
    from aenv.storage.errors import StorageError

    assert issubclass(BadImageRef, StorageError) and issubclass(BadImageRef, ValueError)


def test_the_orchestrators_new_references_parse_to_their_kind() -> None:
    assert ImageRef.parse(new_layer_ref()).is_layer
    assert ImageRef.parse(new_snapshot_ref()).is_snapshot


def test_the_snapshot_store_names_a_snapshots_directory_by_its_id(tmp_path: Path) -> None:
    assert snapshot_store.ref("abc") == "snapshot:abc"
    assert snapshot_store.directory(tmp_path, "snapshot:abc") == tmp_path / "abc"
    assert snapshot_store.directory(tmp_path, ImageRef.snapshot("abc")) == tmp_path / "abc"


@pytest.mark.parametrize("text", ["layer:abc", "img", "snapshot:a/b", "snapshot:"])
def test_the_snapshot_store_refuses_what_names_no_snapshot(tmp_path: Path, text) -> None:
    with pytest.raises(snapshot_store.SnapshotMissing):
        snapshot_store.directory(tmp_path, text)


@pytest.mark.parametrize("text", ["snapshot:abc", "img", "layer:a/b", "layer:", ""])
def test_the_layer_store_refuses_what_names_no_layer(tmp_path: Path, text) -> None:
    with pytest.raises(disk_layers.DiskLayerError):
        disk_layers.layer_id(text)
    with pytest.raises(disk_layers.DiskLayerError):
        disk_layers.resolve(text, tmp_path)


def test_collection_skips_roots_that_name_nothing(tmp_path: Path) -> None:
    snaps, layers = tmp_path / "snapshots", tmp_path / "layers"
    kept = snaps / "kept"
    kept.mkdir(parents=True)
    (kept / "rootfs.raw").write_bytes(b"")
    (kept / snapshot_store.DISK_MANIFEST).write_text('{"drive": "rootfs.raw", "format": "raw"}')
    (snaps / "gone").mkdir()
    removed = snapshot_store.collect(snaps, layers, ["img", "snapshot:a/b", "layer:missing",
                                                     "snapshot:kept"])
    assert removed == [snaps / "gone"] and kept.is_dir()
