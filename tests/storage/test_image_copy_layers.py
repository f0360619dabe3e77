"""A template's leading COPY steps laid into the base tree on the host
(``images._lay_copy``, what ``images.base_image_with`` does to each): the entry lands at its
new destination owned by root with its modes, and what the guest's COPY would do otherwise
(a destination that exists, an entry that is no directory) is refused, for the guest."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

from aenv.storage import images
from aenv.storage.images import CopyLayer, NotLayerable

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")


def archive(path: Path, files: dict[str, tuple[bytes, int]]) -> Path:
    with tarfile.open(path, "w") as tf:
        for name, (data, mode) in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.uid, info.gid = len(data), mode, 1234, 1234
            tf.addfile(info, io.BytesIO(data))
    return path


@pytest.fixture
def tree(tmp_path) -> Path:
    root = tmp_path / "tree"
    (root / "usr/lib").mkdir(parents=True)
    os.symlink("usr/lib", root / "lib")  # as a merged-/usr Debian tree has
    return root


def test_a_directory_lands_at_its_destination_owned_by_root(settings, tree, tmp_path) -> None:
    tar = archive(tmp_path / "a.tar", {"site/pkg/__init__.py": (b"x = 1\n", 0o644),
                                       "site/bin/tool": (b"#!/bin/sh\n", 0o755),
                                       "other/y": (b"y", 0o644)})
    images._lay_copy(settings, tree, CopyLayer(tar, "site", "/opt/a/site"), print)
    site = tree / "opt/a/site"
    assert (site / "pkg/__init__.py").read_text() == "x = 1\n"
    assert (site / "bin/tool").stat().st_mode & 0o777 == 0o755
    assert not (tree / "opt/a/other").exists()
    for p in (tree / "opt", tree / "opt/a", site, site / "pkg", site / "pkg/__init__.py"):
        assert (p.stat().st_uid, p.stat().st_gid) == (0, 0), p


def test_a_destination_through_a_symlink_stays_in_the_tree(settings, tree, tmp_path) -> None:
    tar = archive(tmp_path / "a.tar", {"d/f": (b"f", 0o644)})
    images._lay_copy(settings, tree, CopyLayer(tar, "d", "/lib/x"), print)
    assert (tree / "usr/lib/x/f").read_bytes() == b"f"


def test_what_the_host_cannot_lay_as_the_guest_would_is_refused(settings, tree,
                                                                 tmp_path) -> None:
    tar = archive(tmp_path / "a.tar", {"d/f": (b"f", 0o644), "file": (b"1", 0o644)})
    with pytest.raises(NotLayerable):  # the guest merges into an existing directory
        images._lay_copy(settings, tree, CopyLayer(tar, "d", "/usr/lib"), print)
    with pytest.raises(NotLayerable):  # a file moves (or goes into a directory)
        images._lay_copy(settings, tree, CopyLayer(tar, "file", "/opt/file"), print)
    with pytest.raises(NotLayerable):
        images._lay_copy(settings, tree, CopyLayer(tar, "d", "relative"), print)
    assert not (tree / "opt/file").exists()
