"""filesystem.Filesystem unary RPCs through the real SDK: Stat, MakeDir, Move, ListDir, Remove."""

from __future__ import annotations

import os

import pytest
from e2b import FileNotFoundException, FileType, InvalidArgumentException, SandboxException


def _tree(sandbox, root: str) -> None:
    for sub in ("subdir1/subdir1_1", "subdir1/subdir1_2", "subdir2/subdir2_1", "subdir2/subdir2_2"):
        sandbox.files.make_dir(f"{root}/{sub}")
    sandbox.files.write(f"{root}/file1.txt", "Hello, world!")


DEPTH2 = [
    "file1.txt", "subdir1", "subdir1/subdir1_1", "subdir1/subdir1_2",
    "subdir2", "subdir2/subdir2_1", "subdir2/subdir2_2",
]


def test_get_info_of_new_file_reports_permission_bits_owner_and_utc_mtime(sandbox, home_path):
    sandbox.files.write(f"{home_path}/f.txt", "test")
    info = sandbox.files.get_info(f"{home_path}/f.txt")
    assert (info.name, info.type, info.path) == ("f.txt", FileType.FILE, f"{home_path}/f.txt")
    assert info.size == 4
    assert (info.mode, info.permissions) == (0o644, "-rw-r--r--")
    assert (info.owner, info.group) == ("user", "user")
    assert info.modified_time.tzinfo is not None
    assert abs(info.modified_time.timestamp() - os.stat(f"{home_path}/f.txt").st_mtime) < 1e-3
    assert info.symlink_target is None


def test_get_info_of_directory(sandbox, home_path):
    sandbox.files.make_dir(home_path)
    info = sandbox.files.get_info(home_path)
    assert (info.type, info.mode, info.permissions) == (FileType.DIR, 0o755, "drwxr-xr-x")
    assert info.size > 0
    assert (info.owner, info.group) == ("user", "user")


def test_relative_path_resolves_against_the_users_home(sandbox, home_path):
    rel = os.path.basename(home_path) + "/r.txt"
    assert sandbox.files.write(rel, "x").path == f"{home_path}/r.txt"
    assert sandbox.files.get_info(rel).path == f"{home_path}/r.txt"


def test_symlink_reports_target_type_and_resolved_absolute_target(sandbox, home_path):
    sandbox.files.write(f"{home_path}/test.txt", "Hello")
    os.symlink("test.txt", f"{home_path}/link")
    info = sandbox.files.get_info(f"{home_path}/link")
    assert info.type == FileType.FILE
    assert info.symlink_target == f"{home_path}/test.txt"
    assert info.mode == 0o644
    assert info.permissions == "Lrwxrwxrwx"
    assert info.name == "link" and info.path == f"{home_path}/link"


def test_dangling_symlink_points_at_itself_and_is_left_out_of_listings(sandbox, home_path):
    sandbox.files.make_dir(home_path)
    os.symlink("missing", f"{home_path}/dangling")
    assert sandbox.files.get_info(f"{home_path}/dangling").symlink_target == f"{home_path}/dangling"
    assert sandbox.files.list(home_path) == []


def test_get_info_of_missing_path_is_file_not_found(sandbox, home_path):
    with pytest.raises(FileNotFoundException):
        sandbox.files.get_info(f"{home_path}/nope")


def test_exists(sandbox, home_path):
    assert not sandbox.files.exists(home_path)
    sandbox.files.make_dir(home_path)
    assert sandbox.files.exists(home_path)
    assert not sandbox.files.exists(f"{home_path}/missing/deeper")


def test_make_dir_creates_parents_owned_by_the_user(sandbox, home_path):
    assert sandbox.files.make_dir(f"{home_path}/a/b") is True
    for path in (home_path, f"{home_path}/a", f"{home_path}/a/b"):
        st = os.stat(path)
        assert (st.st_uid, st.st_mode & 0o777) == (1001, 0o755)


def test_make_dir_of_existing_directory_returns_false(sandbox, home_path):
    assert sandbox.files.make_dir(home_path) is True
    assert sandbox.files.make_dir(home_path) is False


def test_make_dir_over_a_file_is_invalid_argument(sandbox, home_path):
    sandbox.files.write(f"{home_path}/f", "x")
    with pytest.raises(InvalidArgumentException):
        sandbox.files.make_dir(f"{home_path}/f")


def test_make_dir_as_root_makes_root_owned_directories(sandbox, home_path):
    sandbox.files.make_dir(f"{home_path}/r", user="root")
    assert os.stat(f"{home_path}/r").st_uid == 0


