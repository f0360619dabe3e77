"""The newc writer produces archives that GNU cpio (like the kernel) reads back exactly."""

from __future__ import annotations

import gzip
import os
import subprocess

from aenv.storage.cpio import CpioWriter


def test_cpio_tool_extracts_files_links_and_modes(tmp_path):
    w = CpioWriter()
    w.directory("bin")
    w.file("bin/tool", b"#!/bin/sh\necho hi\n", 0o755)
    w.symlink("bin/alias", "tool")
    w.file("etc/odd", b"x" * 5, 0o600)  # lengths that need padding
    (tmp_path / "a.cpio.gz").write_bytes(w.gzipped())
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["cpio", "-idm", "--quiet"], input=gzip.decompress(w.gzipped()), cwd=out,
                   check=True)
    assert (out / "bin/tool").read_bytes() == b"#!/bin/sh\necho hi\n"
    assert os.stat(out / "bin/tool").st_mode & 0o777 == 0o755
    assert os.readlink(out / "bin/alias") == "tool"
    assert os.stat(out / "etc/odd").st_mode & 0o777 == 0o600


def test_same_entries_give_identical_archives():
    def build() -> bytes:
        w = CpioWriter()
        w.file("init", b"data", 0o755)
        return w.gzipped()

    assert build() == build()
