"""Create a directory and its missing parents for a user (``mkdir -p`` plus chown).

Each directory created gets mode 0755 (before umask) and is chown'ed to the user, as
upstream envd's ``EnsureDirs`` does; existing ones are left alone. After each creation the
live watchers drain their queues, so a recursive watch covers the new directory before
anything is created inside it. Call it on the event loop thread.
"""

from __future__ import annotations

import os
import stat

from .errors import InvalidPath, from_os_error
from .watcher import drain_live_watchers


def ensure_dirs(path: str, uid: int, gid: int) -> bool:
    """Make ``path`` (absolute) a directory. Returns whether anything was created.

    Raises ``InvalidPath`` when a component is a file, other ``FilesystemError``s on
    failure.
    """
    created = False
    for sub in _prefixes(path):
        try:
            try:
                if stat.S_ISDIR(os.stat(sub).st_mode):
                    continue
                raise InvalidPath(f"path is a file: {sub}")
            except FileNotFoundError:
                pass
            try:
                os.mkdir(sub, 0o755)
            except FileExistsError:  # a concurrent creator, or a dangling symlink
                if not os.path.isdir(sub):
                    raise InvalidPath(f"path is not a directory: {sub}") from None
            # Chown even when a concurrent creator won the race: it may not have yet.
            os.chown(sub, uid, gid)
        except OSError as e:
            raise from_os_error(e, "error creating directory") from None
        created = True
        drain_live_watchers()
    return created


def _prefixes(path: str) -> list[str]:
    """``/a/b/c`` -> ``['/a', '/a/b', '/a/b/c']``."""
    parts = [p for p in os.path.normpath(path).split("/") if p]
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]
