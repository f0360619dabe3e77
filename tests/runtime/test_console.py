"""The console log stays bounded while an O_APPEND writer (the VMM) keeps writing."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from aenv.runtime import console

KIB = 1024


def _lines(start: int, count: int) -> bytes:
    return b"".join(b"line %08d %s\n" % (i, b"x" * 40) for i in range(start, start + count))


@pytest.fixture(params=["disk", "tmpfs"])
def log_dir(request, tmp_path: Path):
    """A directory on the data filesystem (collapses in place) and on tmpfs (falls back)."""
    if request.param == "disk":
        yield tmp_path
        return
    if not os.access("/dev/shm", os.W_OK):
        pytest.skip("no writable /dev/shm")
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        yield Path(d)


def test_a_long_log_keeps_its_newest_lines_and_the_writer_appends_after_them(log_dir):
    path = log_dir / "console.log"
    writer = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)  # as the VMM holds it
    try:
        os.write(writer, _lines(0, 4000))  # ~200 KiB
        size = path.stat().st_size
        cut = console.bound(path, max_bytes=64 * KIB, keep_bytes=16 * KIB)
        assert cut > 0 and path.stat().st_size == size - cut
        assert 16 * KIB <= path.stat().st_size < 16 * KIB + 8 * KIB  # whole blocks
        os.write(writer, _lines(4000, 10))
    finally:
        os.close(writer)
    data = path.read_bytes()
    assert b"\0" not in data  # the writer's next line came at the new end, not past a hole
    assert data.endswith(_lines(4000, 10))
    assert b"line 00003999 " in data and b"line 00000000 " not in data


def test_a_log_within_its_bound_is_left_alone(tmp_path):
    path = tmp_path / "console.log"
    path.write_bytes(_lines(0, 100))
    assert console.bound(path, max_bytes=64 * KIB) == 0
    assert path.read_bytes() == _lines(0, 100)
    assert console.bound(tmp_path / "missing.log") == 0
