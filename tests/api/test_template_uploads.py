"""COPY archive uploads through the real REST app (uvicorn on a loopback port): the link
``GET /templates/{id}/files/{hash}`` hands out and the ``PUT`` on it.

The app is ``create_api`` with the real template store and ``Builder`` (nothing here
boots a VM: uploads happen before a build starts).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import io
import os
import tarfile
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from types import SimpleNamespace
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
import uvicorn

from aenv.api.app import create_api
from aenv.orchestrator.builds import Builder
from aenv.store import TemplateStore
from aenv.store.db import Database
from tests.conftest import free_port

KEY = "e2b_" + "1" * 40
HASH = "ab" * 32
MiB = 1 << 20


def make_tar(files: dict[str, bytes], *, gzip: bool = False) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz" if gzip else "w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


class Api:
    def __init__(self, url: str, files_dir: Path, template_id: str) -> None:
        self.url, self.files_dir, self.template_id = url, files_dir, template_id
        self.http = httpx.AsyncClient(base_url=url, timeout=120)

    async def link(self, files_hash: str = HASH) -> dict:
        r = await self.http.get(f"/templates/{self.template_id}/files/{files_hash}",
                                headers={"X-API-KEY": KEY})
        assert r.status_code == 201, r.text
        return r.json()

    async def put(self, url: str, body: bytes | AsyncIterator[bytes], *,
                  length: int | None = None) -> httpx.Response:
        """As the SDK uploads: no API key, an exact Content-Length, never chunked."""
        size = len(body) if isinstance(body, bytes) else length
        return await self.http.put(url, content=body, headers={"Content-Length": str(size)})

    def leftovers(self) -> list[str]:
        return sorted(p.name for p in self.files_dir.glob(".*"))


def _server(tmp_path: Path, **options) -> tuple[uvicorn.Server, str, Builder, Path]:
    """The app over a fresh template store, as a uvicorn server on a free loopback port
    (not started): the server, its URL, its ``Builder`` and the directory uploads land in."""
    templates = TemplateStore(Database(tmp_path / "aenv.db"))
    files_dir = tmp_path / "build-files"
    builder = Builder(templates, None, files_dir)
    app = create_api(SimpleNamespace(templates=templates), api_key=KEY, domain="localhost",
                     metrics=None, logs=lambda *a, **k: [], builder=builder,
                     upload_secret=b"secret", **options)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    return server, f"http://127.0.0.1:{port}", builder, files_dir


@contextlib.asynccontextmanager
async def serve(tmp_path: Path, **options) -> AsyncIterator[Api]:
    server, url, builder, files_dir = _server(tmp_path, **options)
    tpl, _, _ = builder.request("uploads-test")
    task = asyncio.create_task(server.serve())
    while not server.started:
        await asyncio.sleep(0.01)
    api = Api(url, files_dir, tpl.id)
    try:
        yield api
    finally:
        await api.http.aclose()
        server.should_exit = True
        await task


@pytest.fixture
async def api(tmp_path) -> AsyncIterator[Api]:
    async with serve(tmp_path) as a:
        yield a


@contextlib.contextmanager
def serve_in_thread(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """The app served from a thread, for a client that blocks (an SDK's own build): its URL
    and the directory uploads land in."""
    server, url, _, files_dir = _server(tmp_path)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield url, files_dir
    finally:
        server.should_exit = True
        thread.join(10)


def _stored(api: Api, files_hash: str = HASH) -> Path:
    return api.files_dir / f"{files_hash}.tar"


async def test_a_50_mib_context_streams_to_disk_through_the_route(api, tmp_path) -> None:
    archive = make_tar({"big.bin": os.urandom(50 * MiB), "small.txt": b"hi\n"})
    link = await api.link()
    assert link["present"] is False
    seen_on_disk: list[int] = []

    async def body() -> AsyncIterator[bytes]:
        for i in range(0, len(archive), MiB):
            if i == 40 * MiB:  # the first 40 MiB must be on disk already, not in memory
                await asyncio.sleep(0.2)
                seen_on_disk.extend(p.stat().st_size for p in api.files_dir.glob(".*.part"))
            yield archive[i:i + MiB]

    r = await api.put(link["url"], body(), length=len(archive))
    assert r.status_code == 200, r.text
    assert seen_on_disk and seen_on_disk[0] >= 39 * MiB
    assert hashlib.sha256(_stored(api).read_bytes()).digest() == hashlib.sha256(archive).digest()
    assert api.leftovers() == []
    assert (await api.link()) == {"present": True}


async def test_other_routes_keep_the_1_mib_body_limit(api) -> None:
    r = await api.http.post("/v3/templates", content=b"x" * (2 * MiB),
                            headers={"X-API-KEY": KEY, "Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["code"] == 413


async def test_the_upload_limit_is_configurable_and_leaves_nothing_behind(tmp_path) -> None:
    async with serve(tmp_path, upload_limit=2 * MiB) as api:
        link = await api.link()
        too_big = make_tar({"f": b"\0" * (3 * MiB)})
        r = await api.put(link["url"], too_big)  # refused by its Content-Length
        assert r.status_code == 413 and r.json() == {"code": 413,
                                                     "message": "request body too large"}

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length to refuse it by
            for i in range(0, 2 * MiB + 64 * 1024, 64 * 1024):
                yield too_big[i:i + 64 * 1024]
        r = await api.http.put(link["url"], content=chunked())
        assert r.status_code == 413 and r.json()["code"] == 413
        assert api.leftovers() == []
        ok = await api.put(link["url"], make_tar({"f": b"\0" * MiB}))
        assert ok.status_code == 200
        assert api.leftovers() == []


async def test_concurrent_uploads_of_one_hash_store_one_whole_archive(api) -> None:
    link = await api.link()
    bodies = [make_tar({"f": bytes([i]) * (4 * MiB)}) for i in range(4)]

    async def slow(data: bytes) -> AsyncIterator[bytes]:
        for i in range(0, len(data), 256 * 1024):
            yield data[i:i + 256 * 1024]
            await asyncio.sleep(0)

    rs = await asyncio.gather(*(api.put(link["url"], slow(b), length=len(b)) for b in bodies))
    assert [r.status_code for r in rs] == [200] * 4, [r.text for r in rs]
    assert _stored(api).read_bytes() in bodies  # one of them, whole, not a mix
    assert api.leftovers() == []


async def test_concurrent_uploads_of_different_hashes_all_land(api) -> None:
    hashes = [f"{i:02x}" * 32 for i in range(4)]
    links = [await api.link(h) for h in hashes]
    bodies = [make_tar({"f": bytes([i]) * MiB}) for i in range(4)]
    rs = await asyncio.gather(*(api.put(ln["url"], b) for ln, b in zip(links, bodies,
                                                                         strict=True)))
    assert all(r.status_code == 200 for r in rs)
    for h, b in zip(hashes, bodies, strict=True):
        assert _stored(api, h).read_bytes() == b


async def test_a_stored_archive_is_kept_when_the_hash_is_uploaded_again(api) -> None:
    link = await api.link()
    first, second = make_tar({"f": b"first"}), make_tar({"f": b"second"})
    assert (await api.put(link["url"], first)).status_code == 200
    again = await api.put(link["url"], second)
    assert again.status_code == 200  # success, as for an upload the cache already has
    assert _stored(api).read_bytes() == first
    assert api.leftovers() == []


async def test_upload_links_expire(tmp_path) -> None:
    async with serve(tmp_path, upload_link_ttl=-1) as api:
        link = await api.link()
        r = await api.put(link["url"], make_tar({"f": b"late"}))
        assert r.status_code == 403
        assert r.json() == {"code": 403, "message": "upload link expired; ask for a new one"}
        assert not _stored(api).exists()


async def test_the_expiry_is_signed_with_the_token(api) -> None:
    url = urlsplit((await api.link())["url"])
    q = parse_qs(url.query)
    later = int(time.time()) + 10**6
    forged = f"{url.path}?expires={later}&token={q['token'][0]}"
    r = await api.put(forged, make_tar({"f": b"x"}))
    assert r.status_code == 403 and r.json()["message"] == "invalid upload token"
    no_expiry = await api.put(f"{url.path}?token={q['token'][0]}", make_tar({"f": b"x"}))
    assert no_expiry.status_code == 403
    other_hash = await api.put(url.path.replace(HASH, "cd" * 32) + "?" + url.query,
                               make_tar({"f": b"x"}))
    assert other_hash.status_code == 403
    odd = await api.put(f"{url.path}?expires={q['expires'][0]}&token=%C3%A9", b"x")
    assert odd.status_code == 403  # not a 500 from comparing a non-ASCII str
    assert not _stored(api).exists()


async def test_the_link_names_its_expiry(api) -> None:
    q = parse_qs(urlsplit((await api.link())["url"]).query)
    assert 29 * 60 <= int(q["expires"][0]) - time.time() <= 30 * 60


async def test_a_body_that_is_not_a_tar_is_400_and_not_stored(api) -> None:
    link = await api.link()
    r = await api.put(link["url"], b"this is not a tar archive" * 100)
    assert r.status_code == 400 and r.json()["message"].startswith("invalid COPY archive")
    assert not _stored(api).exists() and api.leftovers() == []
    ok = await api.put(link["url"], make_tar({"f": b"fine"}, gzip=True))
    assert ok.status_code == 200


async def test_a_member_outside_the_archive_root_is_400(api) -> None:
    link = await api.link()
    r = await api.put(link["url"], make_tar({"../escape": b"x"}))
    assert r.status_code == 400 and "outside" in r.json()["message"]


def test_the_sdks_own_upload_lands_and_matches_its_files_hash(tmp_path, monkeypatch) -> None:
    """``Template.build`` of the E2B SDK against this app: its upload (its own HTTP stack,
    exact Content-Length, the URL as given) is stored, and the archive matches the
    step's ``filesHash``. The build itself then fails: there is no ``base`` template."""
    from e2b import Template
    from e2b.exceptions import BuildException

    from aenv.storage.build_archives import HashCheck, verify_files_hash

    ctx = tmp_path / "ctx"
    (ctx / "app").mkdir(parents=True)
    (ctx / "app/big.bin").write_bytes(os.urandom(3 * MiB))
    (ctx / "notes.txt").write_text("notes\n")
    with serve_in_thread(tmp_path) as (url, files_dir):
        for k, v in {"E2B_API_KEY": KEY, "E2B_API_URL": url, "E2B_DOMAIN": "localhost"}.items():
            monkeypatch.setenv(k, v)
        template = (Template(file_context_path=str(ctx)).from_template("base")
                    .copy("app", "/home/user/app/").copy("notes.txt", "/opt/notes.txt"))
        with pytest.raises(BuildException):
            Template.build(template, "sdk-upload-test")
    steps = template._template._instructions_with_hashes()
    copies = [s for s in steps if s["type"] == "COPY"]
    assert len(copies) == 2
    for s in copies:
        archive = files_dir / f"{s['filesHash']}.tar"
        assert archive.exists()
        src, dest = s["args"][:2]
        assert verify_files_hash(archive, src=src, dest=dest,
                                 files_hash=s["filesHash"]) is HashCheck.MATCH


@pytest.mark.js
def test_the_js_sdks_uploads_land_and_are_checked_as_far_as_they_can_be(tmp_path) -> None:
    """``Template.build`` of the E2B JS SDK: its parallel uploads are stored; archives
    without directories match their ``filesHash``; one with a directory is
    ``UNVERIFIABLE`` (the JS SDK hashes directory sizes, which the archive lacks)."""
    import shutil

    from aenv.storage.build_archives import HashCheck, verify_files_hash
    from tests.conftest import ROOT, run_json_script

    if shutil.which("node") is None or not (ROOT / "tests/js/node_modules/e2b").is_dir():
        pytest.skip("node or the e2b npm package is missing: run ./scripts/setup.sh")
    ctx = tmp_path / "ctx"
    (ctx / "app/sub").mkdir(parents=True)
    (ctx / "app/sub/main.js").write_text("console.log(1)\n")
    (ctx / "big.bin").write_bytes(os.urandom(3 * MiB))
    (ctx / "small.bin").write_bytes(b"\0\1\2")
    (ctx / "notes.txt").write_text("notes\n")
    with serve_in_thread(tmp_path) as (url, files_dir):
        out = run_json_script(["node", "template_upload.mjs"], {
            "E2B_API_KEY": KEY, "E2B_API_URL": url,
            "E2B_DOMAIN": "localhost", "AENV_JS_CONTEXT": str(ctx)}, cwd=ROOT / "tests/js")
    assert out["failed"] is True and "not found" in out["error"]  # the build start, after
    checks = {}
    for src, dest, files_hash in out["copies"]:
        archive = files_dir / f"{files_hash}.tar"
        assert archive.exists(), src
        checks[src] = verify_files_hash(archive, src=src, dest=dest, files_hash=files_hash)
    assert checks == {"notes.txt": HashCheck.MATCH, "*.bin": HashCheck.MATCH,
                      "app": HashCheck.UNVERIFIABLE}
