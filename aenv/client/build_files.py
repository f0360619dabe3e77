"""The local side of a template's COPY steps: which files a source selects, the
``filesHash`` that names them, and the tar archive that carries them.

This follows the E2B SDK's contract so that a COPY built here and the same COPY built with
``Template.build`` share the server's cached upload:

* a source is a glob (``**`` spans directories, dot files match) relative to the context
  directory; a matched directory brings everything under it; ``.dockerignore`` patterns
  in the context leave files out (a pattern that names a directory leaves out what is
  under it, ``!`` brings paths back, the last matching pattern wins);
* ``filesHash`` = sha256 of ``"COPY <src> <dest>"``, then per selected path in sorted
  order its path relative to the context, its ``st_mode``, its size (not for
  directories), and either its link target (a symlink, kept as a link) or its content
  (a regular file); owners and mtimes are left out so the hash is the same on any
  machine;
* the archive is a gzip'ed tar with those paths relative to the context, symlinks kept
  as links, spooled to a temporary file so it uploads as a stream.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
import stat
import tarfile
import tempfile
from pathlib import Path
from typing import IO

from wcmatch import glob

_GLOB_FLAGS = glob.GLOBSTAR | glob.DOTMATCH
_CHUNK = 1 << 20


class BuildFilesError(Exception):
    """A COPY source is invalid or selects nothing."""


def read_dockerignore(context: Path) -> list[str]:
    path = context / ".dockerignore"
    if not path.exists():
        return []
    lines = path.read_text(encoding="utf-8-sig").splitlines()
    return [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]


class IgnoreRules:
    """``.dockerignore`` patterns against paths relative to the context (``a/b``)."""

    def __init__(self, patterns: list[str]) -> None:
        self.rules: list[tuple[bool, str]] = []
        for raw in patterns:
            negate = raw.startswith("!")
            pattern = raw[1:].strip() if negate else raw.strip()
            pattern = posixpath.normpath(pattern.lstrip("/")) if pattern else ""
            if pattern and pattern != ".":
                self.rules.append((negate, pattern))
        self.has_negations = any(n for n, _ in self.rules)

    def ignored(self, relative: str) -> bool:
        # A path is matched by a pattern that matches it or one of its parent directories.
        candidates = [relative]
        parent = posixpath.dirname(relative)
        while parent:
            candidates.append(parent)
            parent = posixpath.dirname(parent)
        result = False
        for negate, pattern in self.rules:
            if any(glob.globmatch(c, pattern, flags=_GLOB_FLAGS) for c in candidates):
                result = not negate
        return result


def check_source(src: str) -> None:
    """Sources are relative and stay inside the context (as the SDK requires)."""
    if os.path.isabs(src):
        raise BuildFilesError(f"COPY source '{src}' is absolute: use a path inside the "
                              "context directory")
    normalized = os.path.normpath(src)
    if normalized == ".." or normalized.startswith(".." + os.sep):
        raise BuildFilesError(f"COPY source '{src}' leaves the context directory")


def select_files(src: str, context: Path, ignore: list[str]) -> list[str]:
    """Absolute paths (sorted) that the COPY source ``src`` brings into the image."""
    check_source(src)
    root = os.path.abspath(context)
    rules = IgnoreRules(ignore)
    selected: set[str] = set()

    def walk(directory: str, relative: str) -> None:
        with os.scandir(directory) as entries:
            for entry in entries:
                rel = entry.name if relative == "." else f"{relative}/{entry.name}"
                skip = rules.ignored(rel)
                if not skip:
                    selected.add(entry.path)
                if entry.is_dir(follow_symlinks=False) and (not skip or rules.has_negations):
                    walk(entry.path, rel)

    matches = []
    for match in glob.glob(src, flags=_GLOB_FLAGS, root_dir=root):
        path = os.path.normpath(os.path.join(root, match))
        matches.append((path, os.path.relpath(path, root).replace(os.sep, "/")))
    # Parents first, so a directory's walk covers matches beneath it.
    matches.sort(key=lambda m: 0 if m[1] == "." else m[1].count("/") + 1)
    walked: list[str] = []
    for path, rel in matches:
        if "." in walked or any(rel.startswith(w + "/") for w in walked):
            continue
        if rel != "." and rules.ignored(rel):
            continue
        if os.path.isdir(path) and not os.path.islink(path):
            selected.add(path)
            walk(path, rel)
            walked.append(rel)
        else:
            selected.add(path)
    return sorted(selected)


def files_hash(src: str, dest: str, context: Path, ignore: list[str]) -> str:
    files = select_files(src, context, ignore)
    if not files:
        raise BuildFilesError(f"COPY source '{src}' matches no files in {context}")
    h = hashlib.sha256(f"COPY {src} {dest}".encode())
    for path in files:
        h.update(os.path.relpath(path, context).encode())
        st = os.lstat(path) if os.path.islink(path) else os.stat(path)
        h.update(str(st.st_mode).encode())
        if not stat.S_ISDIR(st.st_mode):
            h.update(str(st.st_size).encode())
        if stat.S_ISLNK(st.st_mode):
            h.update(os.readlink(path).encode())
        elif stat.S_ISREG(st.st_mode):
            with open(path, "rb") as f:
                while block := f.read(_CHUNK):
                    h.update(block)
    return h.hexdigest()


def tar_archive(src: str, context: Path, ignore: list[str]) -> tuple[IO[bytes], int]:
    """(archive positioned at its start, its size); closing it deletes it."""
    archive = tempfile.TemporaryFile()  # noqa: SIM115 - returned open; the caller closes it
    try:
        with tarfile.open(fileobj=archive, mode="w:gz", dereference=False) as tar:
            for path in select_files(src, context, ignore):
                tar.add(path, arcname=os.path.relpath(path, context), recursive=False)
        size = archive.tell()
        archive.seek(0)
        return archive, size
    except BaseException:
        archive.close()
        raise
