"""Checks through the E2B SDK that end-to-end suites run against sandboxes of different
images."""

from __future__ import annotations

import time

from e2b import FilesystemEventType, Sandbox


def assert_watch_sees_a_new_file(sbx: Sandbox, within: float) -> None:
    """``files.watch_dir`` on a new directory reports the CREATE of a file a command makes
    in it, within ``within`` seconds."""
    sbx.files.make_dir("/home/user/watched")
    handle = sbx.files.watch_dir("/home/user/watched")
    try:
        sbx.commands.run("echo x > /home/user/watched/new.txt")
        deadline = time.monotonic() + within
        seen: list[tuple[str, FilesystemEventType]] = []
        while time.monotonic() < deadline and ("new.txt", FilesystemEventType.CREATE) not in seen:
            seen += [(e.name, e.type) for e in handle.get_new_events()]
            time.sleep(0.2)
        assert ("new.txt", FilesystemEventType.CREATE) in seen
    finally:
        handle.stop()
