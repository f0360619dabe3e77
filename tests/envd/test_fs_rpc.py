"""filesystem.Filesystem unary RPCs through the real SDK: Stat, MakeDir, Move, ListDir, Remove."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator

import pytest
from e2b import FileNotFoundException, FileType, InvalidArgumentException, SandboxException


@pytest.fixture
def home_dir() -> Iterator[str]:
    """A fresh, not yet existing directory under the default user's home."""
    path = f"/home/user/aenv-t-{uuid.uuid4().hex[:10]}"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _tree(sandbox, root: str) -> None:
    for sub in ("subdir1/subdir1_1", "subdir1/subdir1_2", "subdir2/subdir2_1", "subdir2/subdir2_2"):
        sandbox.files.make_dir(f"{root}/{sub}")
    sandbox.files.write(f"{root}/file1.txt", "Hello, world!")


DEPTH2 = [
    "file1.txt", "subdir1", "subdir1/subdir1_1", "subdir1/subdir1_2",
    "subdir2", "subdir2/subdir2_1", "subdir2/subdir2_2",
]


def test_get_info_of_new_file_reports_permission_bits_owner_and_utc_mtime(sandbox, home_dir):
    sandbox.files.write(f"{home_dir}/f.txt", "test")
    info = sandbox.files.get_info(f"{home_dir}/f.txt")
    assert (info.name, info.type, info.path) == ("f.txt", FileType.FILE, f"{home_dir}/f.txt")
    assert info.size == 4
    assert (info.mode, info.permissions) == (0o644, "-rw-r--r--")
    assert (info.owner, info.group) == ("user", "user")
    assert info.modified_time.tzinfo is not None
    assert abs(info.modified_time.timestamp() - os.stat(f"{home_dir}/f.txt").st_mtime) < 1e-3
    assert info.symlink_target is None


def test_get_info_of_directory(sandbox, home_dir):
    sandbox.files.make_dir(home_dir)
    info = sandbox.files.get_info(home_dir)
    assert (info.type, info.mode, info.permissions) == (FileType.DIR, 0o755, "drwxr-xr-x")
    assert info.size > 0
    assert (info.owner, info.group) == ("user", "user")


def test_relative_path_resolves_against_the_users_home(sandbox, home_dir):
    rel = os.path.basename(home_dir) + "/r.txt"
    assert sandbox.files.write(rel, "x").path == f"{home_dir}/r.txt"
    assert sandbox.files.get_info(rel).path == f"{home_dir}/r.txt"


def test_symlink_reports_target_type_and_resolved_absolute_target(sandbox, home_dir):
    sandbox.files.write(f"{home_dir}/test.txt", "Hello")
    os.symlink("test.txt", f"{home_dir}/link")
    info = sandbox.files.get_info(f"{home_dir}/link")
    assert info.type == FileType.FILE
    assert info.symlink_target == f"{home_dir}/test.txt"
    assert info.mode == 0o644
    assert info.permissions == "Lrwxrwxrwx"
    assert info.name == "link" and info.path == f"{home_dir}/link"


def test_dangling_symlink_points_at_itself_and_is_left_out_of_listings(sandbox, home_dir):
    sandbox.files.make_dir(home_dir)
    os.symlink("missing", f"{home_dir}/dangling")
    assert sandbox.files.get_info(f"{home_dir}/dangling").symlink_target == f"{home_dir}/dangling"
    assert sandbox.files.list(home_dir) == []


def test_get_info_of_missing_path_is_file_not_found(sandbox, home_dir):
    with pytest.raises(FileNotFoundException):
        sandbox.files.get_info(f"{home_dir}/nope")


def test_exists(sandbox, home_dir):
    assert not sandbox.files.exists(home_dir)
    sandbox.files.make_dir(home_dir)
    assert sandbox.files.exists(home_dir)
    assert not sandbox.files.exists(f"{home_dir}/missing/deeper")


def test_make_dir_creates_parents_owned_by_the_user(sandbox, home_dir):
    assert sandbox.files.make_dir(f"{home_dir}/a/b") is True
    for path in (home_dir, f"{home_dir}/a", f"{home_dir}/a/b"):
        st = os.stat(path)
        assert (st.st_uid, st.st_mode & 0o777) == (1001, 0o755)


def test_make_dir_of_existing_directory_returns_false(sandbox, home_dir):
    assert sandbox.files.make_dir(home_dir) is True
    assert sandbox.files.make_dir(home_dir) is False


def test_make_dir_over_a_file_is_invalid_argument(sandbox, home_dir):
    sandbox.files.write(f"{home_dir}/f", "x")
    with pytest.raises(InvalidArgumentException):
        sandbox.files.make_dir(f"{home_dir}/f")


def test_make_dir_as_root_makes_root_owned_directories(sandbox, home_dir):
    sandbox.files.make_dir(f"{home_dir}/r", user="root")
    assert os.stat(f"{home_dir}/r").st_uid == 0


