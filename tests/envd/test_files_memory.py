"""Uploads stream to disk: a 1 GiB upload leaves envd's peak RSS where it was."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator

import pytest

GIB = 1 << 30
CHUNK = 1 << 20
# Buffers in flight are a few MiB; anything near the upload's size means it was buffered.
MAX_GROWTH = 48 << 20


@pytest.fixture
def tmp_dir() -> Iterator[str]:
    path = f"/tmp/aenv-t-{uuid.uuid4().hex[:10]}"
    os.mkdir(path)
    os.chmod(path, 0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak(pid: int) -> int:
    """Reset VmHWM to the current RSS (Linux >= 4.0, needs ptrace rights) and return it."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pytest.skip("cannot reset the peak RSS of envd here")
    return _status(pid, "VmRSS")


class _Zeros:
    """A binary file-like of ``size`` bytes that holds nothing in memory."""

    def __init__(self, size: int) -> None:
        self.left = size

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        n = min(n, CHUNK)
        self.left -= n
        return bytes(n)


@pytest.mark.slow
def test_one_gib_octet_stream_upload_keeps_rss_flat(sandbox, envd, tmp_dir):
    pid = envd.proc.pid
    sandbox.files.write(f"{tmp_dir}/warm", b"x" * CHUNK)  # first-use allocations
    before = _reset_peak(pid)
    sandbox.files.write(f"{tmp_dir}/big", (bytes(CHUNK) for _ in range(GIB // CHUNK)))
    assert os.path.getsize(f"{tmp_dir}/big") == GIB
    assert _status(pid, "VmHWM") - before < MAX_GROWTH


@pytest.mark.slow
def test_one_gib_multipart_upload_keeps_rss_flat(sandbox, envd, tmp_dir):
    pid = envd.proc.pid
    sandbox.files.write(f"{tmp_dir}/warm", b"x" * CHUNK)
    before = _reset_peak(pid)
    sandbox.files.write(f"{tmp_dir}/big", _Zeros(GIB), use_octet_stream=False)
    assert os.path.getsize(f"{tmp_dir}/big") == GIB
    assert _status(pid, "VmHWM") - before < MAX_GROWTH
