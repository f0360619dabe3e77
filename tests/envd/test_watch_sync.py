"""Polling watchers (CreateWatcher / GetWatcherEvents / RemoveWatcher), as the sync SDK uses them.

Every test collects events right after the write returns, without sleeping: envd must have
drained inotify before it answers.
"""

from __future__ import annotations

import os

import pytest
from e2b import FileNotFoundException, FilesystemEventType, FileType, SandboxException

E = FilesystemEventType


def _kinds(events) -> list[tuple[str, E]]:
    return [(e.name, e.type) for e in events]


def test_new_small_file_gives_exactly_create_chmod_write(sandbox, home_dir):
    handle = sandbox.files.watch_dir(home_dir)
    sandbox.files.write(f"{home_dir}/new.txt", "This file will be watched.")
    events = handle.get_new_events()
    assert _kinds(events) == [("new.txt", E.CREATE), ("new.txt", E.CHMOD), ("new.txt", E.WRITE)]
    assert handle.get_new_events() == []  # taken events are cleared
    handle.stop()


def test_overwrite_reports_a_write(sandbox, home_dir):
    sandbox.files.write(f"{home_dir}/f.txt", "one")
    handle = sandbox.files.watch_dir(home_dir)
    sandbox.files.write(f"{home_dir}/f.txt", "two")
    assert ("f.txt", E.WRITE) in _kinds(handle.get_new_events())
    handle.stop()


def test_remove_and_rename_events(sandbox, home_dir):
    sandbox.files.write(f"{home_dir}/a", "x")
    sandbox.files.write(f"{home_dir}/b", "x")
    handle = sandbox.files.watch_dir(home_dir)
    sandbox.files.remove(f"{home_dir}/a")
    sandbox.files.rename(f"{home_dir}/b", f"{home_dir}/c")
    assert _kinds(handle.get_new_events()) == [("a", E.REMOVE), ("b", E.RENAME), ("c", E.CREATE)]
    handle.stop()


def test_chmod_and_xattr_changes_are_chmod_events(sandbox, home_dir):
    sandbox.files.write(f"{home_dir}/a", "x")
    handle = sandbox.files.watch_dir(home_dir)
    os.chmod(f"{home_dir}/a", 0o600)
    assert _kinds(handle.get_new_events()) == [("a", E.CHMOD)]
    os.setxattr(f"{home_dir}/a", "user.e2b.k", b"v")  # the kernel merges it if unread
    assert _kinds(handle.get_new_events()) == [("a", E.CHMOD)]
    handle.stop()


def test_recursive_watch_names_nested_paths(sandbox, home_dir):
    sandbox.files.make_dir(f"{home_dir}/nested")
    handle = sandbox.files.watch_dir(home_dir, recursive=True)
    sandbox.files.write(f"{home_dir}/nested/f.txt", "content")
    events = handle.get_new_events()
    assert len(events) == 3
    assert (events[0].name, events[0].type) == ("nested/f.txt", E.CREATE)
    handle.stop()


def test_recursive_watch_covers_directories_created_after_it_started(sandbox, home_dir):
    handle = sandbox.files.watch_dir(home_dir, recursive=True)
    sandbox.files.make_dir(f"{home_dir}/later")
    sandbox.files.write(f"{home_dir}/later/f.txt", "content")
    # Parents made by the upload itself are watched before the file appears in them.
    sandbox.files.write(f"{home_dir}/p1/p2/g.txt", "content")
    kinds = _kinds(handle.get_new_events())
    for name in ("later", "p1", "p1/p2"):
        assert (name, E.CREATE) in kinds
    for name in ("later/f.txt", "p1/p2/g.txt"):
        assert (name, E.CREATE) in kinds and (name, E.WRITE) in kinds
    handle.stop()


def test_recursive_watch_follows_a_directory_moved_within_the_tree(sandbox, home_dir):
    sandbox.files.make_dir(f"{home_dir}/a/inner")
    handle = sandbox.files.watch_dir(home_dir, recursive=True)
    sandbox.files.rename(f"{home_dir}/a", f"{home_dir}/b")
    handle.get_new_events()
    sandbox.files.write(f"{home_dir}/b/inner/f.txt", "x")
    assert ("b/inner/f.txt", E.CREATE) in _kinds(handle.get_new_events())
    handle.stop()


def test_non_recursive_watch_ignores_subdirectories(sandbox, home_dir):
    sandbox.files.make_dir(f"{home_dir}/sub")
    handle = sandbox.files.watch_dir(home_dir)
    sandbox.files.write(f"{home_dir}/sub/f.txt", "x")
    assert handle.get_new_events() == []
    handle.stop()


def test_include_entry_fills_entries_of_create_chmod_and_write(sandbox, home_dir):
    handle = sandbox.files.watch_dir(home_dir, include_entry=True)
    sandbox.files.write(f"{home_dir}/f.txt", "content")
    events = handle.get_new_events()
    assert [e.type for e in events] == [E.CREATE, E.CHMOD, E.WRITE]
    for event in events:
        assert (event.entry.name, event.entry.path, event.entry.type) == (
            "f.txt", f"{home_dir}/f.txt", FileType.FILE
        )
    sandbox.files.remove(f"{home_dir}/f.txt")
    (removed,) = handle.get_new_events()
    assert removed.type == E.REMOVE and removed.entry is None
    handle.stop()


def test_allow_network_mounts_still_watches_local_directories(sandbox, home_dir):
    handle = sandbox.files.watch_dir(home_dir, allow_network_mounts=True)
    sandbox.files.write(f"{home_dir}/f.txt", "x")
    assert ("f.txt", E.WRITE) in _kinds(handle.get_new_events())
    handle.stop()


def test_watching_a_missing_directory_is_file_not_found(sandbox, home_dir):
    with pytest.raises(FileNotFoundException):
        sandbox.files.watch_dir(f"{home_dir}/missing")


def test_watching_a_file_is_refused(sandbox, home_dir):
    sandbox.files.write(f"{home_dir}/f.txt", "x")
    with pytest.raises(SandboxException):
        sandbox.files.watch_dir(f"{home_dir}/f.txt")


def test_stopped_watcher_is_gone_on_the_server(sandbox, home_dir):
    handle = sandbox.files.watch_dir(home_dir)
    handle.stop()
    with pytest.raises(SandboxException):
        handle.get_new_events()
    with pytest.raises(SandboxException):  # RemoveWatcher of an unknown id: not_found
        handle.stop()
