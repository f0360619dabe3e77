"""Streaming gzip for ``/files``: an adaptive encoder for downloads, a bounded decoder for uploads.

Encoder: the SDK asks for gzip on every download, but deflating data that does not shrink
(archives, images, random bytes) runs at ~60 MB/s here. So each chunk is sampled: if its
first 16 KiB deflates to less than 90 %, the chunk is deflated (level 1, ~1 GB/s on text),
otherwise it goes out as stored deflate blocks (a memcpy). Each chunk is an independent
run of deflate blocks ended by a sync flush, so runs from different compressors
concatenate into one valid stream; the gzip header, final block and CRC/size trailer are
written here. Any gzip reader decodes the result.

Decoder: inflates with a cap on each output piece, so a small compressed body cannot
become a large allocation, and accepts concatenated members like Go's reader.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import AsyncIterator

_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # no name, no mtime, OS unknown
_FINAL_EMPTY_STORED = b"\x01\x00\x00\xff\xff"
_STORED_MAX = 0xFFFF
_SAMPLE = 16 * 1024
_WORTH_IT = 0.9
_LEVEL = 1


class GzipEncoder:
    """Feed chunks in order; not thread-safe, but one chunk may be encoded in a worker."""

    def __init__(self) -> None:
        self._crc = 0
        self._size = 0
        self._started = False

    def encode(self, chunk: bytes) -> bytes:
        out = [] if self._started else [_HEADER]
        self._started = True
        self._crc = zlib.crc32(chunk, self._crc)
        self._size += len(chunk)
        if chunk:
            sample = chunk[:_SAMPLE]
            if len(zlib.compress(sample, _LEVEL)) < len(sample) * _WORTH_IT:
                deflater = zlib.compressobj(_LEVEL, zlib.DEFLATED, -zlib.MAX_WBITS)
                out.append(deflater.compress(chunk))
                out.append(deflater.flush(zlib.Z_SYNC_FLUSH))
            else:
                out.append(_stored_blocks(chunk))
        return b"".join(out)

    def finish(self) -> bytes:
        head = b"" if self._started else _HEADER
        self._started = True
        return head + _FINAL_EMPTY_STORED + struct.pack("<II", self._crc, self._size & 0xFFFFFFFF)


def _stored_blocks(data: bytes) -> bytes:
    """Non-final stored deflate blocks holding ``data`` (the stream is byte-aligned here)."""
    view = memoryview(data)
    parts: list[bytes | memoryview] = []
    for start in range(0, len(data), _STORED_MAX):
        block = view[start : start + _STORED_MAX]
        parts.append(struct.pack("<BHH", 0, len(block), len(block) ^ 0xFFFF))
        parts.append(block)
    return b"".join(parts)


class GzipDecodeError(ValueError):
    """The body is not valid gzip."""


async def gunzip(chunks: AsyncIterator[bytes], max_piece: int = 1 << 20) -> AsyncIterator[bytes]:
    """Inflate a gzip body (one or more members) arriving as ``chunks``."""
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
    in_member = False
    seen_any = False
    try:
        async for chunk in chunks:
            data = chunk
            while data:
                seen_any = in_member = True
                while True:
                    piece = inflater.decompress(data, max_piece)
                    if piece:
                        yield piece
                    data = inflater.unconsumed_tail
                    if inflater.eof or (not data and len(piece) < max_piece):
                        break
                if inflater.eof:
                    data = inflater.unused_data
                    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS)
                    in_member = False
    except zlib.error as e:
        raise GzipDecodeError(f"gzip: {e}") from None
    if in_member or not seen_any:
        raise GzipDecodeError("gzip: unexpected EOF")
