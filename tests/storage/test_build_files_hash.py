"""``filesHash`` recomputed from an uploaded COPY archive (``aenv.storage.build_archives``).

Archives and hashes come from the E2B SDK's own ``tar_file_stream`` and
``calculate_files_hash`` (and aenv's CLI, which follows them), over contexts with files,
directories, symlinks, hard links and a FIFO; then archives are tampered with.
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from pathlib import Path

import pytest
from e2b.template.utils import calculate_files_hash, tar_file_stream

from aenv.client import build_files as cli_files
from aenv.storage.build_archives import ArchiveError, HashCheck, verify_files_hash

DEST = "/app/"


@pytest.fixture
def context(tmp_path: Path) -> Path:
    ctx = tmp_path / "ctx"
    (ctx / "app/sub").mkdir(parents=True)
    (ctx / "a.txt").write_text("hello\n")
    (ctx / "b.txt").write_bytes(os.urandom(3000))
    (ctx / "app/main.py").write_text("print('hi')\n")
    (ctx / "app/sub/deep.txt").write_text("deep\n")
    (ctx / "app/sub").chmod(0o751)
    (ctx / "run.sh").write_text("#!/bin/sh\n")
    (ctx / "run.sh").chmod(0o755)
    (ctx / "link").symlink_to("a.txt")
    os.link(ctx / "app/main.py", ctx / "app/hard.py")
    os.mkfifo(ctx / "app/fifo")
    (ctx / ".dockerignore").write_text("b.txt\n")
    return ctx


def sdk_upload(context: Path, tmp_path: Path, src: str, *, gzip: bool = True,
               resolve_symlinks: bool = False, ignore: list[str] | None = None
               ) -> tuple[Path, str]:
    """(archive, filesHash) exactly as ``Template.build`` makes them."""
    ignore = ignore or []
    files_hash = calculate_files_hash(src, DEST, str(context), ignore, resolve_symlinks, None)
    with tar_file_stream(src, str(context), ignore, resolve_symlinks, gzip) as f:
        out = tmp_path / f"{files_hash}.tar"
        out.write_bytes(f.read())
    return out, files_hash


@pytest.mark.parametrize("src", ["a.txt", "app", ".", "*.txt", "app/**", "link", "app/sub"])
@pytest.mark.parametrize("gzip", [True, False])
@pytest.mark.parametrize("resolve_symlinks", [False, True])
def test_sdk_archives_match_their_hash(context, tmp_path, src, gzip, resolve_symlinks) -> None:
    archive, h = sdk_upload(context, tmp_path, src, gzip=gzip, resolve_symlinks=resolve_symlinks)
    assert verify_files_hash(archive, src=src, dest=DEST, files_hash=h) is HashCheck.MATCH


def test_ignore_patterns_are_in_both_the_archive_and_the_hash(context, tmp_path) -> None:
    archive, h = sdk_upload(context, tmp_path, ".", ignore=["b.txt", "app/sub"])
    assert verify_files_hash(archive, src=".", dest=DEST, files_hash=h) is HashCheck.MATCH


def test_the_cli_archives_match_too(context, tmp_path) -> None:
    ignore = cli_files.read_dockerignore(context)
    h = cli_files.files_hash("app", DEST, context, ignore)
    f, _ = cli_files.tar_archive("app", context, ignore)
    with f:
        (tmp_path / "cli.tar").write_bytes(f.read())
    assert verify_files_hash(tmp_path / "cli.tar", src="app", dest=DEST,
                             files_hash=h) is HashCheck.MATCH


def _rewrite(archive: Path, out: Path, change) -> Path:
    """A copy of ``archive`` with each member passed through ``change(info, data)``."""
    buf = io.BytesIO()
    with tarfile.open(archive, "r:*") as src, tarfile.open(fileobj=buf, mode="w") as dst:
        for m in src.getmembers():
            data = src.extractfile(m).read() if m.isreg() else None
            m, data = change(m, data)
            dst.addfile(m, io.BytesIO(data) if data is not None else None)
    out.write_bytes(buf.getvalue())
    return out


def test_changed_content_of_the_same_size_is_a_mismatch(context, tmp_path) -> None:
    archive, h = sdk_upload(context, tmp_path, "*.txt")

    def flip(m, data):
        return m, (data[:-1] + bytes([data[-1] ^ 1])) if data else data
    bad = _rewrite(archive, tmp_path / "bad.tar", flip)
    assert verify_files_hash(bad, src="*.txt", dest=DEST, files_hash=h) is HashCheck.MISMATCH


def test_a_changed_mode_is_a_mismatch(context, tmp_path) -> None:
    archive, h = sdk_upload(context, tmp_path, "run.sh")

    def chmod(m, data):
        m.mode = 0o777
        return m, data
    bad = _rewrite(archive, tmp_path / "bad.tar", chmod)
    assert verify_files_hash(bad, src="run.sh", dest=DEST, files_hash=h) is HashCheck.MISMATCH


def test_an_extra_member_is_a_mismatch(context, tmp_path) -> None:
    archive, h = sdk_upload(context, tmp_path, "a.txt")
    with tarfile.open(archive, "r:*") as src, tarfile.open(tmp_path / "bad.tar", "w") as dst:
        m = src.getmember("a.txt")
        dst.addfile(m, src.extractfile(m))
        extra = tarfile.TarInfo("extra.txt")
        extra.size = 1
        dst.addfile(extra, io.BytesIO(b"x"))
    assert verify_files_hash(tmp_path / "bad.tar", src="a.txt", dest=DEST,
                             files_hash=h) is HashCheck.MISMATCH


def test_the_hash_covers_src_and_dest(context, tmp_path) -> None:
    archive, h = sdk_upload(context, tmp_path, "a.txt")
    assert verify_files_hash(archive, src="a.txt", dest="/elsewhere",
                             files_hash=h) is HashCheck.MISMATCH


def test_a_tampered_archive_with_directories_cannot_be_told_from_a_js_one(
        context, tmp_path) -> None:
    """The documented limit: the JS SDK hashes directory sizes the archive lacks."""
    archive, h = sdk_upload(context, tmp_path, "app")

    def flip(m, data):
        return m, (b"X" + data[1:]) if data else data
    bad = _rewrite(archive, tmp_path / "bad.tar", flip)
    assert verify_files_hash(bad, src="app", dest=DEST,
                             files_hash=h) is HashCheck.UNVERIFIABLE


def _js_files_hash(src: str, dest: str, context: Path, rel_paths: list[str]) -> str:
    """``calculateFilesHash`` of the JS SDK (e2b 2.x): like Python's, but every entry's
    size is hashed, directories' included."""
    h = hashlib.sha256(f"COPY {src} {dest}".encode())
    for rel in sorted(rel_paths, key=lambda r: str(context / r)):
        p = context / rel
        h.update(rel.encode())
        st = p.lstat()
        h.update(str(st.st_mode).encode() + str(st.st_size).encode())
        if stat.S_ISLNK(st.st_mode):
            h.update(os.readlink(p).encode())
        elif stat.S_ISREG(st.st_mode):
            h.update(p.read_bytes())
    return h.hexdigest()


