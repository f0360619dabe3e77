"""COPY sources: the files selected, their ``filesHash`` and their archive are the E2B
SDK's (its functions are the reference here; aenv itself never imports the SDK)."""

from __future__ import annotations

import os
import tarfile
from pathlib import Path

import pytest
from e2b.template import utils as sdk

from aenv.client.build_files import (
    BuildFilesError,
    files_hash,
    read_dockerignore,
    select_files,
    tar_archive,
)

SOURCES = [".", "a.txt", "sub", "sub/", "sub/*", "**/*.py", "*.txt", "link", "*.log", "**"]


@pytest.fixture
def context(tmp_path: Path) -> Path:
    (tmp_path / "sub/deep").mkdir(parents=True)
    (tmp_path / ".hidden").mkdir()
    (tmp_path / "a.txt").write_text("hello\n")
    (tmp_path / "sub/b.txt").write_text("b\n")
    (tmp_path / "sub/deep/c.py").write_text("print(1)\n")
    (tmp_path / ".hidden/x").write_text("x")
    (tmp_path / "k.log").write_text("log")
    (tmp_path / "keep.log").write_text("keep")
    os.symlink("a.txt", tmp_path / "link")
    os.chmod(tmp_path / "sub/deep/c.py", 0o755)
    return tmp_path


@pytest.mark.parametrize("src", SOURCES)
def test_selection_and_hash_match_the_sdk(context: Path, src: str) -> None:
    assert select_files(src, context, []) == sdk.get_all_files_in_path(src, str(context), [])
    assert files_hash(src, "/dest/", context, []) == sdk.calculate_files_hash(
        src, "/dest/", str(context), [], False, None)


@pytest.mark.parametrize("src", SOURCES)
def test_dockerignore_rules_match_the_sdk(context: Path, src: str) -> None:
    (context / ".dockerignore").write_text("# comment\nsub/deep\n*.log\n!keep.log\n")
    ignore = read_dockerignore(context)
    assert ignore == sdk.read_dockerignore(str(context))
    assert select_files(src, context, ignore) == sdk.get_all_files_in_path(
        src, str(context), ignore)


def test_hash_changes_with_content_and_destination(context: Path) -> None:
    before = files_hash("a.txt", "/d", context, [])
    assert files_hash("a.txt", "/other", context, []) != before
    (context / "a.txt").write_text("changed\n")
    assert files_hash("a.txt", "/d", context, []) != before


def test_archive_holds_what_the_sdk_archive_holds(context: Path) -> None:
    archive, size = tar_archive(".", context, [])
    with archive, tarfile.open(fileobj=archive) as ours:
        assert size == os.fstat(archive.fileno()).st_size
        with (
            sdk.tar_file_stream(".", str(context), [], False, True) as theirs_file,
            tarfile.open(fileobj=theirs_file) as theirs,
        ):
            assert ours.getnames() == theirs.getnames()
        link = ours.getmember("link")
        assert link.issym() and link.linkname == "a.txt"
        assert ours.extractfile("sub/deep/c.py").read() == b"print(1)\n"


def test_sources_outside_the_context_are_refused(context: Path) -> None:
    for src in ("/etc/passwd", "../x", "sub/../../x"):
        with pytest.raises(BuildFilesError):
            files_hash(src, "/d", context, [])


def test_a_source_that_matches_nothing_is_refused(context: Path) -> None:
    with pytest.raises(BuildFilesError, match="matches no files"):
        files_hash("nothing-*", "/d", context, [])
