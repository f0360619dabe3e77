"""vmlinux extraction from a bzImage: header parsing, decompression, the PVH check."""

from __future__ import annotations

import gzip
import lzma
import struct

import pytest

from aenv.storage import vmlinux
from aenv.storage.errors import KernelError


def make_elf(*, pvh: bool) -> bytes:
    """A minimal ELF64 with one PT_NOTE segment holding a Xen note (type 18 = PVH entry)."""
    name = b"Xen\0"
    note_type = 18 if pvh else 5
    note = struct.pack("<III", len(name), 4, note_type) + name + struct.pack("<I", 0x1000000)
    ehdr_size, phdr_size = 64, 56
    note_off = ehdr_size + phdr_size
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    ehdr = ident + struct.pack(
        "<HHIQQQIHHHHHH", 2, 62, 1, 0x1000000, ehdr_size, 0, 0, ehdr_size, phdr_size, 1, 0, 0, 0
    )
    phdr = struct.pack("<IIQQQQQQ", 4, 4, note_off, 0, 0, len(note), len(note), 4)
    return ehdr + phdr + note + b"\0" * 200


def make_bzimage(payload: bytes, elf_size: int) -> bytes:
    setup_sects = 3
    data = payload + struct.pack("<I", elf_size)
    image = bytearray((setup_sects + 1) * 512)
    image[0x1F1] = setup_sects
    image[0x202:0x206] = b"HdrS"
    struct.pack_into("<H", image, 0x206, 0x20F)
    struct.pack_into("<II", image, 0x248, 0x40, len(data))
    return bytes(image) + b"\0" * 0x40 + data


def test_gzip_payload_decompresses_to_the_elf():
    elf = make_elf(pvh=True)
    assert vmlinux.extract(make_bzimage(gzip.compress(elf), len(elf))) == elf


def test_xz_payload_decompresses_to_the_elf():
    elf = make_elf(pvh=True)
    payload = lzma.compress(elf, format=lzma.FORMAT_XZ, check=lzma.CHECK_CRC32)
    assert vmlinux.extract(make_bzimage(payload, len(elf))) == elf


def test_kernel_without_pvh_note_is_refused():
    elf = make_elf(pvh=False)
    with pytest.raises(KernelError, match="PVH"):
        vmlinux.extract(make_bzimage(gzip.compress(elf), len(elf)))


def test_size_trailer_mismatch_is_refused():
    elf = make_elf(pvh=True)
    with pytest.raises(KernelError, match="header says"):
        vmlinux.extract(make_bzimage(gzip.compress(elf), len(elf) + 1))


def test_unknown_compression_is_named():
    with pytest.raises(KernelError, match="unknown kernel compression"):
        vmlinux.extract(make_bzimage(b"\x01\x02\x03\x04garbage", 10))


def test_a_file_without_boot_header_is_not_a_bzimage():
    with pytest.raises(KernelError, match="HdrS"):
        vmlinux.extract(b"\0" * 4096)
