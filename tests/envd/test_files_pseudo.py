"""``/files`` of kernel pseudo-files (``st_size`` 0 but content), next to regular files.

Pseudo-files are read to EOF: a ``Content-Length`` when the content ended within the first
read, chunked otherwise; never a Range, a ``Last-Modified`` or a 304. Devices, FIFOs and
sockets stay a 400. Regular files keep their size, Range and gzip behaviour.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest
from starlette.datastructures import Headers

from aenv.envd.files import download
from tests.conftest import ROOT

BOOT_ID = "/proc/sys/kernel/random/boot_id"


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _cpuinfo_without_mhz(text: str) -> list[str]:
    # "cpu MHz" follows frequency scaling between two reads; every other line is fixed.
    return [line for line in text.splitlines() if not line.startswith("cpu MHz")]


@pytest.fixture
def client(control_plane, access_token) -> Iterator[httpx.Client]:
    headers = {"X-Access-Token": access_token}
    with httpx.Client(base_url=control_plane.envd.url, headers=headers, timeout=30) as c:
        yield c


# --- the SDKs ---------------------------------------------------------------------------


def test_sdk_reads_boot_id(sandbox):
    text = sandbox.files.read(BOOT_ID)
    assert len(text) == 37 and text.endswith("\n") and text == _read(BOOT_ID).decode()


def test_sdk_reads_cpuinfo(sandbox):
    text = sandbox.files.read("/proc/cpuinfo")
    assert "processor" in text
    assert _cpuinfo_without_mhz(text) == _cpuinfo_without_mhz(_read("/proc/cpuinfo").decode())


def test_sdk_reads_envd_status(sandbox, control_plane):
    pid = control_plane.envd.proc.pid
    fields = dict(
        line.split(":\t", 1) for line in sandbox.files.read(f"/proc/{pid}/status").splitlines()
    )
    assert fields["Pid"] == str(pid) and fields["Uid"].split()[0] == "0"


def test_sdk_reads_binary_pseudo_file_as_bytes(sandbox, control_plane):
    path = f"/proc/{control_plane.envd.proc.pid}/cmdline"
    data = sandbox.files.read(path, format="bytes")
    assert b"aenv.envd\x00" in data and bytes(data) == _read(path)


def test_sdk_streams_pseudo_file(sandbox):
    assert b"".join(sandbox.files.read(BOOT_ID, format="stream")) == _read(BOOT_ID)


async def test_async_sdk_reads_boot_id(async_sandbox):
    assert await async_sandbox.files.read(BOOT_ID) == _read(BOOT_ID).decode()


_JS_READ = """
import { Sandbox } from 'e2b'
const sbx = await Sandbox.create('base')
const bootId = await sbx.files.read(process.env.BOOT_ID)
const cpuinfo = await sbx.files.read('/proc/cpuinfo')
const big = await sbx.files.read(process.env.BIG, { format: 'bytes' })
console.log(JSON.stringify({ bootId, cpuinfo, bigLength: big.length }))
"""


@pytest.mark.js
def test_js_sdk_reads_pseudo_files(sdk_env, home_dir):
    js_dir = ROOT / "tests/js"
    if shutil.which("node") is None or not (js_dir / "node_modules/e2b").is_dir():
        pytest.fail("node or the e2b npm package is missing: run ./scripts/setup.sh")
    big = f"{home_dir}/big.bin"
    with open(big, "wb") as f:
        f.write(os.urandom(3 << 20))
    proc = subprocess.run(
        ["node", "--input-type=module", "-e", _JS_READ], cwd=js_dir,
        env={**os.environ, **sdk_env, "BOOT_ID": BOOT_ID, "BIG": big},
        capture_output=True, text=True, timeout=120, check=False,
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["bootId"] == _read(BOOT_ID).decode()
    assert _cpuinfo_without_mhz(out["cpuinfo"]) == _cpuinfo_without_mhz(
        _read("/proc/cpuinfo").decode()
    )
    assert out["bigLength"] == 3 << 20


# --- pseudo-files on the wire -----------------------------------------------------------


def test_small_pseudo_file_has_content_length_and_no_range_support(client):
    r = client.get("/files", params={"path": BOOT_ID}, headers={"Accept-Encoding": "identity"})
    assert r.status_code == 200 and r.content == _read(BOOT_ID)
    assert r.headers["content-length"] == "37"
    assert r.headers["content-type"] == "text/plain; charset=utf-8"
    assert r.headers["accept-ranges"] == "none"
    assert "last-modified" not in r.headers


def test_pseudo_file_gzip(client):
    with client.stream("GET", "/files", params={"path": "/proc/cpuinfo"},
                       headers={"Accept-Encoding": "gzip"}) as r:
        raw = b"".join(r.iter_raw())
    assert r.headers["content-encoding"] == "gzip"
    assert _cpuinfo_without_mhz(gzip.decompress(raw).decode()) == _cpuinfo_without_mhz(
        _read("/proc/cpuinfo").decode()
    )


def test_range_on_pseudo_file_gets_the_whole_content(client):
    r = client.get("/files", params={"path": BOOT_ID}, headers={"Range": "bytes=0-3"})
    assert r.status_code == 200 and r.content == _read(BOOT_ID)
    assert "content-range" not in r.headers


def test_conditional_on_pseudo_file_is_never_304(client):
    r = client.get("/files", params={"path": BOOT_ID},
                   headers={"If-Modified-Since": "Fri, 01 Jan 2100 00:00:00 GMT"})
    assert r.status_code == 200 and r.content == _read(BOOT_ID)


def test_pseudo_file_larger_than_a_read_is_chunked(client):
    if os.path.getsize("/proc/kallsyms") != 0 or len(_read("/proc/kallsyms")) < 2 * download.CHUNK:
        pytest.skip("this kernel's /proc/kallsyms is not a large pseudo-file")
    with client.stream("GET", "/files", params={"path": "/proc/kallsyms"},
                       headers={"Accept-Encoding": "identity"}) as r:
        body = r.read()
    assert r.status_code == 200
    assert "content-length" not in r.headers and r.headers["transfer-encoding"] == "chunked"
    assert body == _read("/proc/kallsyms")


def test_head_of_pseudo_file(client):
    r = client.head("/files", params={"path": BOOT_ID}, headers={"Accept-Encoding": "identity"})
    assert r.status_code == 200 and r.content == b"" and r.headers["content-length"] == "37"


@pytest.mark.parametrize("path", ["/dev/urandom", "/dev/zero", "/dev/null"])
def test_devices_are_refused(client, path):
    r = client.get("/files", params={"path": path})
    assert r.status_code == 400
    assert r.json()["message"] == f"path '{path}' is not a regular file"


def test_fifo_is_refused_without_waiting_for_a_writer(client, home_dir):
    os.mkfifo(f"{home_dir}/pipe")
    started = time.monotonic()
    r = client.get("/files", params={"path": f"{home_dir}/pipe"})
    assert r.status_code == 400 and time.monotonic() - started < 5


# --- regular files keep what they had ---------------------------------------------------


@pytest.fixture
def big_file(home_dir) -> tuple[str, bytes]:
    data = os.urandom(5 << 20) + b"tail of a text part " * 50000
    path = f"{home_dir}/big.bin"
    with open(path, "wb") as f:
        f.write(data)
    return path, data


def test_empty_regular_file_is_still_an_empty_200(client, home_dir):
    open(f"{home_dir}/empty", "wb").close()
    r = client.get("/files", params={"path": f"{home_dir}/empty"},
                   headers={"Accept-Encoding": "identity"})
    assert (r.status_code, r.content, r.headers["content-length"]) == (200, b"", "0")
    assert r.headers["accept-ranges"] == "bytes" and "last-modified" in r.headers


def test_large_regular_file_has_content_length(client, big_file):
    path, data = big_file
    r = client.get("/files", params={"path": path}, headers={"Accept-Encoding": "identity"})
    assert r.status_code == 200 and r.headers["content-length"] == str(len(data))
    assert r.headers["accept-ranges"] == "bytes" and r.content == data


def test_large_regular_file_through_the_sdk(sandbox, big_file):
    path, data = big_file
    assert bytes(sandbox.files.read(path, format="bytes")) == data


def test_large_regular_file_gzip(client, big_file):
    path, data = big_file
    with client.stream("GET", "/files", params={"path": path},
                       headers={"Accept-Encoding": "gzip"}) as r:
        raw = b"".join(r.iter_raw())
    assert r.headers["content-encoding"] == "gzip" and gzip.decompress(raw) == data


def test_range_on_large_regular_file(client, big_file):
    path, data = big_file
    start, end = (3 << 20) - 7, (4 << 20) + 11
    r = client.get("/files", params={"path": path}, headers={"Range": f"bytes={start}-{end}"})
    assert r.status_code == 206 and r.content == data[start : end + 1]
    assert r.headers["content-range"] == f"bytes {start}-{end}/{len(data)}"
    assert r.headers["content-length"] == str(end - start + 1)


# --- in process: the read-ahead and the cap ---------------------------------------------


async def _serve(path: str, coding: str = "identity") -> list[dict]:
    fd, st = download.open_regular(path)
    sent: list[dict] = []

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client never goes away
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await download.FileDownload(fd, st, path, path, coding, Headers(), "GET")(
        {"type": "http"}, receive, send
    )
    return sent


async def test_pseudo_file_streams_in_reads_of_one_chunk(monkeypatch):
    monkeypatch.setattr(download, "CHUNK", 8)
    sent = await _serve(BOOT_ID)
    headers = dict(sent[0]["headers"])
    assert b"content-length" not in headers
    assert b"".join(m.get("body", b"") for m in sent[1:]) == _read(BOOT_ID)
    assert sent[-1]["more_body"] is False and len(sent) > 3


async def test_pseudo_file_past_the_cap_ends_without_completing_the_response(monkeypatch):
    monkeypatch.setattr(download, "CHUNK", 8)
    monkeypatch.setattr(download, "UNKNOWN_SIZE_LIMIT", 20)
    sent = await _serve(BOOT_ID)
    assert all(m.get("more_body", True) for m in sent[1:])
    assert len(b"".join(m.get("body", b"") for m in sent[1:])) <= 24


async def test_pseudo_file_gzip_in_process(monkeypatch):
    monkeypatch.setattr(download, "CHUNK", 8)
    sent = await _serve(BOOT_ID, "gzip")
    assert gzip.decompress(b"".join(m.get("body", b"") for m in sent[1:])) == _read(BOOT_ID)


def test_pseudo_file_whose_first_read_fails_is_a_500(client, control_plane):
    # Reading a process's memory at address 0 is EIO: an error, not an empty file.
    path = f"/proc/{control_plane.envd.proc.pid}/mem"
    r = client.get("/files", params={"path": path}, headers={"Accept-Encoding": "identity"})
    assert r.status_code == 500 and r.json()["message"].startswith(f"error reading file '{path}'")


def test_a_read_that_would_wait_ends_the_content():
    # What /proc/kmsg or trace_pipe do when opened O_NONBLOCK with nothing to give.
    r, w = os.pipe()
    try:
        os.set_blocking(r, False)
        os.write(w, b"now")
        assert download._read_head(r, 100) == (b"now", True)
    finally:
        os.close(r)
        os.close(w)
