"""A writer of ``newc`` cpio archives: the format the Linux kernel unpacks as an initramfs.

Entries are owned by root with mtime 0, so the same inputs give byte-identical archives
(the initramfs is content-addressed like everything else). Parent directories must be added
before their children, as the kernel creates entries in archive order.
"""

from __future__ import annotations

import gzip
import io
import stat


class CpioWriter:
    def __init__(self) -> None:
        self._buf = io.BytesIO()
        self._ino = 0

    def directory(self, path: str, mode: int = 0o755) -> None:
        self._entry(path, stat.S_IFDIR | mode, b"", nlink=2)

    def file(self, path: str, data: bytes, mode: int = 0o644) -> None:
        self._entry(path, stat.S_IFREG | mode, data)

    def symlink(self, path: str, target: str) -> None:
        self._entry(path, stat.S_IFLNK | 0o777, target.encode())

    def char_device(self, path: str, major: int, minor: int, mode: int = 0o600) -> None:
        self._entry(path, stat.S_IFCHR | mode, b"", rdev=(major, minor))

    def getvalue(self) -> bytes:
        """The archive, closed with the ``TRAILER!!!`` entry."""
        out = io.BytesIO(self._buf.getvalue())
        out.seek(0, io.SEEK_END)
        _write(out, "TRAILER!!!", 0, b"", ino=0, nlink=1, rdev=(0, 0))
        return out.getvalue()

    def gzipped(self) -> bytes:
        return gzip.compress(self.getvalue(), compresslevel=6, mtime=0)

    def _entry(
        self, path: str, mode: int, data: bytes, *, nlink: int = 1, rdev: tuple[int, int] = (0, 0)
    ) -> None:
        name = path.strip("/")
        if not name or ".." in name.split("/"):
            raise ValueError(f"bad cpio path {path!r}")
        self._ino += 1
        _write(self._buf, name, mode, data, ino=self._ino, nlink=nlink, rdev=rdev)


def _write(
    out: io.BytesIO, name: str, mode: int, data: bytes, *, ino: int, nlink: int,
    rdev: tuple[int, int],
) -> None:
    encoded = name.encode() + b"\0"
    fields = [ino, mode, 0, 0, nlink, 0, len(data), 0, 0, rdev[0], rdev[1], len(encoded), 0]
    header = b"070701" + b"".join(b"%08X" % f for f in fields)
    out.write(header + encoded)
    out.write(b"\0" * (-(len(header) + len(encoded)) % 4))
    out.write(data)
    out.write(b"\0" * (-len(data) % 4))
