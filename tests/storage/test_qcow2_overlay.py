"""qcow2 files read and made without a process (``aenv.storage.snapshots``): a header read
in Python says what ``qemu-img info`` says, and an overlay made from the per-size template
is byte for byte the one ``qemu-img create`` writes."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from aenv.storage import snapshots as snap


def _qemu_img_info(path: Path) -> snap.ImageInfo:
    info = json.loads(subprocess.run(["qemu-img", "info", "--output=json", "-U", str(path)],
                                     capture_output=True, text=True, check=True).stdout)
    backing = info.get("full-backing-filename")
    return snap.ImageInfo(int(info["virtual-size"]), Path(backing) if backing else None,
                          info.get("backing-filename-format"))


@pytest.mark.parametrize("size", [1 << 20, 2 << 30, (2 << 30) + 4096, 700 << 30])
@pytest.mark.parametrize("fmt", ["qcow2", "raw"])
def test_an_overlay_is_what_qemu_img_create_writes(tmp_path: Path, size: int,
                                                   fmt: str) -> None:
    backing = Path("/var/lib/aenv/snapshots/0123456789abcdef/rootfs.qcow2")
    ours, theirs = tmp_path / "ours.qcow2", tmp_path / "theirs.qcow2"
    snap.create_overlay(ours, backing, fmt, size)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-u", "-b", str(backing),
                    "-F", fmt, str(theirs), str(size)], check=True)
    assert ours.read_bytes() == theirs.read_bytes()
    assert snap.image_info(ours) == _qemu_img_info(theirs)


def test_overlays_of_one_size_differ_only_in_their_backing_name(tmp_path: Path) -> None:
    long = tmp_path / ("x" * 200) / ("y" * 200) / "rootfs.qcow2"
    for i, backing in enumerate([tmp_path / "a.qcow2", long, tmp_path / "b.qcow2"]):
        backing.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(backing), "1G"],
                       check=True)  # check opens the backing file
        path = tmp_path / f"o{i}.qcow2"
        snap.create_overlay(path, backing, "qcow2", 1 << 30)
        assert snap.image_info(path) == snap.ImageInfo(1 << 30, backing, "qcow2")
        subprocess.run(["qemu-img", "check", "-q", "-U", str(path)], check=True)


def test_a_header_read_in_python_says_what_qemu_img_info_says(tmp_path: Path) -> None:
    base = tmp_path / "base.raw"
    base.write_bytes(bytes(1 << 20))
    mid, top, alone = tmp_path / "mid.qcow2", tmp_path / "top.qcow2", tmp_path / "alone.qcow2"
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", str(base), "-F", "raw",
                    str(mid)], check=True)
    # A relative backing name is resolved against the image's directory, as QEMU does.
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-b", "mid.qcow2",
                    "-F", "qcow2", str(top)], cwd=tmp_path, check=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", str(alone), "3G"], check=True)
    for image in (mid, top, alone):
        assert snap.qcow2_info(image) == _qemu_img_info(image), image
    assert snap.qcow2_info(base) is None  # not a qcow2: image_info asks qemu-img
    assert snap.image_info(base).virtual_size == 1 << 20