def test_rename_moves_into_new_parents_and_keeps_metadata(sandbox, home_dir):
    sandbox.files.write(f"{home_dir}/a.txt", "content", metadata={"k": "v"})
    info = sandbox.files.rename(f"{home_dir}/a.txt", f"{home_dir}/new/b.txt")
    assert info.path == f"{home_dir}/new/b.txt" and info.metadata == {"k": "v"}
    assert not os.path.exists(f"{home_dir}/a.txt")
    assert sandbox.files.read(f"{home_dir}/new/b.txt") == "content"


def test_rename_of_missing_source_is_file_not_found(sandbox, home_dir):
    with pytest.raises(FileNotFoundException):
        sandbox.files.rename(f"{home_dir}/nope", f"{home_dir}/other")


def test_remove_file_directory_and_missing_path(sandbox, home_dir):
    sandbox.files.write(f"{home_dir}/d/f.txt", "x")
    sandbox.files.remove(f"{home_dir}/d/f.txt")
    assert not os.path.exists(f"{home_dir}/d/f.txt")
    sandbox.files.remove(home_dir)
    assert not os.path.exists(home_dir)
    sandbox.files.remove(home_dir)  # missing is fine


def test_remove_of_symlink_to_directory_keeps_the_target(sandbox, home_dir):
    sandbox.files.write(f"{home_dir}/real/keep.txt", "x")
    os.symlink(f"{home_dir}/real", f"{home_dir}/link")
    sandbox.files.remove(f"{home_dir}/link")
    assert os.path.exists(f"{home_dir}/real/keep.txt") and not os.path.lexists(f"{home_dir}/link")


@pytest.mark.parametrize("depth,expected", [(None, 3), (1, 3), (2, 7), (3, 7)])
def test_list_is_lexical_depth_first_preorder(sandbox, home_dir, depth, expected):
    _tree(sandbox, home_dir)
    entries = sandbox.files.list(home_dir, depth=depth)
    names = [e.path.removeprefix(home_dir + "/") for e in entries]
    want = DEPTH2 if expected == 7 else ["file1.txt", "subdir1", "subdir2"]
    assert names == want
    assert entries[0].type == FileType.FILE
    assert all(e.type == FileType.DIR for e in entries[1:])
    assert [e.name for e in entries] == [n.rsplit("/", 1)[-1] for n in want]


def test_list_follows_a_symlinked_directory_and_keeps_the_requested_path(sandbox, home_dir):
    _tree(sandbox, home_dir + "/real")
    os.symlink(home_dir + "/real", home_dir + "/link")
    entries = sandbox.files.list(home_dir + "/link", depth=2)
    assert [e.path for e in entries] == [f"{home_dir}/link/{n}" for n in DEPTH2]


def test_list_reports_symlinked_subdirectory_without_descending(sandbox, home_dir):
    _tree(sandbox, home_dir + "/real")
    sandbox.files.make_dir(home_dir + "/top")
    os.symlink(home_dir + "/real", home_dir + "/top/link")
    entries = sandbox.files.list(home_dir + "/top", depth=3)
    assert [(e.name, e.type, e.symlink_target) for e in entries] == [
        ("link", FileType.DIR, home_dir + "/real")
    ]


def test_list_of_symlink_loop_is_failed_precondition(sandbox, home_dir):
    sandbox.files.make_dir(home_dir)
    os.symlink(home_dir + "/b", home_dir + "/a")
    os.symlink(home_dir + "/a", home_dir + "/b")
    with pytest.raises(SandboxException, match="FAILED_PRECONDITION"):
        sandbox.files.list(home_dir + "/a")


def test_list_of_missing_path_and_of_a_file(sandbox, home_dir):
    with pytest.raises(FileNotFoundException):
        sandbox.files.list(home_dir)
    sandbox.files.write(f"{home_dir}/f", "x")
    with pytest.raises(InvalidArgumentException):
        sandbox.files.list(f"{home_dir}/f")


async def test_async_info_list_rename_remove(async_sandbox, home_dir):
    files = async_sandbox.files
    assert await files.make_dir(f"{home_dir}/d") is True
    assert await files.make_dir(f"{home_dir}/d") is False
    await files.write(f"{home_dir}/d/a.txt", "abc")
    info = await files.get_info(f"{home_dir}/d/a.txt")
    assert (info.size, info.mode, info.owner) == (3, 0o644, "user")
    moved = await files.rename(f"{home_dir}/d/a.txt", f"{home_dir}/d/b.txt")
    assert moved.name == "b.txt"
    assert [e.name for e in await files.list(f"{home_dir}/d")] == ["b.txt"]
    assert await files.exists(f"{home_dir}/d/b.txt")
    await files.remove(f"{home_dir}/d")
    assert not await files.exists(f"{home_dir}/d")
    with pytest.raises(FileNotFoundException):
        await files.get_info(f"{home_dir}/d")
