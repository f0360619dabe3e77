"""``sandbox.get_host(port)`` end to end: ``aenv server --tls-self-signed --domain aenv.test``
on port 443, the real E2B Python SDK given only ``E2B_DOMAIN`` (+ the key and the CA), and
``https://<port>-<id>.aenv.test`` fetched with no port and full certificate checks.

How names resolve, with no ``/etc/hosts`` entry and nothing changed for the rest of the
host: the test starts dnsmasq on a loopback address answering ``aenv.test`` and every name
under it with the server's loopback address, and runs the client in a private mount
namespace (``unshare --mount``) where a resolv.conf naming that dnsmasq is bind-mounted over
``/etc/resolv.conf``. That is what ``ip netns exec`` does with ``/etc/netns/<ns>/resolv.conf``,
without a network namespace: the client stays in the host's, so every packet (DNS, REST,
envd, the page) travels over loopback. Both resolvers the client uses read it: glibc's
(urllib, httpx) and hickory's (pyqwest, which carries the SDK's REST and envd calls).
dnsmasq logs each query, so the test also sees that the names were looked up there.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import ROOT, stop_process

from .conftest import ServerProcess, serving
from .get_host_client import PAGE

pytestmark = [pytest.mark.vm, pytest.mark.net]

DOMAIN = "aenv.test"        # .test is reserved (RFC 2606): never a real name
SERVER_ADDR = "127.0.83.1"  # loopback addresses of this test's own
DNS_ADDR = "127.0.83.53"
CLIENT = Path(__file__).with_name("get_host_client.py")


def _bindable(addr: str, port: int, kind: int = socket.SOCK_STREAM) -> bool:
    with socket.socket(socket.AF_INET, kind) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return False
            raise
    return True


class TlsServerProcess(ServerProcess):
    """``aenv server`` on SERVER_ADDR:443 with TLS from its own local CA for DOMAIN."""

    def __init__(self, home: Path) -> None:
        super().__init__(home, prefix="aenvtl", net=23)
        self.port = 443
        self.url = f"https://{SERVER_ADDR}"
        self.ca = home / "secrets" / "tls" / DOMAIN / "ca.pem"
        for k in ("AENV_TLS_CERT", "AENV_TLS_KEY", "AENV_API_KEY"):
            self.env.pop(k, None)
        self.env.update({"AENV_LISTEN_HOST": SERVER_ADDR, "AENV_DOMAIN": DOMAIN,
                         "AENV_TLS_SELF_SIGNED": "1"})

    def _verify(self) -> ssl.SSLContext:
        """For the harness's own calls, which go to the address: the chain is checked
        against the CA, the name is not (the client under test checks both)."""
        ctx = ssl.create_default_context(cafile=str(self.ca))
        ctx.check_hostname = False
        return ctx

    def answers(self) -> bool:
        if self.ca.exists():  # written whole (renamed into place) or not at all
            try:
                r = httpx.get(self.url + "/health", verify=self._verify(), timeout=1)
                return r.status_code == 204
            except httpx.HTTPError:
                return False
        # a server that ignored the TLS options says so here, not in 10 minutes
        try:
            httpx.get(f"http://{SERVER_ADDR}:{self.port}/health", timeout=1)
        except httpx.HTTPError:
            return False
        raise RuntimeError(f"plain HTTP on port {self.port} and no CA at {self.ca}")

    def api(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers={"X-API-KEY": self.api_key},
                            timeout=120, verify=self._verify())


class Dns:
    """dnsmasq on DNS_ADDR:53 answering DOMAIN and every name below it with SERVER_ADDR,
    with NODATA for AAAA, and nothing for any other name (no upstream)."""

    def __init__(self, workdir: Path) -> None:
        self.resolv_conf = workdir / "resolv.conf"
        self.resolv_conf.write_text(f"nameserver {DNS_ADDR}\n")
        self.log = workdir / "dnsmasq.log"
        self.proc = subprocess.Popen(
            ["dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--no-resolv",
             "--no-hosts", "--no-poll", "--bind-interfaces", f"--listen-address={DNS_ADDR}",
             "--port=53", f"--local=/{DOMAIN}/", f"--address=/{DOMAIN}/{SERVER_ADDR}",
             "--log-queries", f"--log-facility={self.log}", "--pid-file=", "--user=root"],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True)
        deadline = time.monotonic() + 10
        while not self.log.exists() or "started" not in self.log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                out = self.proc.communicate()[0] if self.proc.poll() is not None else ""
                stop_process(self.proc)
                raise RuntimeError(f"dnsmasq did not start: {out}")
            time.sleep(0.05)

    def queries(self) -> str:
        return self.log.read_text()

    def stop(self) -> None:
        stop_process(self.proc)


@pytest.fixture
def dns(tmp_path: Path) -> Iterator[Dns]:
    for tool in ("dnsmasq", "unshare", "mount"):
        if shutil.which(tool) is None:
            pytest.fail(f"{tool} is missing: run ./scripts/setup.sh (dnsmasq-base)")
    if not _bindable(DNS_ADDR, 53, socket.SOCK_DGRAM):
        pytest.skip(f"{DNS_ADDR}:53 is taken (a DNS server on 0.0.0.0?)")
    d = Dns(tmp_path)
    try:
        yield d
    finally:
        d.stop()


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServerProcess]:
    if os.geteuid() == 0 and not _bindable(SERVER_ADDR, 443):
        pytest.skip(f"{SERVER_ADDR}:443 is taken (a web server on 0.0.0.0:443?)")
    with serving(TlsServerProcess(tmp_path_factory.mktemp("aenv-tls") / "home")) as srv:
        yield srv


def _run_client(srv: TlsServerProcess, dns: Dns, argv: list[str], cwd: Path = ROOT,
                **env: str) -> dict:
    """Run a client with the test's resolver and only ``E2B_DOMAIN`` and the key set; it
    prints its observations as one JSON object on its last line."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("E2B_", "AENV_", "SSL_CERT_", "REQUESTS_CA_", "NODE_EXTRA_CA"))}
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "--",
         "sh", "-c", 'mount --bind "$0" /etc/resolv.conf && exec "$@"',
         str(dns.resolv_conf), *argv],
        cwd=cwd, env={**base, "E2B_DOMAIN": DOMAIN, "E2B_API_KEY": srv.api_key, **env},
        capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, (
        f"client failed:\n{proc.stdout}\n{proc.stderr[-6000:]}\n--- server:\n"
        f"{srv.log_tail()}\n--- dns:\n{dns.queries()[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(1200)
def test_get_host_over_https_with_only_E2B_DOMAIN(tls_server: TlsServerProcess,
                                                 dns: Dns) -> None:
    srv = tls_server
    # The server said where the CA is, and how clients trust it.
    log = srv.log_path.read_text()
    assert f"SSL_CERT_FILE={srv.ca}" in log and f"NODE_EXTRA_CA_CERTS={srv.ca}" in log
    assert f"listening on https://{SERVER_ADDR}:443" in log

    out = _run_client(srv, dns, [sys.executable, str(CLIENT)],
                      SSL_CERT_FILE=str(srv.ca), PYTHONPATH=str(ROOT))
    sid = out["sandbox_id"]
    assert out["api_url"] == f"https://api.{DOMAIN}"
    assert out["envd_url"] == f"https://49983-{sid}.{DOMAIN}"
    assert out["echo"] == "hello over tls\n"
    assert out["host"] == f"8080-{sid}.{DOMAIN}"
    assert (out["status"], out["body"]) == (200, PAGE)
    assert str(out["download_url"]).startswith(f"https://49983-{sid}.{DOMAIN}/files?")
    assert out["download"] == PAGE
    # Every name was looked up at the test's dnsmasq.
    queries = dns.queries()
    for name in (f"api.{DOMAIN}", f"49983-{sid}.{DOMAIN}", f"8080-{sid}.{DOMAIN}"):
        assert f"query[A] {name} from 127." in queries, name
    with srv.api() as c:  # the client killed its sandbox
        assert c.get("/v2/sandboxes").json() == []


@pytest.mark.js
@pytest.mark.timeout(900)
def test_the_js_sdk_get_host_over_https_with_only_E2B_DOMAIN(tls_server: TlsServerProcess,
                                                             dns: Dns) -> None:
    js = ROOT / "tests/js"
    if shutil.which("node") is None or not (js / "node_modules/e2b").is_dir():
        pytest.fail("node or the e2b npm package is missing: run ./scripts/setup.sh")
    out = _run_client(tls_server, dns, ["node", "get_host_client.mjs"], cwd=js,
                      NODE_EXTRA_CA_CERTS=str(tls_server.ca))
    sid = out["sandboxId"]
    assert out["echo"] == "hello from node\n"
    assert out["host"] == f"8080-{sid}.{DOMAIN}"
    assert (out["status"], out["body"]) == (200, out["page"])
    queries = dns.queries()
    for name in (f"api.{DOMAIN}", f"49983-{sid}.{DOMAIN}", f"8080-{sid}.{DOMAIN}"):
        assert f"query[A] {name} from 127." in queries, name


def test_the_listener_speaks_only_tls(tls_server: TlsServerProcess) -> None:
    with pytest.raises(httpx.HTTPError):
        httpx.get(f"http://{SERVER_ADDR}:443/health", timeout=5)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        httpx.get(f"https://{SERVER_ADDR}/health", timeout=5)  # not trusted by default
