"""Applying tar layers: whiteouts, opaque directories, ownership, and no escape from root."""

from __future__ import annotations

import os

import pytest

from aenv.storage.errors import LayerError
from aenv.storage.tar_layers import apply_layer
from tests.storage.layertools import layer

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="ownership needs root")


def _apply(root, tmp_path, entries, *, whiteouts=True, name="l.tar.gz"):
    path = tmp_path / name
    path.write_bytes(layer(entries))
    apply_layer(root, path, whiteouts=whiteouts)


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    r.mkdir()
    return r


def test_whiteout_deletes_the_lower_file(root, tmp_path):
    _apply(root, tmp_path, [{"name": "etc", "type": "dir"},
                            {"name": "etc/gone", "data": b"1"}, {"name": "etc/kept", "data": b"2"}])
    _apply(root, tmp_path, [{"name": "etc/.wh.gone"}])
    assert not (root / "etc/gone").exists()
    assert (root / "etc/kept").read_bytes() == b"2"
    assert not (root / "etc/.wh.gone").exists()


def test_opaque_directory_hides_lower_content_but_keeps_its_own(root, tmp_path):
    _apply(root, tmp_path, [{"name": "d", "type": "dir"}, {"name": "d/old", "data": b"o"}])
    _apply(root, tmp_path, [{"name": "d", "type": "dir"}, {"name": "d/.wh..wh..opq"},
                            {"name": "d/new", "data": b"n"}])
    assert sorted(os.listdir(root / "d")) == ["new"]


def test_without_whiteout_handling_markers_are_plain_files(root, tmp_path):
    _apply(root, tmp_path, [{"name": ".wh.x", "data": b""}], whiteouts=False)
    assert (root / ".wh.x").exists()


def test_ownership_modes_and_hard_links_are_kept(root, tmp_path):
    _apply(root, tmp_path, [
        {"name": "home/user", "type": "dir", "uid": 1000, "gid": 1000, "mode": 0o750},
        {"name": "home/user/f", "data": b"x", "uid": 1000, "gid": 1000, "mode": 0o4755},
        {"name": "home/user/g", "type": "link", "target": "home/user/f"},
        {"name": "run/fifo", "type": "fifo"},
    ])
    st = os.stat(root / "home/user/f")
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1000, 1000, 0o4755)
    assert os.stat(root / "home/user").st_mode & 0o777 == 0o750
    assert os.stat(root / "home/user/g").st_ino == st.st_ino


def test_absolute_symlink_is_followed_inside_the_root(root, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    _apply(root, tmp_path, [{"name": "evil", "type": "symlink", "target": str(outside)}])
    _apply(root, tmp_path, [{"name": "evil/planted", "data": b"x"}], name="l2.tar.gz")
    assert not (outside / "planted").exists()
    assert (root / str(outside).lstrip("/") / "planted").read_bytes() == b"x"


def test_relative_symlink_cannot_climb_above_the_root(root, tmp_path):
    _apply(root, tmp_path, [{"name": "up", "type": "symlink", "target": "../../../../.."}])
    _apply(root, tmp_path, [{"name": "up/escaped", "data": b"x"}], name="l2.tar.gz")
    assert (root / "escaped").read_bytes() == b"x"
    assert not (tmp_path / "escaped").exists()


def test_dotdot_entry_is_refused(root, tmp_path):
    with pytest.raises(LayerError, match="climbs out"):
        _apply(root, tmp_path, [{"name": "a/../../x", "data": b"x"}])


def test_later_layer_replaces_a_file_with_a_directory(root, tmp_path):
    _apply(root, tmp_path, [{"name": "p", "data": b"file"}])
    _apply(root, tmp_path, [{"name": "p/child", "data": b"c"}], name="l2.tar.gz")
    assert (root / "p/child").read_bytes() == b"c"