def test_a_js_hash_matches_without_directories_and_is_unverifiable_with(
        context, tmp_path) -> None:
    files_only, _ = sdk_upload(context, tmp_path, "*.txt", ignore=["b.txt"])
    js = _js_files_hash("*.txt", DEST, context, ["a.txt"])
    assert verify_files_hash(files_only, src="*.txt", dest=DEST, files_hash=js) \
        is HashCheck.MATCH
    with_dir, _ = sdk_upload(context, tmp_path, "app/sub")
    js = _js_files_hash("app/sub", DEST, context, ["app/sub", "app/sub/deep.txt"])
    assert verify_files_hash(with_dir, src="app/sub", dest=DEST, files_hash=js) \
        is HashCheck.UNVERIFIABLE


def test_a_hash_made_on_windows_matches(context, tmp_path) -> None:
    """The Python SDK on Windows hashes relative paths with backslashes."""
    archive, _ = sdk_upload(context, tmp_path, "app/sub")
    h = hashlib.sha256(f"COPY app/sub {DEST}".encode())
    for rel in ("app\\sub", "app\\sub\\deep.txt"):
        p = context / rel.replace("\\", "/")
        st = p.stat()
        h.update(rel.encode() + str(st.st_mode).encode())
        if p.is_file():
            h.update(str(st.st_size).encode() + p.read_bytes())
    assert verify_files_hash(archive, src="app/sub", dest=DEST,
                             files_hash=h.hexdigest()) is HashCheck.MATCH


def test_something_that_is_not_a_tar_is_an_archive_error(tmp_path) -> None:
    (tmp_path / "x.tar").write_bytes(b"no tar here" * 100)
    with pytest.raises(ArchiveError):
        verify_files_hash(tmp_path / "x.tar", src="a", dest="b", files_hash="0" * 64)


async def test_check_before_copy_discards_a_mismatching_archive(context, tmp_path) -> None:
    from aenv.storage.build_archives import FilesHashMismatch, check_before_copy

    archive, h = sdk_upload(context, tmp_path, "a.txt")
    assert await check_before_copy(archive, src="a.txt", dest=DEST,
                                   files_hash=h) is HashCheck.MATCH
    with pytest.raises(FilesHashMismatch, match="do not match their hash"):
        await check_before_copy(archive, src="a.txt", dest="/other", files_hash=h)
    assert not archive.exists()


async def test_check_before_copy_keeps_an_unverifiable_archive(context, tmp_path) -> None:
    from aenv.storage.build_archives import check_before_copy

    archive, _ = sdk_upload(context, tmp_path, "app")
    assert await check_before_copy(archive, src="app", dest=DEST,
                                   files_hash="0" * 64) is HashCheck.UNVERIFIABLE
    assert archive.exists()


async def test_check_before_copy_discards_an_unreadable_archive(tmp_path) -> None:
    from aenv.storage.build_archives import FilesHashMismatch, check_before_copy

    junk = tmp_path / "junk.tar"
    junk.write_bytes(b"junk" * 1000)
    with pytest.raises(FilesHashMismatch, match="cannot be read"):
        await check_before_copy(junk, src="a", dest="b", files_hash="0" * 64)
    assert not junk.exists()