def test_rename_moves_into_new_parents_and_keeps_metadata(sandbox, home_path):
    sandbox.files.write(f"{home_path}/a.txt", "content", metadata={"k": "v"})
    info = sandbox.files.rename(f"{home_path}/a.txt", f"{home_path}/new/b.txt")
    assert info.path == f"{home_path}/new/b.txt" and info.metadata == {"k": "v"}
    assert not os.path.exists(f"{home_path}/a.txt")
    assert sandbox.files.read(f"{home_path}/new/b.txt") == "content"


def test_rename_of_missing_source_is_file_not_found(sandbox, home_path):
    with pytest.raises(FileNotFoundException):
        sandbox.files.rename(f"{home_path}/nope", f"{home_path}/other")


def test_remove_file_directory_and_missing_path(sandbox, home_path):
    sandbox.files.write(f"{home_path}/d/f.txt", "x")
    sandbox.files.remove(f"{home_path}/d/f.txt")
    assert not os.path.exists(f"{home_path}/d/f.txt")
    sandbox.files.remove(home_path)
    assert not os.path.exists(home_path)
    sandbox.files.remove(home_path)  # missing is fine


def test_remove_of_symlink_to_directory_keeps_the_target(sandbox, home_path):
    sandbox.files.write(f"{home_path}/real/keep.txt", "x")
    os.symlink(f"{home_path}/real", f"{home_path}/link")
    sandbox.files.remove(f"{home_path}/link")
    assert os.path.exists(f"{home_path}/real/keep.txt") and not os.path.lexists(f"{home_path}/link")


@pytest.mark.parametrize("depth,expected", [(None, 3), (1, 3), (2, 7), (3, 7)])
def test_list_is_lexical_depth_first_preorder(sandbox, home_path, depth, expected):
    _tree(sandbox, home_path)
    entries = sandbox.files.list(home_path, depth=depth)
    names = [e.path.removeprefix(home_path + "/") for e in entries]
    want = DEPTH2 if expected == 7 else ["file1.txt", "subdir1", "subdir2"]
    assert names == want
    assert entries[0].type == FileType.FILE
    assert all(e.type == FileType.DIR for e in entries[1:])
    assert [e.name for e in entries] == [n.rsplit("/", 1)[-1] for n in want]


def test_list_follows_a_symlinked_directory_and_keeps_the_requested_path(sandbox, home_path):
    _tree(sandbox, home_path + "/real")
    os.symlink(home_path + "/real", home_path + "/link")
    entries = sandbox.files.list(home_path + "/link", depth=2)
    assert [e.path for e in entries] == [f"{home_path}/link/{n}" for n in DEPTH2]


def test_list_reports_symlinked_subdirectory_without_descending(sandbox, home_path):
    _tree(sandbox, home_path + "/real")
    sandbox.files.make_dir(home_path + "/top")
    os.symlink(home_path + "/real", home_path + "/top/link")
    entries = sandbox.files.list(home_path + "/top", depth=3)
    assert [(e.name, e.type, e.symlink_target) for e in entries] == [
        ("link", FileType.DIR, home_path + "/real")
    ]


def test_list_of_symlink_loop_is_failed_precondition(sandbox, home_path):
    sandbox.files.make_dir(home_path)
    os.symlink(home_path + "/b", home_path + "/a")
    os.symlink(home_path + "/a", home_path + "/b")
    with pytest.raises(SandboxException, match="FAILED_PRECONDITION"):
        sandbox.files.list(home_path + "/a")


def test_list_of_missing_path_and_of_a_file(sandbox, home_path):
    with pytest.raises(FileNotFoundException):
        sandbox.files.list(home_path)
    sandbox.files.write(f"{home_path}/f", "x")
    with pytest.raises(InvalidArgumentException):
        sandbox.files.list(f"{home_path}/f")


async def test_async_info_list_rename_remove(async_sandbox, home_path):
    files = async_sandbox.files
    assert await files.make_dir(f"{home_path}/d") is True
    assert await files.make_dir(f"{home_path}/d") is False
    await files.write(f"{home_path}/d/a.txt", "abc")
    info = await files.get_info(f"{home_path}/d/a.txt")
    assert (info.size, info.mode, info.owner) == (3, 0o644, "user")
    moved = await files.rename(f"{home_path}/d/a.txt", f"{home_path}/d/b.txt")
    assert moved.name == "b.txt"
    assert [e.name for e in await files.list(f"{home_path}/d")] == ["b.txt"]
    assert await files.exists(f"{home_path}/d/b.txt")
    await files.remove(f"{home_path}/d")
    assert not await files.exists(f"{home_path}/d")
    with pytest.raises(FileNotFoundException):
        await files.get_info(f"{home_path}/d")
