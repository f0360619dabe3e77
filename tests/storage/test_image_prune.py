"""``aenv image prune``: superseded images go only when nothing on the node reads them."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from aenv.cli.main import app
from aenv.config import Settings
from aenv.storage import ext4
from aenv.storage.images import Image, build_image, image_users, list_images
from aenv.store import BuildStatus, Database, TemplateKind, TemplateRecord, TemplateStore

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="image builds need root"),
    pytest.mark.skipif(shutil.which("qemu-img") is None, reason="needs qemu-img"),
]


@pytest.fixture
def settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Settings:
    home = tmp_path / "aenv-home"
    monkeypatch.setenv("AENV_HOME", str(home))
    monkeypatch.delenv("AENV_CACHE_HOME", raising=False)
    return Settings(home=home)


def _old_and_new(settings: Settings, tmp_path: Path) -> tuple[Image, Image]:
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    (src / "etc/v").write_text("1")
    old = build_image(settings, "d", src, guest_layer=False, size_bytes=32 * ext4.MiB)
    (src / "etc/v").write_text("2")
    new = build_image(settings, "d", src, guest_layer=False, size_bytes=32 * ext4.MiB)
    assert old.digest != new.digest
    return old, new


def _overlay(path: Path, backing: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(backing), "-F", "raw",
                    str(path)], check=True)


def _prune() -> str:
    result = CliRunner().invoke(app, ["image", "prune", "--yes"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return result.output


def _digests(settings: Settings) -> set[str]:
    return {i.digest for i in list_images(settings)}


def test_an_unused_superseded_image_is_removed(settings: Settings, tmp_path: Path) -> None:
    old, new = _old_and_new(settings, tmp_path)
    # a disk over the newest image does not keep the old one
    _overlay(settings.vms_dir / "sb1" / "rootfs.qcow2", new.path)
    out = _prune()
    assert f"d {old.digest[:12]}" in out and "kept" not in out
    assert _digests(settings) == {new.digest}


@pytest.mark.parametrize("place", ["snapshot", "layer", "vm"])
def test_an_image_a_disk_still_reads_is_kept(settings: Settings, tmp_path: Path,
                                             place: str) -> None:
    """A paused sandbox's or template's snapshot, a committed layer, a running sandbox's
    disk: each reads the old image through its qcow2 backing chain (here two files deep
    for the snapshot: its drive over a layer over the image)."""
    old, new = _old_and_new(settings, tmp_path)
    if place == "snapshot":
        _overlay(settings.layers_dir / "l1.qcow2", old.path)
        drive = settings.snapshots_dir / "s1" / "rootfs.qcow2"
        drive.parent.mkdir(parents=True)
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b",
                        str(settings.layers_dir / "l1.qcow2"), "-F", "qcow2", str(drive)],
                       check=True)
        who = "snapshot s1"
    elif place == "layer":
        _overlay(settings.layers_dir / "l1.qcow2", old.path)
        who = "layer l1.qcow2"
    else:
        _overlay(settings.vms_dir / "sb1" / "rootfs.qcow2", old.path)
        who = "vm sb1"
    out = _prune()
    assert f"d {old.digest[:12]} cloud: kept, still used by {who}" in out, out
    assert "nothing to prune: every superseded image is still used" in out
    assert _digests(settings) == {old.digest, new.digest}
    assert image_users(settings)[old.digest][0] == who


def test_an_image_a_template_record_names_is_kept(settings: Settings,
                                                  tmp_path: Path) -> None:
    """A template made from an image names it as ``image:<digest>`` in the store (no disk
    of it need exist yet)."""
    old, new = _old_and_new(settings, tmp_path)
    db = Database(settings.home / "aenv.db")
    now = time.time()
    TemplateStore(db).insert(TemplateRecord(
        id="tpl1", kind=TemplateKind.TEMPLATE, build_id="b1", status=BuildStatus.READY,
        cpu_count=1, memory_mb=256, disk_size_mb=1024, created_at=now, updated_at=now,
        image=f"image:{old.digest}"))
    db.close()
    out = _prune()
    assert f"kept, still used by a record naming image:{old.digest[:12]}" in out, out
    assert _digests(settings) == {old.digest, new.digest}


def test_bases_with_laid_copies_are_one_family(settings: Settings, tmp_path: Path) -> None:
    """``base+copy-<hash>`` images (a build's COPY steps laid into the base) each have a
    name of their own; the older ones are superseded by the newest, and kept while used."""
    src = tmp_path / "src"
    (src / "etc").mkdir(parents=True)
    made = []
    for i in range(3):
        (src / "etc/v").write_text(str(i))
        made.append(build_image(settings, f"base+copy-{i:012d}", src, guest_layer=False,
                                size_bytes=32 * ext4.MiB))
    used, unused, newest = made
    _overlay(settings.snapshots_dir / "tpl" / "rootfs.qcow2", used.path)
    out = _prune()
    assert f"{used.digest[:12]} cloud: kept, still used by snapshot tpl" in out, out
    assert f"{unused.digest[:12]} cloud\n" in out
    assert _digests(settings) == {used.digest, newest.digest}
