"""Unit tests of the small pieces behind the filesystem service and ``/files``."""

from __future__ import annotations

import asyncio
import gzip
import os
import stat
import tempfile

import pytest
from connectrpc.code import Code
from connectrpc.errors import ConnectError
from starlette.datastructures import Headers

from aenv.envd.files.download import content_disposition
from aenv.envd.files.encoding import GZIP, IDENTITY, negotiate
from aenv.envd.files.errors import FilesHTTPError
from aenv.envd.files.gzip_stream import GzipEncoder
from aenv.envd.files.multipart import MultipartError, MultipartReader, parse_header_params
from aenv.envd.filesystem import mounts
from aenv.envd.filesystem.entry import go_permissions
from aenv.envd.filesystem.inotify import IN_CREATE, Inotify
from aenv.envd.filesystem.service import FilesystemService
from aenv.envd.proto import filesystem_pb as pb
from aenv.envd.state import EnvdState


@pytest.mark.parametrize("mode,text", [
    (stat.S_IFREG | 0o644, "-rw-r--r--"),
    (stat.S_IFDIR | 0o755, "drwxr-xr-x"),
    (stat.S_IFLNK | 0o777, "Lrwxrwxrwx"),
    (stat.S_IFDIR | stat.S_ISVTX | 0o777, "dtrwxrwxrwx"),
    (stat.S_IFREG | stat.S_ISUID | 0o755, "urwxr-xr-x"),
    (stat.S_IFCHR | 0o666, "Dcrw-rw-rw-"),
    (stat.S_IFIFO | 0o600, "prw-------"),
])
def test_permissions_string_matches_go_filemode(mode, text):
    assert go_permissions(mode) == text


@pytest.mark.parametrize("name,header", [
    ("a.txt", "inline; filename=a.txt"),
    ('a "b".txt', 'inline; filename="a \\"b\\".txt"'),
    ("żółw.txt", "inline; filename*=utf-8''%C5%BC%C3%B3%C5%82w.txt"),
])
def test_content_disposition_is_formatted_like_go(name, header):
    assert content_disposition(name) == header


@pytest.mark.parametrize("accept,coding", [
    (None, IDENTITY), ("gzip, deflate", GZIP), ("gzip", GZIP), ("identity", IDENTITY),
    ("br", IDENTITY), ("gzip;q=0.5, identity", IDENTITY), ("*;q=0, gzip", GZIP),
    ("*", IDENTITY), ("identity;q=0, *", GZIP),
])
def test_accept_encoding_negotiation(accept, coding):
    assert negotiate(accept) == coding


@pytest.mark.parametrize("accept", ["br, identity;q=0", "*;q=0", "gzip;q=0, identity;q=0"])
def test_nothing_acceptable_is_406(accept):
    with pytest.raises(FilesHTTPError) as info:
        negotiate(accept)
    assert info.value.status == 406


def test_adaptive_gzip_round_trips_mixed_chunks():
    chunks = [os.urandom(1 << 20), b"text " * 300_000, os.urandom(10), b""]
    encoder = GzipEncoder()
    stream = b"".join(encoder.encode(c) for c in chunks) + encoder.finish()
    assert gzip.decompress(stream) == b"".join(chunks)
    assert len(stream) < (1 << 20) + 100_000  # random stored, text deflated


def test_header_params_unescape_quotes_and_decode_rfc2231():
    kind, params = parse_header_params(
        'form-data; name="file"; filename="/a\\\\b \\"c\\".txt"; x*=utf-8\'\'%C5%BC'
    )
    assert kind == "form-data"
    assert params == {"name": "file", "filename": '/a\\b "c".txt', "x": "ż"}


async def _read_all(body: bytes, boundary: str, piece: int) -> list[tuple[str | None, bytes]]:
    async def chunks():
        for i in range(0, len(body), piece):
            yield body[i : i + piece]

    reader = MultipartReader(chunks(), boundary)
    parts = []
    while (part := await reader.next_part()) is not None:
        parts.append((part.filename, b"".join([c async for c in part])))
    return parts


@pytest.mark.parametrize("piece", [1, 3, 7, 64, 100_000])
def test_multipart_reader_finds_boundaries_across_any_split(piece):
    body = (b"preamble\r\n--bnd\r\n"
            b"Content-Disposition: form-data; name=\"file\"; filename=\"/d/a\"\r\n"
            b"\r\nfirst\r\n--bn not yet\r\n--bnd\r\nContent-Disposition: form-data; name=\"file\";"
            b" filename=\"b\"\r\nContent-Type: text/plain\r\n\r\n\r\n--bnd--\r\nepilogue")
    parts = asyncio.run(_read_all(body, "bnd", piece))
    assert parts == [("/d/a", b"first\r\n--bn not yet"), ("b", b"")]


def test_multipart_reader_rejects_a_body_without_closing_boundary():
    body = b"--bnd\r\nContent-Disposition: form-data; name=\"file\"\r\n\r\ndata"
    with pytest.raises(MultipartError):
        asyncio.run(_read_all(body, "bnd", 1000))


def test_statfs_magic_identifies_local_and_proc_filesystems():
    assert mounts.filesystem_magic("/proc") == 0x9FA0  # PROC_SUPER_MAGIC
    assert not mounts.is_network_mount("/proc")
    assert not mounts.is_network_mount(tempfile.gettempdir())


def test_inotify_read_returns_what_is_queued_without_blocking(tmp_path):
    ino = Inotify()
    try:
        wd = ino.add_watch(str(tmp_path), IN_CREATE)
        assert ino.read() == []
        (tmp_path / "f").write_text("x")
        (event,) = ino.read()
        assert (event.wd, event.name, event.mask & IN_CREATE) == (wd, "f", IN_CREATE)
    finally:
        ino.close()


class _Ctx:
    """The two things the service reads from a connectrpc RequestContext."""

    def __init__(self) -> None:
        self.request_headers = Headers()
        self.timeout_ms = None


def test_watch_on_a_network_mount_is_refused_unless_allowed(monkeypatch, tmp_path):
    monkeypatch.setattr(mounts, "filesystem_magic", lambda path: 0x6969)  # NFS
    service = FilesystemService(EnvdState(default_user="root"))

    async def create(allow: bool) -> str:
        req = pb.CreateWatcherRequest(path=str(tmp_path), allow_network_mounts=allow)
        return (await service.create_watcher(req, _Ctx())).watcher_id

    with pytest.raises(ConnectError) as info:
        asyncio.run(create(False))
    assert info.value.code == Code.INVALID_ARGUMENT and "network filesystem" in info.value.message

    async def allowed() -> None:
        watcher_id = await create(True)
        await service.remove_watcher(pb.RemoveWatcherRequest(watcher_id=watcher_id), _Ctx())

    asyncio.run(allowed())
