"""``/files`` on the wire with plain httpx: headers, ranges, codings, and every error path."""

from __future__ import annotations

import gzip
import os
import subprocess
import tempfile
from collections.abc import Iterator
from email.utils import formatdate

import httpx
import pytest


@pytest.fixture
def client(control_plane, access_token) -> Iterator[httpx.Client]:
    headers = {"X-Access-Token": access_token}
    with httpx.Client(base_url=control_plane.envd.url, headers=headers, timeout=30) as c:
        yield c


def _put(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def test_identity_download_headers(client, home_dir):
    _put(f"{home_dir}/a b.txt", b"hello")
    r = client.get("/files", params={"path": f"{home_dir}/a b.txt"},
                   headers={"Accept-Encoding": "identity"})
    assert r.status_code == 200 and r.content == b"hello"
    assert r.headers["content-disposition"] == 'inline; filename="a b.txt"'
    assert r.headers["content-type"] == "text/plain; charset=utf-8"
    assert r.headers["content-length"] == "5"
    assert r.headers["accept-ranges"] == "bytes"
    mtime = int(os.stat(f"{home_dir}/a b.txt").st_mtime)
    assert r.headers["last-modified"] == formatdate(mtime, usegmt=True)
    assert "content-encoding" not in r.headers


def test_default_accept_encoding_gets_gzip(client, home_dir):
    data = b"compress me " * 10000
    _put(f"{home_dir}/c.log", data)
    with client.stream("GET", "/files", params={"path": f"{home_dir}/c.log"}) as r:
        raw = b"".join(r.iter_raw())
    assert r.headers["content-encoding"] == "gzip"
    assert gzip.decompress(raw) == data and len(raw) < len(data) // 10


def test_gzip_download_of_incompressible_data_is_valid_and_not_inflated(client, home_dir):
    data = os.urandom(3 << 20) + b"text " * 100000
    _put(f"{home_dir}/r.bin", data)
    with client.stream("GET", "/files", params={"path": f"{home_dir}/r.bin"},
                       headers={"Accept-Encoding": "gzip"}) as r:
        raw = b"".join(r.iter_raw())
    assert gzip.decompress(raw) == data
    assert len(raw) < (3 << 20) * 1.01 + 100_000


def test_empty_file_download_has_content_length_zero_even_with_gzip(client, home_dir):
    _put(f"{home_dir}/e", b"")
    r = client.get("/files", params={"path": f"{home_dir}/e"}, headers={"Accept-Encoding": "gzip"})
    assert r.status_code == 200 and r.headers["content-length"] == "0" and r.content == b""


@pytest.mark.parametrize("spec,status,body", [
    ("bytes=2-5", 206, b"2345"), ("bytes=-3", 206, b"789"), ("bytes=7-", 206, b"789"),
    ("bytes=1-2,4-5", 200, b"0123456789"),
])
def test_range_requests(client, home_dir, spec, status, body):
    _put(f"{home_dir}/n", b"0123456789")
    r = client.get("/files", params={"path": f"{home_dir}/n"}, headers={"Range": spec})
    assert (r.status_code, r.content) == (status, body)
    if status == 206:
        assert r.headers["content-range"].endswith("/10") and "content-encoding" not in r.headers


def test_unsatisfiable_range_is_416(client, home_dir):
    _put(f"{home_dir}/n", b"0123456789")
    r = client.get("/files", params={"path": f"{home_dir}/n"}, headers={"Range": "bytes=50-"})
    assert r.status_code == 416 and r.headers["content-range"] == "bytes */10"


def test_if_modified_since_gives_304(client, home_dir):
    _put(f"{home_dir}/n", b"x")
    since = formatdate(os.stat(f"{home_dir}/n").st_mtime + 10, usegmt=True)
    r = client.get("/files", params={"path": f"{home_dir}/n"}, headers={"If-Modified-Since": since})
    assert r.status_code == 304 and r.content == b""


def test_unacceptable_encoding_is_406(client, home_dir):
    _put(f"{home_dir}/n", b"x")
    r = client.get("/files", params={"path": f"{home_dir}/n"},
                   headers={"Accept-Encoding": "br, identity;q=0"})
    assert r.status_code == 406 and r.json()["code"] == 406


def test_missing_file_is_404_with_upstream_message(client, home_dir):
    r = client.get("/files", params={"path": f"{home_dir}/nope"})
    assert r.status_code == 404
    assert r.json() == {"code": 404, "message": f"path '{home_dir}/nope' does not exist"}


def test_directory_download_is_400(client, home_dir):
    assert client.get("/files", params={"path": home_dir}).status_code == 400


def test_unknown_user_is_401(client, home_dir):
    _put(f"{home_dir}/n", b"x")
    r = client.get("/files", params={"path": f"{home_dir}/n", "username": "nobody-here"})
    assert r.status_code == 401
    r = client.post("/files", params={"path": f"{home_dir}/u", "username": "nobody-here"},
                    content=b"x", headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 401 and not os.path.exists(f"{home_dir}/u")


def test_multipart_filename_is_the_full_target_path(client, home_dir):
    rel = os.path.basename(home_dir) + "/sub/rel.txt"
    files = [
        ("file", (f"{home_dir}/abs.txt", b"A")), ("other", ("ignored", b"?")), ("file", (rel, b"B"))
    ]
    r = client.post("/files", files=files)
    assert r.status_code == 200
    assert [e["path"] for e in r.json()] == [f"{home_dir}/abs.txt", f"{home_dir}/sub/rel.txt"]
    with open(f"{home_dir}/sub/rel.txt", "rb") as f:
        assert f.read() == b"B"
    assert not os.path.exists(f"{home_dir}/ignored")


def test_multipart_with_two_parts_to_one_target_is_400(client, home_dir):
    files = [("file", (f"{home_dir}/same", b"1")), ("file", (f"{home_dir}/same", b"2"))]
    r = client.post("/files", files=files)
    assert r.status_code == 400 and "same path" in r.json()["message"]


def test_truncated_multipart_is_400_and_leaves_no_file(client, home_dir):
    body = (b"--XyZ\r\nContent-Disposition: form-data; name=\"file\"; filename=\"%s/t\"\r\n"
            b"\r\npartial" % home_dir.encode())
    r = client.post("/files", content=body,
                    headers={"Content-Type": "multipart/form-data; boundary=XyZ"})
    assert r.status_code == 400 and not os.path.exists(f"{home_dir}/t")
    assert client.get("/health").status_code == 204


def test_octet_stream_without_path_is_400(client):
    r = client.post("/files", content=b"x", headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 400 and "path query parameter is required" in r.json()["message"]


def test_unsupported_content_type_is_400(client, home_dir):
    r = client.post("/files", params={"path": f"{home_dir}/x"}, content=b"x",
                    headers={"Content-Type": "text/plain"})
    assert r.status_code == 400 and not os.path.exists(f"{home_dir}/x")


def test_body_that_is_not_gzip_is_400_and_leaves_no_file(client, home_dir):
    headers = {"Content-Type": "application/octet-stream", "Content-Encoding": "gzip"}
    r = client.post("/files", params={"path": f"{home_dir}/g"}, content=b"not gzip at all",
                    headers=headers)
    assert r.status_code == 400 and not os.path.exists(f"{home_dir}/g")


def test_unsupported_content_encoding_is_400(client, home_dir):
    r = client.post("/files", params={"path": f"{home_dir}/g"}, content=b"x",
                    headers={"Content-Type": "application/octet-stream", "Content-Encoding": "br"})
    assert r.status_code == 400 and not os.path.exists(f"{home_dir}/g")


@pytest.mark.parametrize("name,value", [
    ("X-Metadata-k", "caf\xe9"), ("X-Metadata-" + "k" * 247, "v"),
])
def test_invalid_metadata_is_400_and_creates_no_file(client, home_dir, name, value):
    headers = {"Content-Type": "application/octet-stream", name: value.encode("latin-1")}
    r = client.post("/files", params={"path": f"{home_dir}/m"}, content=b"x", headers=headers)
    assert r.status_code == 400 and "invalid metadata" in r.json()["message"]
    assert not os.path.exists(f"{home_dir}/m")


@pytest.fixture
def tiny_fs() -> Iterator[str]:
    """A 256 KiB tmpfs, to run out of space on purpose."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tempfile.mkdtemp(prefix="aenv-tiny-")
    mount = ["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", mnt]
    if subprocess.run(mount, check=False).returncode:
        os.rmdir(mnt)
        pytest.skip("cannot mount tmpfs here")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", mnt], check=False)
        os.rmdir(mnt)


def test_out_of_space_is_507_and_the_partial_file_is_removed(client, tiny_fs):
    r = client.post("/files", params={"path": f"{tiny_fs}/big"}, content=b"\0" * (4 << 20),
                    headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 507 and r.json()["code"] == 507
    assert not os.path.exists(f"{tiny_fs}/big")


@pytest.fixture
def read_only_fs(tiny_fs) -> str:
    subprocess.run(["mount", "-o", "remount,ro", tiny_fs], check=True)
    return tiny_fs


def test_kernel_refusals_are_403_and_permission_denied(client, read_only_fs):
    r = client.post("/files", params={"path": f"{read_only_fs}/f"}, content=b"x",
                    headers={"Content-Type": "application/octet-stream"})
    assert r.status_code == 403
    r = client.post("/filesystem.Filesystem/MakeDir", json={"path": f"{read_only_fs}/d"},
                    headers={"Connect-Protocol-Version": "1"})
    assert r.status_code == 403 and r.json()["code"] == "permission_denied"
