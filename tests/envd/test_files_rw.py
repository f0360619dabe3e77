"""files.read / files.write / write_files through the real SDK, sync and async."""

from __future__ import annotations

import io
import os

import pytest
from e2b import FileNotFoundException, FileType, InvalidArgumentException

TEXT_230K = "".join(f"line {i:06d} of a fairly long text file\n" for i in range(6000))


@pytest.mark.parametrize(
    "data", ["hello", "", TEXT_230K, "zażółć ✓"], ids=["str", "empty", "230k", "utf8"]
)
def test_write_then_read_text_round_trips(sandbox, home_path, data):
    info = sandbox.files.write(f"{home_path}/t.txt", data)
    assert (info.path, info.name, info.type) == (f"{home_path}/t.txt", "t.txt", FileType.FILE)
    assert sandbox.files.read(f"{home_path}/t.txt") == data


@pytest.mark.parametrize("data", [b"\x00\x01\xff" * 1000, b""], ids=["binary", "empty"])
def test_write_then_read_bytes_round_trips(sandbox, home_path, data):
    sandbox.files.write(f"{home_path}/b.bin", data)
    assert sandbox.files.read(f"{home_path}/b.bin", format="bytes") == bytearray(data)


def test_written_file_is_0644_and_owned_by_the_user_with_parents(sandbox, home_path):
    sandbox.files.write(f"{home_path}/deep/er/f.txt", "x")
    st = os.stat(f"{home_path}/deep/er/f.txt")
    assert (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o644, 1001, 1001)
    st = os.stat(f"{home_path}/deep")
    assert (st.st_mode & 0o777, st.st_uid) == (0o755, 1001)


def test_overwrite_truncates(sandbox, home_path):
    sandbox.files.write(f"{home_path}/f", "a long first version")
    sandbox.files.write(f"{home_path}/f", "short")
    assert sandbox.files.read(f"{home_path}/f") == "short"


def test_write_as_root_creates_root_owned_file(sandbox, home_path):
    sandbox.files.write(f"{home_path}/r.txt", "x", user="root")
    assert os.stat(f"{home_path}/r.txt").st_uid == 0


@pytest.mark.parametrize(
    "make",
    [lambda: io.BytesIO(b"bytes io" * 5000), lambda: io.StringIO("string io" * 5000)],
    ids=["BytesIO", "StringIO"],
)
def test_write_file_like_objects(sandbox, home_path, make):
    sandbox.files.write(f"{home_path}/io", make())
    expected = make().read()
    expected = expected if isinstance(expected, bytes) else expected.encode()
    assert bytes(sandbox.files.read(f"{home_path}/io", format="bytes")) == expected


def test_write_chunk_iterable_streams_octet_stream(sandbox, home_path):
    chunks = [os.urandom(100_000) for _ in range(5)]
    sandbox.files.write(f"{home_path}/it.bin", iter(chunks))
    with open(f"{home_path}/it.bin", "rb") as f:
        assert f.read() == b"".join(chunks)


def test_gzip_upload_then_plain_download_and_back(sandbox, home_path):
    sandbox.files.write(f"{home_path}/g.txt", TEXT_230K, gzip=True)
    assert sandbox.files.read(f"{home_path}/g.txt") == TEXT_230K
    sandbox.files.write(f"{home_path}/p.txt", TEXT_230K)
    assert sandbox.files.read(f"{home_path}/p.txt", gzip=True) == TEXT_230K


def test_octet_stream_upload_of_str(sandbox, home_path):
    sandbox.files.write(f"{home_path}/o.txt", "octet", use_octet_stream=True)
    assert sandbox.files.read(f"{home_path}/o.txt") == "octet"


def test_write_files_keeps_request_order(sandbox, home_path):
    files = [{"path": f"{home_path}/multi/f{9 - i}.txt", "data": f"content {i}"} for i in range(10)]
    infos = sandbox.files.write_files(files)
    assert [i.path for i in infos] == [f["path"] for f in files]
    assert all(i.type == FileType.FILE for i in infos)
    for f in files:
        assert sandbox.files.read(f["path"]) == f["data"]


def test_stream_read_can_stop_early(sandbox, home_path):
    data = os.urandom(8 << 20)
    sandbox.files.write(f"{home_path}/big.bin", data)
    with sandbox.files.read(f"{home_path}/big.bin", format="stream") as stream:
        first = next(stream)
    assert data.startswith(first)
    chunks = list(sandbox.files.read(f"{home_path}/big.bin", format="stream"))
    assert b"".join(chunks) == data  # the connection is still usable afterwards


def test_read_of_missing_file_is_file_not_found(sandbox, home_path):
    with pytest.raises(FileNotFoundException, match="does not exist"):
        sandbox.files.read(f"{home_path}/nope")


def test_read_of_directory_is_invalid_argument(sandbox, home_path):
    os.mkdir(home_path)
    with pytest.raises(InvalidArgumentException, match="is a directory"):
        sandbox.files.read(home_path)


def test_write_onto_a_directory_is_invalid_argument(sandbox, home_path):
    os.makedirs(f"{home_path}/d")
    with pytest.raises(InvalidArgumentException, match="is a directory"):
        sandbox.files.write(f"{home_path}/d", "x")


async def test_async_write_read_variants(async_sandbox, home_path):
    files = async_sandbox.files
    await files.write(f"{home_path}/a.txt", TEXT_230K)
    assert await files.read(f"{home_path}/a.txt") == TEXT_230K
    await files.write(f"{home_path}/e", b"")
    assert await files.read(f"{home_path}/e", format="bytes") == bytearray()
    await files.write(f"{home_path}/z.txt", "zipped", gzip=True)
    assert await files.read(f"{home_path}/z.txt", gzip=True) == "zipped"
    await files.write(f"{home_path}/io.bin", io.BytesIO(b"abc" * 1000))
    assert await files.read(f"{home_path}/io.bin", format="bytes") == bytearray(b"abc" * 1000)
    entries = [{"path": f"{home_path}/m{i}", "data": str(i)} for i in range(10)]
    infos = await files.write_files(entries)
    assert [i.name for i in infos] == [f"m{i}" for i in range(10)]


async def test_async_stream_read_can_stop_early(async_sandbox, home_path):
    data = os.urandom(4 << 20)
    await async_sandbox.files.write(f"{home_path}/big.bin", data)
    stream = await async_sandbox.files.read(f"{home_path}/big.bin", format="stream")
    async with stream:
        first = await anext(stream)
    assert data.startswith(first)
    with pytest.raises(FileNotFoundException):
        await async_sandbox.files.read(f"{home_path}/missing")
