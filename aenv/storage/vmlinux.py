"""Turn a compressed x86 ``bzImage`` (a Debian ``vmlinuz``) into the ``vmlinux`` ELF inside it.

QEMU ``-M microvm`` and Firecracker can start an uncompressed ELF kernel at its PVH entry
point, which skips the in-guest decompression (about 0.7 s under TCG). The payload is found
from the boot-protocol header (``payload_offset``/``payload_length``); its first bytes name
the compression. gzip, bzip2, lzma and xz use the standard library; zstd, lz4 and lzo use the
Debian tools of the same name. The result must be an ELF with a PVH entry note.
"""

from __future__ import annotations

import bz2
import lzma
import struct
import subprocess
import zlib
from collections.abc import Callable
from typing import Protocol

from .errors import KernelError

ELF_MAGIC = b"\x7fELF"
_HDR_MAGIC = b"HdrS"
# XEN_ELFNOTE_PHYS32_ENTRY: the 32-bit entry point that PVH boot loaders jump to.
_PVH_NOTE_TYPE = 18
_PT_NOTE = 4


def _cli(argv: list[str]) -> Callable[[bytes], bytes]:
    def decompress(data: bytes) -> bytes:
        try:
            proc = subprocess.run(argv, input=data, capture_output=True, check=False)
        except FileNotFoundError as e:
            raise KernelError(f"{argv[0]} is needed to unpack this kernel: {e}") from None
        if proc.returncode != 0 and not proc.stdout.startswith(ELF_MAGIC):
            raise KernelError(f"{argv[0]} failed: {proc.stderr.decode(errors='replace')[-300:]}")
        return proc.stdout

    return decompress


def _gzip(data: bytes) -> bytes:
    return zlib.decompressobj(wbits=31).decompress(data)


class _Decompressor(Protocol):
    def decompress(self, data: bytes) -> bytes: ...


def _stream(factory: Callable[[], _Decompressor]) -> Callable[[bytes], bytes]:
    # Decompressor objects stop at the end of their stream and ignore the size trailer.
    def decompress(data: bytes) -> bytes:
        return factory().decompress(data)

    return decompress


# (magic, name, decompressor) -- the kernel's own list in arch/x86/boot/compressed.
_FORMATS: list[tuple[bytes, str, Callable[[bytes], bytes]]] = [
    (b"\x1f\x8b\x08", "gzip", _gzip),
    (b"\xfd7zXZ\x00", "xz", _stream(lambda: lzma.LZMADecompressor(lzma.FORMAT_XZ))),
    (b"BZh", "bzip2", _stream(bz2.BZ2Decompressor)),
    (b"\x5d\x00\x00", "lzma", _stream(lambda: lzma.LZMADecompressor(lzma.FORMAT_ALONE))),
    (b"\x28\xb5\x2f\xfd", "zstd", _cli(["zstd", "-dcq"])),
    (b"\x02\x21\x4c\x18", "lz4", _cli(["lz4", "-dcq"])),
    (b"\x89LZO\x00", "lzo", _cli(["lzop", "-dcq"])),
]


def payload(bzimage: bytes) -> tuple[str, bytes, int]:
    """(compression name, compressed stream, uncompressed size) of a bzImage."""
    if len(bzimage) < 0x250 or bzimage[0x202:0x206] != _HDR_MAGIC:
        raise KernelError("not a bzImage: no 'HdrS' boot-protocol header")
    version = struct.unpack_from("<H", bzimage, 0x206)[0]
    if version < 0x208:
        raise KernelError(f"boot protocol {version:#x} is too old to describe its payload")
    setup_sects = bzimage[0x1F1] or 4
    offset, length = struct.unpack_from("<II", bzimage, 0x248)
    start = (setup_sects + 1) * 512 + offset
    data = bzimage[start : start + length]
    if len(data) != length or length < 8:
        raise KernelError("bzImage payload lies outside the file")
    # The kernel build appends the uncompressed size (le32) to every compressed payload.
    size = struct.unpack_from("<I", data, len(data) - 4)[0]
    for magic, name, _ in _FORMATS:
        if data.startswith(magic):
            return name, data[:-4], size
    raise KernelError(f"unknown kernel compression (payload starts {data[:6].hex()})")


def extract(bzimage: bytes) -> bytes:
    """The ``vmlinux`` ELF inside ``bzimage``; raises ``KernelError`` if it has no PVH note."""
    name, data, size = payload(bzimage)
    decompress = next(fn for _, n, fn in _FORMATS if n == name)
    elf = decompress(data)
    if not elf.startswith(ELF_MAGIC):
        raise KernelError(f"{name} payload did not decompress to an ELF")
    if len(elf) != size:
        raise KernelError(f"{name} payload gave {len(elf)} bytes, header says {size}")
    if not has_pvh_note(elf):
        raise KernelError("kernel has no PVH entry note (needs CONFIG_PVH=y)")
    return elf


def has_pvh_note(elf: bytes) -> bool:
    """Whether a 64-bit little-endian ELF carries the Xen PHYS32_ENTRY note used by PVH."""
    if not elf.startswith(ELF_MAGIC) or elf[4] != 2 or elf[5] != 1:
        return False
    phoff, = struct.unpack_from("<Q", elf, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", elf, 0x36)
    for i in range(phnum):
        p_type, _flags, p_offset, _va, _pa, p_filesz = struct.unpack_from(
            "<IIQQQQ", elf, phoff + i * phentsize
        )
        if p_type != _PT_NOTE:
            continue
        pos, end = p_offset, p_offset + p_filesz
        while pos + 12 <= end:
            namesz, descsz, ntype = struct.unpack_from("<III", elf, pos)
            name = elf[pos + 12 : pos + 12 + namesz].rstrip(b"\0")
            if name == b"Xen" and ntype == _PVH_NOTE_TYPE:
                return True
            pos += 12 + _align4(namesz) + _align4(descsz)
    return False


def _align4(n: int) -> int:
    return (n + 3) & ~3
