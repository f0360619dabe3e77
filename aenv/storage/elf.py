"""The shared libraries an ELF file asks for (``DT_NEEDED``), and their closure in a tree.

Enough of ELF to copy a dynamically linked program out of one root filesystem into
another: ``needed(path)`` reads the ``DT_NEEDED`` names of a 64-bit little-endian ELF file
(what ``readelf -d`` prints as NEEDED), ``closure(tree, files)`` resolves them, and theirs,
in the library directories of ``tree`` the way glibc's loader would for a Debian x86-64
system. No ``ldd``: nothing of the tree is run, so a tree for another libc is read safely.
A library that is named but not found is an error naming the file that wanted it.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterable, Sequence
from pathlib import Path

from .errors import ImageError

# Where a Debian x86-64 tree keeps libraries, in the loader's search order (merged /usr
# or not).
LIBRARY_DIRS = ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib64", "lib", "usr/lib")
_MAGIC = b"\x7fELF"
_SHT_DYNAMIC = 6
_DT_NEEDED = 1


class ElfError(ImageError):
    """A file is not the ELF it should be, or a library it needs is missing."""


def is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == _MAGIC
    except OSError:
        return False


def needed(path: Path) -> list[str]:
    """The ``DT_NEEDED`` names of ``path`` in order ([] for a static file)."""
    data = path.read_bytes()
    if data[:4] != _MAGIC:
        raise ElfError(f"{path} is not an ELF file")
    if data[4] != 2 or data[5] != 1:
        raise ElfError(f"{path} is not a 64-bit little-endian ELF file")
    try:
        shoff, = struct.unpack_from("<Q", data, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize)
                    for i in range(shnum)]
        out: list[str] = []
        for _name, kind, _flags, _addr, offset, size, link, _info, _align, entsize in sections:
            if kind != _SHT_DYNAMIC:
                continue
            strtab = sections[link][4]
            for pos in range(offset, offset + size, entsize or 16):
                tag, value = struct.unpack_from("<qQ", data, pos)
                if tag == 0:
                    break
                if tag == _DT_NEEDED:
                    end = data.index(b"\0", strtab + value)
                    out.append(data[strtab + value:end].decode())
        return out
    except (struct.error, IndexError, ValueError) as e:
        raise ElfError(f"{path}: malformed ELF ({e})") from None


def find_library(tree: Path, name: str, dirs: Sequence[str] = LIBRARY_DIRS) -> Path | None:
    """``name`` in the first of ``dirs`` (relative to ``tree``) that has it, or None."""
    for d in dirs:
        candidate = tree / d / name
        if os.path.lexists(candidate):
            return candidate
    return None


def closure(tree: Path, files: Iterable[Path], dirs: Sequence[str] = LIBRARY_DIRS
            ) -> dict[str, Path]:
    """Every library ``files`` need, directly or through each other: soname -> its path in
    ``tree`` (symlinks left as found: the caller copies what they point to)."""
    found: dict[str, Path] = {}
    pending = [(f, f) for f in files]
    while pending:
        path, wanted_by = pending.pop()
        for name in needed(real_path(tree, path)):
            if name in found:
                continue
            lib = find_library(tree, name, dirs)
            if lib is None:
                raise ElfError(f"{name}, needed by {wanted_by}, is not in {tree}")
            found[name] = lib
            pending.append((lib, lib))
    return found


def real_path(tree: Path, path: Path) -> Path:
    """``path`` with symlinks followed inside ``tree`` (an absolute target is the tree's)."""
    for _ in range(40):
        if not path.is_symlink():
            return path
        target = os.readlink(path)
        path = tree / target.lstrip("/") if target.startswith("/") else path.parent / target
    raise ElfError(f"too many symlinks at {path}")
