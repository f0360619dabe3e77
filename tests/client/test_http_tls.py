"""The envd client verifies TLS: the CLI reaches envd through ``--url``, which may be
``https://`` on another machine, and used to accept any certificate there.

A loopback TLS server with a self-signed certificate (made by ``openssl``) stands in
for such a server.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest

from aenv.client import http
from aenv.client.envd import EnvdClient

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")


@pytest.fixture(scope="module")
def cert(tmp_path_factory) -> tuple[Path, Path]:
    d = tmp_path_factory.mktemp("tls")
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
         "-subj", "/CN=aenv-test", "-addext", "subjectAltName=IP:127.0.0.1",
         "-keyout", str(d / "key.pem"), "-out", str(d / "cert.pem")],
        check=True, capture_output=True)
    return d / "cert.pem", d / "key.pem"


@pytest.fixture
async def tls_server(cert) -> AsyncIterator[str]:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(*cert)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 204 No Content\r\nConnection: close\r\n\r\n")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=ctx)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"https://127.0.0.1:{port}"
    finally:
        server.close()
        await server.wait_closed()


def _reread_settings() -> None:
    if hasattr(http, "tls_verification"):
        http.tls_verification.cache_clear()


@pytest.fixture(autouse=True)
def fresh_settings(monkeypatch) -> Iterator[None]:
    for name in ("AENV_TLS_VERIFY", "SSL_CERT_FILE", "SSL_CERT_DIR"):
        monkeypatch.delenv(name, raising=False)
    _reread_settings()
    yield
    _reread_settings()


async def test_an_untrusted_certificate_is_refused_by_default(tls_server) -> None:
    async with http.plain_client() as client:
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await client.get(tls_server + "/health")


async def test_the_clis_envd_client_verifies_the_server(tls_server) -> None:
    envd = EnvdClient.through_proxy(tls_server, "sbxa", None)
    try:
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            await envd.http.get(tls_server + "/health")
    finally:
        await envd.aclose()


async def test_ssl_cert_file_makes_a_private_ca_trusted(tls_server, cert, monkeypatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(cert[0]))
    async with http.plain_client() as client:
        assert (await client.get(tls_server + "/health")).status_code == 204


async def test_aenv_tls_verify_0_is_the_explicit_opt_out(tls_server, monkeypatch) -> None:
    monkeypatch.setenv("AENV_TLS_VERIFY", "0")
    async with http.plain_client() as client:
        assert (await client.get(tls_server + "/health")).status_code == 204


def test_the_verifying_context_is_built_once_and_shared() -> None:
    assert http.tls_verification() is http.tls_verification()
    assert isinstance(http.tls_verification(), ssl.SSLContext)
