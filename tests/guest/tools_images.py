"""Test images without a guest layer, made from what the machine has cached (no registry).

- ``busybox_tree``: Debian's static busybox and a link per applet in ``/bin``, an
  ``/etc/passwd`` and ``/etc/group`` with root only: no libc, no bash, no Python.
- ``debian_tree``: the base recipe's cached Debian tree with every python3 file deleted
  (and Node.js, to keep the image small): glibc and bash, but no interpreter envd could use.

Both are deterministic (same files, modes and contents each time), so the images built from
them are cache hits after the first run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from aenv.config import Settings
from aenv.storage import debian, images


def busybox_tree(settings: Settings, dest: Path) -> Path:
    (deb,) = debian.download([debian.candidate("busybox-static")], settings.cache_dir / "debs")
    unpacked = dest.with_name(dest.name + "-deb")
    shutil.rmtree(unpacked, ignore_errors=True)
    debian.unpack(deb, unpacked)
    for d in ("bin", "etc", "root"):
        (dest / d).mkdir(parents=True, exist_ok=True)
    shutil.copy2(unpacked / "bin/busybox", dest / "bin/busybox")
    os.chmod(dest / "bin/busybox", 0o755)
    shutil.rmtree(unpacked)
    applets = subprocess.run([dest / "bin/busybox", "--list"], check=True, capture_output=True,
                             text=True).stdout.split()
    for applet in applets:
        if applet != "busybox":
            os.symlink("busybox", dest / "bin" / applet)
    (dest / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (dest / "etc/group").write_text("root:x:0:\n")
    os.chmod(dest / "root", 0o700)
    return dest


def debian_tree(settings: Settings, dest: Path) -> Path:
    images.copy_tree(images.base_debian_tree(settings), dest)
    for pattern in ("usr/bin/python*", "usr/lib/python3*", "usr/bin/pip*", "usr/bin/pydoc*",
                    "usr/share/python3*", "etc/python3*", "usr/local/*",
                    "usr/lib/x86_64-linux-gnu/libpython3*"):
        for path in dest.glob(pattern):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    return dest
